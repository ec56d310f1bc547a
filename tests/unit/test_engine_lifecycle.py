"""EngineAdmin's lifecycle (close, release): the runtime calls it directly; an adapter written before
the protocol declared it is admitted, wrapped once, with no-ops for what it lacks."""

from __future__ import annotations

import inspect
import warnings

import pytest

from lorapub.errors import InvalidInput
from lorapub.ports import ChecksTransport, EngineAdmin, ReportsEndTimings, ReportsInventory, ReportsLimits, TakesTransport
from lorapub.runtime import admission
from lorapub.runtime.admission import check_engines, with_lifecycle
from lorapub.runtime.deployment import Deployment
from lorapub.testing import MemoryEngine, lora_snapshot
from tests.e2e.conftest import FAST

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}


class OldEngine:
    """An embedder's adapter of the protocol before close()/release(): every operation, forwarded."""

    def __init__(self, inner: MemoryEngine, *, inventory: bool = True) -> None:
        self.inner, self.name = inner, inner.name
        if inventory:
            self.inventory = inner.inventory

    async def incarnation(self):
        return await self.inner.incarnation()

    async def begin(self, request):
        return await self.inner.begin(request)

    async def receive_bucket(self, token, index, payload):
        return await self.inner.receive_bucket(token, index, payload)

    async def end(self, token):
        return await self.inner.end(token)

    async def cleanup(self, token, lora_name):
        return await self.inner.cleanup(token, lora_name)

    async def reclaim(self, lora_name, reclaim_id):
        return await self.inner.reclaim(lora_name, reclaim_id)

    async def generate(self, payload):
        return await self.inner.generate(payload)


class OldWithClose(OldEngine):
    closed = 0

    async def close(self):
        self.closed += 1


def test_engine_admin_declares_its_lifecycle():
    assert inspect.iscoroutinefunction(EngineAdmin.close) and inspect.iscoroutinefunction(EngineAdmin.release)
    assert isinstance(MemoryEngine("e0"), EngineAdmin)
    assert not isinstance(OldEngine(MemoryEngine("e0")), EngineAdmin)


def test_a_current_adapter_is_held_as_it_is():
    e0 = MemoryEngine("e0")
    assert check_engines({"e0": e0})["e0"] is e0


def test_an_old_adapter_is_wrapped_once_and_keeps_its_optional_protocols():
    old = OldEngine(MemoryEngine("e0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: it keeps working as it did
        held = check_engines({"e0": old})["e0"]
    assert held is not old and isinstance(held, EngineAdmin) and held.name == "e0"
    assert isinstance(held, ReportsInventory) and not isinstance(held, ReportsLimits)
    assert not isinstance(held, TakesTransport)
    assert not isinstance(check_engines({"e0": OldEngine(MemoryEngine("e0"), inventory=False)})["e0"], ReportsInventory)
    assert held.inner is old and with_lifecycle(old, held) is held  # the same adapter again: the same wrapper


def test_an_adapter_lacking_an_operation_is_still_refused_naming_it():
    class NoReclaim(OldEngine):
        reclaim = None

    with pytest.raises(InvalidInput, match="lacks reclaim"):
        check_engines({"e0": NoReclaim(MemoryEngine("e0"))})


async def test_an_old_adapter_publishes_serves_and_closes():
    plain, closing = OldEngine(MemoryEngine("e0")), OldWithClose(MemoryEngine("e1"))
    dep = await Deployment({"e0": plain, "e1": closing}, epoch=1, deadlines=FAST).start()
    a = await dep.publish(lora_snapshot(1), "A")
    assert plain.inner.serves(a.lora_name) and closing.inner.serves(a.lora_name)
    assert (await dep.session("s").generate(GEN))["lorapub"]["version_id"] == "A"
    e2 = OldEngine(MemoryEngine("e2"))
    await dep.add_engine(e2)
    assert e2.inner.serves(a.lora_name)
    await dep.close()  # own_engines: the one with close() is closed, the other has nothing to close
    assert closing.closed == 1


async def test_the_runtime_reads_nothing_through_the_wrappers_pass_through(monkeypatch):
    """The wrapper passes the embedder's own reads of its adapter through (``__getattr__``); the runtime
    asks by type only: with that pass-through answering nothing, an old adapter still publishes, serves,
    joins and closes."""
    asked = []

    def nothing(self, name):
        asked.append(name)
        raise AttributeError(name)

    monkeypatch.setattr(admission._Lifecycle, "__getattr__", nothing)
    await test_an_old_adapter_publishes_serves_and_closes()
    assert not {name for name in asked if not name.startswith("_")} - {
        "limits", "end_timings", "transport", "use_transport", "can_use_transport"}, asked  # isinstance's look-ups


def test_the_wrapper_keeps_each_optional_protocol_only_where_the_adapter_has_it():
    class Full(OldEngine):
        transport = "t"

        async def limits(self):
            return None

        def end_timings(self, token):
            return None

        def use_transport(self, transport):
            self.transport = transport

        def can_use_transport(self, transport):
            return transport == "ok"

    held = check_engines({"e0": Full(MemoryEngine("e0"))})["e0"]
    for protocol in (ReportsInventory, ReportsLimits, ReportsEndTimings, TakesTransport, ChecksTransport):
        assert isinstance(held, protocol), protocol
    assert held.can_use_transport("ok") and not held.can_use_transport("no")
    held.use_transport("ok")
    assert held.transport == "ok" == held.inner.transport
    bare = check_engines({"e0": OldEngine(MemoryEngine("e0"), inventory=False)})["e0"]
    assert not {"inventory", "limits", "end_timings", "transport", "use_transport", "can_use_transport"} & set(dir(type(bare)))
