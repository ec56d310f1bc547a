"""max_lag is judged at dispatch against the default as this process knows it, however late the
registry's answers arrive (a remote registry's may be): a session more than ``max_lag`` commits
behind is never dispatched, and no result is served with a lag above ``max_lag``.

The registry here decides at once but holds some answers until the test releases them, so the
interleavings are exact, not timed.
"""

from __future__ import annotations

import asyncio

import pytest

from lorapub import BindingStale, Deployment
from lorapub.core.commands import AuthorizeDispatch, ClaimReclaim, ReadFleet
from lorapub.local_registry import LocalRegistry
from lorapub.testing import MemoryEngine, lora_snapshot
from tests.e2e.conftest import FAST

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


class LateRegistry:
    """A registry whose answers to the held kinds of command wait until released (decided at once)."""

    def __init__(self, inner: LocalRegistry) -> None:
        self.inner = inner
        self.gates: dict[type, asyncio.Event] = {}
        self.reached: dict[type, asyncio.Event] = {}

    @property
    def state(self):
        return self.inner.state

    def hold(self, *kinds: type) -> None:
        for kind in kinds:
            self.gates[kind], self.reached[kind] = asyncio.Event(), asyncio.Event()

    def release(self) -> None:
        for gate in self.gates.values():
            gate.set()
        self.gates.clear()

    async def handle(self, command):
        result = await self.inner.handle(command)
        gate = self.gates.get(type(command))
        if gate is not None:
            self.reached[type(command)].set()
            await gate.wait()
        return result


async def deployment(max_lag: int, on_stale: str = "error") -> tuple[Deployment, LateRegistry]:
    engines = {n: MemoryEngine(n, max_loaded=5, max_per_batch=5) for n in ("e0", "e1")}
    registry = LateRegistry(LocalRegistry(1, {n: e.incarnation_id for n, e in engines.items()}, capacity=4,
                                          max_lag=max_lag, on_stale=on_stale))
    dep = await Deployment(engines, epoch=1, registry=registry, capacity=4, max_lag=max_lag, on_stale=on_stale,
                           deadlines=FAST, reconcile_interval=None, decision_log=False).start()
    return dep, registry


async def commit_unseen(dep: Deployment, registry: LateRegistry, version_id: str, seed: int) -> asyncio.Task:
    """Publish ``version_id``; its commit lands, but this process's fleet view and the reclaim wait."""
    registry.hold(ReadFleet, ClaimReclaim)
    publishing = asyncio.ensure_future(dep.publish(lora_snapshot(seed), version_id))
    await registry.reached[ReadFleet].wait()  # the publish's refresh after its commit
    assert registry.state.default.version_id == version_id
    return publishing


@pytest.mark.parametrize("on_stale", ["error", "rebind"])
async def test_a_default_learnt_from_another_sessions_bind_makes_an_old_session_stale_at_once(on_stale):
    dep, registry = await deployment(max_lag=0, on_stale=on_stale)
    await dep.publish(lora_snapshot(1), "A")
    old = dep.session("old")
    await old.generate(GEN)
    publishing = await commit_unseen(dep, registry, "B", 2)
    new = await dep.session("new").generate(GEN)  # this process now knows B is the default
    assert new["lorapub"]["version_id"] == "B" and new["lorapub"]["lag"] == 0
    assert dep.fleet.retiring == frozenset()  # the registry's view of A retiring has not come
    if on_stale == "error":
        with pytest.raises(BindingStale) as err:
            await old.generate(GEN)
        assert err.value.code == "BINDING_STALE"
    else:
        out = await old.generate(GEN)
        assert out["lorapub"]["version_id"] == "B" and out["lorapub"]["lag"] == 0 and out["lorapub"]["rebinds"] == 1
    registry.release()
    await publishing
    await old.close()
    assert registry.state.versions[old.provenance[0][0]].session_refs == 0  # its ref on A is released
    await dep.close()


async def test_a_default_learnt_while_a_turn_awaits_the_registry_is_judged_when_the_request_is_sent():
    dep, registry = await deployment(max_lag=0)
    await dep.publish(lora_snapshot(1), "A")
    old = dep.session("old")
    await old.generate(GEN)
    old.lease_seen = float("-inf")  # its next turn asks the registry first (AuthorizeDispatch)
    registry.hold(AuthorizeDispatch)
    turn = asyncio.ensure_future(old.generate(GEN))
    await registry.reached[AuthorizeDispatch].wait()  # authorized on A: the answer is on its way
    publishing = await commit_unseen(dep, registry, "B", 2)
    await dep.session("new").generate(GEN)  # B learnt here while the answer is late
    registry.release()
    with pytest.raises(BindingStale):
        await turn  # never sent with lag 1
    await publishing
    await dep.close()
