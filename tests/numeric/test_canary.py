"""The canary: a resident version's probe re-run at a low rate; a drift marks it suspect in health and
status; avoid_suspect keeps new sessions off it, never moving sessions already bound."""

from __future__ import annotations

import asyncio

import pytest

from lorapub import Deployment, VersionKey, VersionSuspect
from lorapub.core.commands import MarkSuspect
from lorapub.core.registry import handle
from lorapub.core.registry.state import new_registry
from lorapub.runtime.runner import Deadlines
from lorapub.testing import MemoryEngine, lora_snapshot, reference_probe

QUICK = Deadlines(begin=1, bucket=1, end=3, cleanup=1, commit=1, reclaim=30)
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


def probed(seed: int):
    snap = lora_snapshot(seed)
    return snap.with_probe(reference_probe(snap))


async def deployment(**options) -> tuple[Deployment, dict[str, MemoryEngine]]:
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None, **options).start()
    return dep, engines


async def canary_passes(dep: Deployment, n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0.03)
        await dep.reconcile(wait=10.0)


async def test_the_canary_marks_a_drifting_version_suspect_in_health_and_status():
    events = []
    dep, engines = await deployment(canary_interval=0.01, observers=[events.append])
    a = await dep.publish(probed(1), "A")
    await canary_passes(dep)
    assert not any(b.kind == "version_suspect" for b in dep.health.blockers)  # no drift: nothing marked
    engines["e1"].drift(a.lora_name, 1.5)  # the engine now computes differently with the same bytes
    await canary_passes(dep)
    suspect = [b for b in dep.health.blockers if b.kind == "version_suspect"]
    assert suspect and suspect[0].subject == str(a.version) and "e1" in suspect[0].detail
    status = await dep.status()
    (v,) = [v for v in status.versions if v.version == str(a.version)]
    assert v.suspect is not None and "e1" in v.suspect
    assert (await dep.state()).versions[a.version].suspect is not None
    told = [e for e in events if e.KIND == "version.suspect"]
    assert len(told) == 1 and told[0].engine == "e1" and told[0].version == a.version
    await dep.close()


async def test_the_canary_is_off_by_default():
    dep, engines = await deployment()
    a = await dep.publish(probed(1), "A")
    before = {n: e.requests for n, e in engines.items()}
    engines["e0"].drift(a.lora_name, 2.0)
    await canary_passes(dep)
    assert {n: e.requests for n, e in engines.items()} == before
    assert (await dep.state()).versions[a.version].suspect is None
    await dep.close()


async def test_avoid_suspect_keeps_new_sessions_off_and_never_moves_bound_ones():
    dep, engines = await deployment(canary_interval=0.01, avoid_suspect=True)
    a = await dep.publish(probed(1), "A")
    bound = dep.session("bound")
    await bound.generate(GEN)
    engines["e0"].drift(a.lora_name, 1.5)
    await canary_passes(dep)
    assert (await dep.state()).versions[a.version].suspect is not None
    await bound.generate(GEN)  # a bound session keeps its version: never silently moved
    assert bound.binding.version == a.version
    with pytest.raises(VersionSuspect):
        await dep.session("new").generate(GEN)
    b = await dep.publish(probed(2), "B")  # a newer version clears the way
    fresh = dep.session("fresh")
    await fresh.generate(GEN)
    assert fresh.binding.version == b.version
    await dep.close()


def test_mark_suspect_in_the_core_is_idempotent_and_only_for_resident_versions():
    state = new_registry(1, {"e0": "life0"}, avoid_suspect=True)
    with pytest.raises(Exception):
        handle(state, MarkSuspect(VersionKey(1, "nope"), "e0", "drift"))
    assert state.avoid_suspect is True
