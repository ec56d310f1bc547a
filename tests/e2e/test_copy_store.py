"""Deployment(copies=): the frozen copies a publishing process keeps outlive it (a trainer's restart), so a
process started again still loads every version sessions may need on an engine that joins or restarts."""

from __future__ import annotations

import pytest

from lorapub import InvalidInput
from lorapub.integrations.relax.copies import LocalCopies
from lorapub.runtime.deployment import Deployment
from lorapub.local_registry import LocalRegistry
from lorapub.testing import MemoryEngine, lora_snapshot
from tests.e2e.conftest import FAST

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}


async def test_a_publisher_started_again_takes_back_the_copies_and_loads_them_on_a_new_engine():
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    registry = LocalRegistry(1, {n: e.incarnation_id for n, e in engines.items()})
    store = LocalCopies()
    first = await Deployment(engines, epoch=1, registry=registry, deadlines=FAST, own_engines=False,
                             reconcile_interval=None, copies=store).start()
    await first.publish(lora_snapshot(1), "A")
    held = first.session("held")
    await held.generate(GEN)  # A stays needed
    await first.publish(lora_snapshot(2), "B")
    assert {k.version_id for k, _ in store.items()} == {"A", "B"}
    await first.close()  # the trainer process goes; its sessions' worker is another process in a real run

    second = await Deployment(engines, epoch=1, registry=registry, deadlines=FAST, own_engines=False,
                              reconcile_interval=None, copies=store).start()
    try:
        assert "B" in {k.version_id for k in second.publisher.frozen.keys()}
        e2 = MemoryEngine("e2")
        await second.add_engine(e2, timeout=2.0)  # loaded from the copy the first process kept
        b = next(v for k, v in (await second.state()).versions.items() if k.version_id == "B")
        assert e2.serves(b.lora_name)
        assert (await second.session("new").generate(GEN))["lorapub"]["version_id"] == "B"
    finally:
        await second.close()


async def test_a_copy_store_that_fails_costs_nothing_but_a_warning(caplog):
    class Broken:
        def keep(self, key, snapshot):
            raise OSError("store down")

        def retain(self, keys):
            raise OSError("store down")

        def items(self):
            raise OSError("store down")

    dep = await Deployment({n: MemoryEngine(n) for n in ("e0", "e1")}, epoch=1, deadlines=FAST,
                           copies=Broken()).start()
    try:
        report = await dep.publish(lora_snapshot(1), "A")
        assert report.version.version_id == "A" and dep.publisher.frozen.get(report.version) is not None
        assert any("copy store" in r.getMessage() for r in caplog.records)
    finally:
        await dep.close()


def test_copies_must_be_a_copy_store():
    with pytest.raises(InvalidInput) as e:
        Deployment({"e0": MemoryEngine("e0")}, epoch=1, copies=object())
    assert "CopyStore" in e.value.message
