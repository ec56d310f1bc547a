"""An elastic fleet, end to end: engines join a running deployment, drain and leave it, racing
sessions that generate, publications and reclaims (docs/elastic.md)."""

from __future__ import annotations

import asyncio

import pytest

from lorapub import DrainTimeout, EngineCapacityError, EngineNotDrained, UnknownEngine
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.core.registry import Membership
from lorapub.core.version import VersionState
from lorapub.errors import EngineError
from lorapub.runtime.deployment import Deployment
from lorapub.local_registry import LocalRegistry
from lorapub.adapters.stores import SQLiteStore
from lorapub.testing import MemoryEngine, SGLangDouble, lora_snapshot
from tests.e2e.conftest import FAST
from tests.helpers.waiting import until

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 300}}  # 0.3 s on a MemoryEngine


def version(dep: Deployment, version_id: str):
    return next(v for k, v in dep.registry.state.versions.items() if k.version_id == version_id)


async def memory_deployment(names=("e0", "e1"), **options) -> Deployment:
    options.setdefault("reconcile_interval", 0.05)
    engines = {n: MemoryEngine(n) for n in names}
    return await Deployment(engines, epoch=1, deadlines=FAST, **options).start()


async def test_an_added_engine_is_loaded_with_every_needed_version_before_it_takes_traffic():
    dep = await memory_deployment()
    a = await dep.publish(lora_snapshot(1), "A")
    old = dep.session("old")
    await old.generate(GEN)
    b = await dep.publish(lora_snapshot(2), "B")  # A stays needed: `old` holds it
    e2 = MemoryEngine("e2")
    await dep.add_engine(e2)
    assert e2.serves(a.lora_name) and e2.serves(b.lora_name)
    fleet = await dep.fleet.refresh()
    assert "e2" in fleet.routable and not fleet.joining
    # new sessions spread over it; the old one keeps its version wherever it goes
    seen = set()
    for i in range(6):
        out = await dep.session(f"n{i}").generate(GEN)
        seen.add(out["meta_info"]["engine"])
        assert out["lorapub"]["version_id"] == "B"
    assert "e2" in seen
    assert (await old.generate(GEN))["lorapub"]["version_id"] == "A"
    await dep.close()


async def test_a_joining_engine_is_never_routed_to_until_it_holds_the_versions():
    dep = await memory_deployment(reconcile_interval=None)
    await dep.publish(lora_snapshot(1), "A")
    e2 = MemoryEngine("e2")
    e2.fail_next("begin", "error", count=1000)  # it cannot load anything yet
    with pytest.raises(Exception) as e:
        await dep.add_engine(e2, timeout=0.3)
    assert getattr(e.value, "code", None) == "ENGINE_UNAVAILABLE"
    assert "e2" in (await dep.fleet.refresh()).joining
    for i in range(6):
        out = await dep.session(f"s{i}").generate(GEN)
        assert out["meta_info"]["engine"] != "e2"
    e2.clear_faults()
    await dep.add_engine(e2)  # added again: waits for the join to finish
    assert "e2" not in (await dep.fleet.refresh()).joining
    await dep.close()


async def test_an_engine_too_small_for_the_capacity_is_refused_naming_it():
    dep = await memory_deployment()
    with pytest.raises(EngineCapacityError) as e:
        await dep.add_engine(MemoryEngine("small", max_loaded=1))
    assert "small" in e.value.message
    assert "small" not in dep.engines and "small" not in (await dep.fleet.refresh()).engines
    await dep.close()


async def test_an_engine_refused_at_join_leaks_no_connection_and_stays_usable(engines, transport):
    dep = await Deployment(engines, epoch=1, deadlines=FAST, transport=transport, reconcile_interval=None).start()
    double = await SGLangDouble("small", max_loaded_loras=2, max_loras_per_batch=2).start()
    engine = SGLangWireEngine("small", double.url)
    try:
        with pytest.raises(EngineCapacityError):
            await dep.add_engine(engine)  # 2 batch slots pin 1, capacity is 2
        assert engine.client.current_http is None or engine.client.current_http.closed
        # the adapter is still usable: the same object answers (a session is opened again)
        assert (await engine.limits()).max_loaded_loras == 2
    finally:
        await engine.close()
        await double.stop()
        await dep.close()


async def test_a_join_during_a_publication_is_in_it_or_loaded_after_it():
    dep = await memory_deployment()
    await dep.publish(lora_snapshot(1), "A")
    e2 = MemoryEngine("e2")
    publication = asyncio.create_task(dep.publish(lora_snapshot(2), "B"))
    await asyncio.sleep(0)  # the publication's reserve may or may not have happened
    await dep.add_engine(e2)
    report = await publication
    await dep.add_engine(e2)  # idempotent: it is a member already; waits until it serves
    state = await dep.state()
    assert state.default.version_id == "B"
    assert "e2" in state.versions[state.default].engines and e2.serves(report.lora_name)
    assert state.membership("e2") is Membership.SERVING
    await dep.close()


async def test_drain_moves_sessions_at_a_turn_boundary_and_returns_when_no_request_runs_there():
    dep = await memory_deployment()
    await dep.publish(lora_snapshot(1), "A")
    sessions = [dep.session(f"s{i}") for i in range(6)]
    for s in sessions:
        await s.generate(GEN)
    on_e1 = [s for s in sessions if s.engine.name == "e1"]
    assert on_e1
    running = [asyncio.create_task(s.generate(LONG)) for s in on_e1]  # mid-request when the drain begins
    await until(lambda: sum(dep.engines["e1"].refs.values()) == len(on_e1), what="every request running on e1")
    drain = asyncio.create_task(dep.drain_engine("e1"))
    await asyncio.sleep(0.05)
    assert not drain.done()  # their requests still run there: never cut mid-request
    outs = await asyncio.gather(*running)
    assert all(o["meta_info"]["engine"] == "e1" for o in outs)
    drained = await drain
    assert drained.engine == "e1" and drained.moved == 0
    for s in on_e1:  # the next turn goes to another holder of the same version
        out = await s.generate(GEN)
        assert out["meta_info"]["engine"] == "e0" and out["lorapub"]["version_id"] == "A"
    for i in range(4):
        assert (await dep.session(f"new{i}").generate(GEN))["meta_info"]["engine"] == "e0"
    # a publication now leaves the draining engine out
    b = await dep.publish(lora_snapshot(2), "B")
    assert not dep.engines["e1"].serves(b.lora_name)
    await dep.remove_engine("e1")
    assert "e1" not in dep.engines and "e1" not in (await dep.state()).engines
    await dep.close()


async def test_a_session_whose_version_only_the_draining_engine_holds_stays_and_the_drain_times_out():
    dep = await memory_deployment(reconcile_interval=None)
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("only")
    while True:  # a session on e1
        await s.generate(GEN)
        if s.engine.name == "e1":
            break
        await s.close()
        s = dep.session("only")
    dep.engines["e0"].restart()  # e0 loses A; the frozen copy is gone with the publisher's retention
    dep.publisher.frozen.retain(set())
    await dep.reconcile(wait=0.2)  # the restart is seen: only e1 holds A
    with pytest.raises(DrainTimeout) as e:
        await dep.drain_engine("e1", timeout=0.2)
    assert e.value.code == "DRAIN_TIMEOUT" and e.value.details["sessions"] == ["only"]
    out = await s.generate(GEN)  # it stays on its version where it is held
    assert out["meta_info"]["engine"] == "e1" and out["lorapub"]["version_id"] == "A"
    await s.close()
    drained = await dep.drain_engine("e1", timeout=30)  # generous: it returns once drained
    assert drained.engine == "e1"
    await dep.close()


async def test_remove_needs_a_drain_and_unknown_names_are_typed():
    dep = await memory_deployment()
    with pytest.raises(EngineNotDrained) as e:
        await dep.remove_engine("e1")
    assert e.value.code == "ENGINE_NOT_DRAINED"
    with pytest.raises(UnknownEngine) as e:
        await dep.remove_engine("nope")
    assert e.value.code == "UNKNOWN_ENGINE"
    with pytest.raises(UnknownEngine):
        await dep.drain_engine("nope")
    await dep.close()


async def test_an_unreachable_engine_is_removed_without_a_drain():
    dep = await memory_deployment()
    await dep.publish(lora_snapshot(1), "A")
    dep.engines["e1"].fail_next("incarnation", "request", count=1000)
    await dep.remove_engine("e1")
    state = await dep.state()
    assert "e1" not in state.engines and version(dep, "A").engines == ("e0",)
    await dep.publish(lora_snapshot(2), "B")  # publications go on without it
    await dep.close()


async def test_a_remove_during_a_reclaim_lets_the_reclaim_finish_without_it():
    dep = await memory_deployment(reconcile_interval=None)
    a = await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    await dep.drain_engine("e1")
    e1 = dep.engines["e1"]
    e1.fail_next("reclaim", "request", count=1000)  # e1 never confirms an unload
    await s.close()
    await dep.settle(timeout=0.5)
    assert version(dep, "A").state is VersionState.RECLAIMING
    await dep.remove_engine("e1")
    await dep.reconcile(wait=10)  # generous: each returns once the work is done
    await dep.settle(timeout=10)
    assert version(dep, "A").state is VersionState.RECLAIMED
    assert not dep.engines["e0"].serves(a.lora_name)
    assert (await dep.state()).slots_held == 1
    await dep.close()


async def test_a_remove_blocked_by_an_aborted_attempts_cleanup_retries_that_cleanup_itself():
    """With no background reconciler, nobody else retries the cleanup a failed publication left on the
    draining engine: the removal does, within its own timeout, instead of waiting it out."""
    dep = await memory_deployment(names=("e0", "e1", "e2"), reconcile_interval=None, reclaim_retries=1)
    await dep.publish(lora_snapshot(1), "A")
    e2 = dep.engines["e2"]
    e2.fail_next("receive_bucket", "error", count=1)
    e2.fail_next("cleanup", "request", count=1000)  # the failed attempt's cleanup there goes unconfirmed
    with pytest.raises(Exception):
        await dep.publish(lora_snapshot(2), "B")
    assert (await dep.state()).unresolved_attempt() is not None
    await dep.drain_engine("e2")
    e2.clear_faults()
    await asyncio.wait_for(dep.remove_engine("e2", timeout=5.0), 3.0)
    state = await dep.state()
    assert "e2" not in state.engines and state.unresolved_attempt() is None
    await dep.publish(lora_snapshot(2), "B")  # nothing left blocks the next publication
    await dep.close()


async def test_membership_survives_a_restart_of_the_registry(tmp_path):
    path = str(tmp_path / "registry.db")
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    incarnations = {n: await e.incarnation() for n, e in engines.items()}
    registry = LocalRegistry(1, incarnations, store=SQLiteStore(path))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=FAST, own_engines=False,
                           reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    e2 = MemoryEngine("e2")
    await dep.add_engine(e2)
    await dep.drain_engine("e0")
    await dep.close()
    registry.close()
    again = LocalRegistry(1, incarnations, store=SQLiteStore(path))
    state = again.state
    assert set(state.engines) == {"e0", "e1", "e2"}
    assert state.membership("e0") is Membership.DRAINING and state.membership("e2") is Membership.SERVING
    again.close()


async def test_an_engine_of_another_prefix_is_refused(tmp_path):
    dep = await memory_deployment()
    e2 = MemoryEngine("e2")

    async def inventory():
        inv = await MemoryEngine.inventory(e2)
        import attrs
        return attrs.evolve(inv, managed_prefix="other_prefix@")

    e2.inventory = inventory
    with pytest.raises(EngineError):
        await dep.add_engine(e2)
    await dep.close()


async def test_an_sglang_double_joins_over_the_wire(engines, doubles, transport, tmp_path, shared_dir):
    dep = await Deployment(engines, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10, transport=transport,
                           reconcile_interval=0.05).start()
    a = await dep.publish(lora_snapshot(1), "A")
    d2 = SGLangDouble("e2")
    d2.stash_root, d2.shm_dir = str(tmp_path / "e2-disk"), str(shared_dir)
    await d2.start()
    try:
        await dep.add_engine(SGLangWireEngine("e2", d2.url))
        assert a.lora_name in d2.registered()
        await dep.drain_engine("e2")
        await dep.remove_engine("e2")
        assert a.lora_name not in d2.registered()  # it leaves clean
    finally:
        await dep.close()
        await d2.stop()


async def test_a_removal_lets_this_process_requests_running_there_end_before_it_closes_the_connection(
        doubles, transport, tmp_path):
    """Another process of the run (the trainer) removed the member while a request of this process still runs
    there: this process's removal lets it end with its answer, never cut by the closing connection."""
    trainer = await Deployment({n: SGLangWireEngine(n, d.url) for n, d in doubles.items()}, epoch=1, deadlines=FAST,
                               bucket_cap_bytes=8 << 10, transport=transport, reconcile_interval=0.05).start()
    worker = await Deployment({n: SGLangWireEngine(n, d.url) for n, d in doubles.items()}, epoch=1, deadlines=FAST,
                              registry=trainer.registry, reconcile_interval=0.05,
                              own_engines=True).start()  # its removal closes its connections
    try:
        await trainer.publish(lora_snapshot(1), "A")
        sessions = [worker.session(f"s{i}") for i in range(6)]
        for s in sessions:
            await s.generate(GEN)
        on_e1 = next(s for s in sessions if s.engine.name == "e1")
        doubles["e1"].inject("generate", "slow", delay=0.8)
        running = asyncio.ensure_future(on_e1.generate(GEN))
        await asyncio.sleep(0.2)
        with pytest.raises(DrainTimeout):
            await trainer.drain_engine("e1", timeout=0.05)
        doubles["e1"].inject("unload", "error", count=10)  # the trainer leaves what it loaded there at once
        await trainer.remove_engine("e1", timeout=0.1)
        with pytest.raises(UnknownEngine):
            await worker.drain_engine("e1")
        assert not running.done()
        await worker.remove_engine("e1", timeout=5.0)  # not a member any more: it lets go of its adapter here
        answer = await running
        assert answer["lorapub"]["stamp"]["engine"] == "e1" and "error" not in answer
    finally:
        await worker.close()
        await trainer.close()
