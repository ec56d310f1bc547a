"""Every fault heals by itself: a cancelled call, a lost reply, a clock step, an operator's unload,
an engine pair that restarts, a slow unload. One test per defect, each failing on the code before
its fix. (A publisher killed mid-publication: tests/e2e/test_publisher_death.py, real processes.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from lorapub import (
    Deployment,
    EngineUnavailable,
    InvalidInput,
    OutcomeUnknown,
    VersionKey,
    VersionReclaiming,
    deploy,
)
from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.core.commands import CancelWait, CloseAndRelease, ExpireLeases, ReadState, RecordPrepared
from lorapub.core.session import SessionState
from lorapub.core.version import VersionState
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.runner import Deadlines
from lorapub.testing import FaultyRegistry, MemoryEngine, SGLangDouble, lora_snapshot
from tests.helpers.waiting import until as _until

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
QUICK = Deadlines(begin=1, bucket=1, end=3, cleanup=1, commit=1, reclaim=30)


def memory_engines(**kw) -> dict[str, MemoryEngine]:
    return {n: MemoryEngine(n, **kw) for n in ("e0", "e1")}


async def faulty(engines, **options) -> tuple[Deployment, FaultyRegistry]:
    incarnations = {n: await e.incarnation() for n, e in engines.items()}
    registry = FaultyRegistry(LocalRegistry(1, incarnations, lease_ttl=options.pop("lease_ttl", 120.0),
                                            max_lag=options.get("max_lag")))
    options.setdefault("reconcile_interval", None)
    options.setdefault("deadlines", QUICK)
    dep = await Deployment(engines, epoch=1, registry=registry, **options).start()
    return dep, registry


def version(dep: Deployment, version_id: str):
    return dep.registry.state.versions[VersionKey(1, version_id)]


# -- item 2: a cancelled publish, a lost RecordPrepared reply --------------------------------------
async def test_a_cancelled_publish_aborts_and_cleans_its_attempt_at_once():
    engines = memory_engines()
    # B's ends stall until their deadline (30 s); C must not wait for it (a loaded machine included)
    dep, _ = await faulty(engines, deadlines=Deadlines(begin=10, bucket=10, end=30, cleanup=10, commit=10, reclaim=30))
    await dep.publish(lora_snapshot(1), "A")
    for e in engines.values():
        e.fail_next("end", "stall")  # an engine's end that answers only at its deadline
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(dep.publish(lora_snapshot(2), "B"), 0.3)
    started = time.monotonic()
    report = await dep.publish(lora_snapshot(3), "C", wait=20)  # not PUBLICATION_BLOCKED for minutes
    assert report.state is VersionState.PUBLISHED and time.monotonic() - started < 15  # not the stall's 30 s
    assert version(dep, "B").state is VersionState.FAILED_CLEAN  # aborted and cleaned, never committed
    assert all(version(dep, "B").lora_name not in e.loaded for e in engines.values())
    await dep.close()


async def test_a_replayed_publish_takes_over_its_own_attempt_after_a_lost_reply():
    engines = memory_engines()
    dep, registry = await faulty(engines)
    registry.fail_next(RecordPrepared, "reply")  # applied, its reply lost: the call cannot go on
    with pytest.raises(OutcomeUnknown):
        await dep.publish(lora_snapshot(1), "B")
    report = await asyncio.wait_for(dep.publish(lora_snapshot(1), "B"), 5)  # the replay finishes it
    assert report.state is VersionState.PUBLISHED and dep.registry.state.default == VersionKey(1, "B")
    assert (await dep.reconcile()).healthy
    await dep.close()


# -- a publish cancelled while it waits for a slot ------------------------------------------------------
async def _full(dep: Deployment):
    """A and B published, A kept by a session: both slots held, the next publish must wait."""
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("holder")
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    return s


def _waiter(dep: Deployment) -> str | None:
    waiter = dep.registry.state.waiter
    return None if waiter is None else waiter.key.version_id


async def test_a_publish_cancelled_while_it_waits_withdraws_its_wait():
    """Before the fix the registry kept the cancelled call as its waiter for its whole wait (30 s):
    status.waiting and health's publication_waiting named a call nobody awaited."""
    engines = memory_engines(max_loaded=3)
    dep, _ = await faulty(engines)
    s = await _full(dep)
    call = asyncio.ensure_future(dep.publish(lora_snapshot(3), "C", wait=30))
    await _until(lambda: _waiter(dep) == "C")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await _until(lambda: _waiter(dep) is None)  # withdrawn at once, not 30 s later
    health = await dep.reconcile(wait=0)
    assert not [b for b in health.blockers if b.kind == "publication_waiting"], health.describe()
    assert (await dep.status(probe=False)).waiting is None
    await s.close()
    await dep.settle()
    assert (await dep.publish(lora_snapshot(3), "C", wait=5)).state is VersionState.PUBLISHED  # never superseded
    await dep.close()


async def test_a_lost_withdrawal_of_a_cancelled_wait_still_ends_when_the_wait_would_have():
    """The CancelWait of a cancelled call is lost on the way: the registry drops the waiter once the
    wait it asked for is over (Waiter.until), at the next lease pass; it never lingers longer."""
    engines = memory_engines(max_loaded=3)
    incarnations = {n: await e.incarnation() for n, e in engines.items()}
    now = [1000.0]  # the registry's clock, stepped by the test
    registry = FaultyRegistry(LocalRegistry(1, incarnations, lease_ttl=120.0, clock=lambda: now[0]))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    s = await _full(dep)
    call = asyncio.ensure_future(dep.publish(lora_snapshot(3), "C", wait=30))
    await _until(lambda: _waiter(dep) == "C")
    registry.fail_next(CancelWait, "request")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await _until(lambda: ("CancelWait", "request") in registry.injected)
    await dep.publisher.tasks.wait(2, kind="cancel-wait")
    waiter = dep.registry.state.waiter
    assert waiter is not None and waiter.key == VersionKey(1, "C") and waiter.until <= now[0] + 30
    await registry.handle(ExpireLeases())
    assert _waiter(dep) == "C"  # its wait is not over yet
    now[0] = waiter.until + 0.001
    await registry.handle(ExpireLeases())  # what the reconciler's pass runs
    assert _waiter(dep) is None
    await s.close()
    await dep.close()


# -- item 4: a close whose reply was lost ---------------------------------------------------------------
async def test_a_lost_close_is_retried_and_its_session_never_renewed():
    engines = memory_engines()
    dep, registry = await faulty(engines)
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    registry.fail_next(CloseAndRelease, "request")  # lost on the way: nothing released
    with pytest.raises(OutcomeUnknown):
        await s.close()
    assert version(dep, "A").session_refs == 1
    lease = dep.registry.state.sessions[s.key].lease_until
    await dep.sessions.renew_leases()  # the worker's next round: retries the close, renews nothing of it
    await asyncio.sleep(0.05)
    record = dep.registry.state.sessions[s.key]
    assert record.state is SessionState.CLOSED and record.lease_until == lease
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED
    await dep.close()


# -- item 5: a slow unload stalls nothing else ---------------------------------------------------------------
async def test_a_slow_unload_never_holds_a_reconcile_pass():
    engines = memory_engines(generate_seconds=8.0)  # long beside the pass's bound, for a loaded machine
    dep, _ = await faulty(engines, max_lag=0)  # A retires at B's commit, under a running request
    await dep.publish(lora_snapshot(1), "A")
    running = asyncio.ensure_future(dep.session("s").generate(GEN))  # A's native ref for 8 s
    await _until(lambda: any(sum(e.refs.values()) for e in engines.values()), what="A's request running")
    await dep.publish(lora_snapshot(2), "B")
    engines["e1"].restart()  # meanwhile an engine restarts: the pass sees it now, not in 8 s
    started = time.monotonic()
    health = await dep.reconcile(wait=0.5)
    assert time.monotonic() - started < 5.0, "the pass waited on the unload"
    kinds = {(b.kind, b.subject) for b in health.blockers}
    assert ("reclaim_pending", "1-A") in kinds, health.describe()
    assert dep.registry.state.engines["e1"] == engines["e1"].incarnation_id  # the restart was registered
    detail = next(b.detail for b in health.blockers if b.subject == "1-A")
    assert "e0 (1 running request(s))" in detail  # what holds it, by name
    assert (await running)["lorapub"]["version_id"] == "A"  # the request ran to its end
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED
    await dep.close()


# -- item 6: clocks -----------------------------------------------------------------------------------
async def test_a_step_of_the_hosts_wall_clock_expires_no_lease(monkeypatch):
    engines = memory_engines()
    dep = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None, lease_ttl=60.0).start()
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 120.0)  # an NTP step, a VM resume
    health = await dep.reconcile()
    assert dep.registry.state.sessions[s.key].state is SessionState.BOUND and health.healthy
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    assert version(dep, "A").state is VersionState.RETIRED  # kept: its session is alive
    await dep.close()


async def test_a_registry_two_hours_ahead_of_the_worker_refuses_no_new_session():
    engines = memory_engines()
    registry = LocalRegistry(1, {n: await e.incarnation() for n, e in engines.items()},
                             clock=lambda: time.time() + 7200.0)
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    out = await dep.session("s").generate(GEN)  # its nonce is born in the registry's time
    assert out["lorapub"]["version_id"] == "A"
    await dep.close()


# -- items 10 and 11: engines that lose versions ---------------------------------------------------------
async def test_both_engines_restarted_is_engine_unavailable_not_version_missing():
    engines = memory_engines()
    dep, _ = await faulty(engines)
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    for e in engines.values():
        e.restart()
    with pytest.raises(EngineUnavailable, match="re-provisioned"):
        await s.generate(GEN)
    await dep.reconcile()
    await dep.settle()
    assert (await s.generate(GEN))["lorapub"]["version_id"] == "A"  # healed: same version, same session
    await dep.close()


async def test_a_version_an_operator_unloaded_is_noticed_and_loaded_again():
    engines = memory_engines()
    dep, _ = await faulty(engines)
    a = await dep.publish(lora_snapshot(1), "A")
    await engines["e0"].reclaim(a.lora_name, "an-operator")  # no restart: the incarnation is the same
    assert a.lora_name not in engines["e0"].loaded
    health = await dep.reconcile()
    await dep.settle()
    health = await dep.reconcile()
    assert health.healthy, health.describe()
    assert a.lora_name in engines["e0"].loaded and set(version(dep, "A").engines) == {"e0", "e1"}
    for i in range(4):  # every session is served, on whichever engine
        assert (await dep.session(f"s{i}").generate(GEN))["lorapub"]["version_id"] == "A"
    await dep.close()


async def test_a_version_an_operator_unloaded_everywhere_is_found_by_the_refused_request_and_loaded_again():
    engines = memory_engines()
    dep, _ = await faulty(engines)
    a = await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    assert (await s.generate(GEN))["lorapub"]["version_id"] == "A"
    for engine in engines.values():  # no restart: the incarnations stay
        await engine.reclaim(a.lora_name, "an-operator")
    with pytest.raises(EngineUnavailable, match="restarted or lost it") as e:
        await s.generate(GEN)  # refused: the probe records it lost on both; never served by another version
    assert e.value.code == "ENGINE_UNAVAILABLE" and version(dep, "A").engines == ()
    assert s.binding is not None and s.binding.version.version_id == "A"  # the session keeps its version
    health = await dep.reconcile()  # the pass the refused request asked for: loaded again everywhere
    await dep.settle()
    assert health.healthy, health.describe()
    assert all(a.lora_name in engine.loaded for engine in engines.values())
    assert (await s.generate(GEN))["lorapub"]["version_id"] == "A"
    await dep.close()


# -- items 15-18: input and cleanup a new user meets ---------------------------------------------------------
@pytest.mark.parametrize("bad", ["", "e/../x", "e\n", "x" * 200])
async def test_engine_names_are_checked(bad):
    engine = MemoryEngine("e0")
    engine.name = bad
    with pytest.raises(InvalidInput, match="engine name"):
        Deployment({bad: engine}, epoch=1)


async def test_a_started_deployment_is_needed_and_bad_arguments_are_named():
    engines = memory_engines()
    dep = Deployment(engines, epoch=1, reconcile_interval=None)
    with pytest.raises(InvalidInput, match="start"):
        await dep.refresh_engines()
    await dep.start()
    await dep.publish(lora_snapshot(1), "A")
    with pytest.raises(InvalidInput, match="not list"):
        await dep.session("s").generate([1, 2, 3])
    assert version(dep, "A").session_refs == 0  # refused before binding: no ref taken
    await dep.publish(lora_snapshot(2), "B")
    await dep.settle()
    assert await dep.reclaim("A") is VersionState.RECLAIMED  # a version id of this epoch works
    with pytest.raises(InvalidInput, match="VersionKey"):
        await dep.reclaim(3)
    with pytest.raises(VersionReclaiming, match="new version id"):  # never answered as if published
        await dep.publish(lora_snapshot(1), "A")
    await dep.close()


async def test_deploy_refuses_switched_off_engines_when_enabled():
    double = await SGLangDouble("e0").start()
    try:
        with pytest.raises(InvalidInput, match="switched-off path"):
            await deploy({"e0": SGLangOverwriteAdmin("e0", double.url)}, epoch=1, enabled=True)
    finally:
        await double.stop()


async def test_a_session_closed_after_its_deployment_closed_starts_nothing_and_raises_nothing():
    """Its release makes the old version reclaimable; no background reclaim starts after close()
    (it would outlive the deployment): the registry keeps the version RETIRED for any later reconciler."""
    engine = MemoryEngine("e0")
    dep = await Deployment({"e0": engine}, epoch=1, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s1")
    await s.generate({"input_ids": [1, 2]})
    await dep.publish(lora_snapshot(2), "B")
    await dep.close()
    await s.close()
    assert len(dep.tasks) == 0
    state = (await dep.registry.handle(ReadState())).reply
    assert state.versions[VersionKey(1, "A")].state is VersionState.RETIRED
    assert state.versions[VersionKey(1, "A")].session_refs == 0


async def test_closing_a_deployment_closes_its_engines_http_sessions():
    doubles = [await SGLangDouble(f"e{i}").start() for i in range(2)]
    try:
        engines = {d.name: SGLangWireEngine(d.name, d.url) for d in doubles}
        dep = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None).start()
        await dep.publish(lora_snapshot(1), "A")
        sessions = [e.client.current_http for e in engines.values()]
        assert all(s is not None and not s.closed for s in sessions)
        await dep.close()
        assert all(s.closed for s in sessions)  # no "Unclosed client session" at exit
    finally:
        for d in doubles:
            await d.stop()


# -- the engine-side name prefix (a deployment's own, e.g. an integration's) -------------------------------
async def test_a_deployment_names_its_versions_with_its_prefix_and_engines_must_protect_it():
    from lorapub import EngineError

    doubles = [await SGLangDouble(f"e{i}", managed_prefix="lorapub@").start() for i in range(2)]
    try:
        engines = {d.name: SGLangWireEngine(d.name, d.url) for d in doubles}
        with pytest.raises(EngineError, match="SGLANG_LORAPUB_MANAGED_PREFIX=relax_policy_lora@"):
            await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None, own_engines=False).start()
        dep = await Deployment(engines, epoch=2, deadlines=QUICK, reconcile_interval=None, name_prefix="lorapub@",
                               own_engines=False).start()
        a = await dep.publish(lora_snapshot(1), "A")
        assert a.lora_name.startswith("lorapub@2-A-")
        out = await dep.session("s").generate(GEN)
        assert out["lorapub"]["lora_name"] == a.lora_name
        # an adapter of another prefix is not this deployment's to sweep, whatever its epoch
        await doubles[0]._load("relax_policy_lora@1-x-0", "unused", pinned=False, signature="x")
        health = await dep.reconcile()
        assert health.healthy and "relax_policy_lora@1-x-0" in doubles[0].registered(), health.describe()
        with pytest.raises(InvalidInput, match="name_prefix"):
            Deployment(engines, epoch=3, name_prefix="no-at-sign")
        await dep.close()
        for e in engines.values():
            await e.close()
    finally:
        for d in doubles:
            await d.stop()


async def test_health_before_the_first_pass_says_starting_not_failed_and_a_pass_makes_it_healthy():
    # a caller polling health right after start() must tell "not known yet" from "the registry is down"
    dep = Deployment({"e0": MemoryEngine("e0")}, epoch=1, reconcile_interval=None)
    await dep.start()
    try:
        first = dep.health
        assert not first.healthy and [b.kind for b in first.blockers] == ["starting"], first.describe()
        assert "reconcile()" in first.blockers[0].detail
        health = await dep.reconcile()
        assert health.healthy and health.passes == 1, health.describe()
    finally:
        await dep.close()


async def test_a_cleanup_not_confirmed_is_named_in_health_by_the_engine_that_owes_it():
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, reconcile_interval=None, deadlines=Deadlines(begin=1.0)).start()
    await dep.publish(lora_snapshot(1), "A")
    engines["e1"].fail_next("begin", "error")
    engines["e1"].fail_next("cleanup", "reply", count=1000)  # e1 never confirms the cleanup
    from lorapub import LorapubError

    with pytest.raises(LorapubError):  # B failed on e1, and its cleanup there is not confirmed
        await dep.publish(lora_snapshot(2), "B")
    health = await dep.reconcile(wait=0)
    pending = [b for b in health.blockers if b.kind == "cleanup_pending"]
    assert pending and pending[0].detail == "cleanup not confirmed on e1", health.describe()
    engines["e1"].clear_faults()
    await dep.close()


async def test_a_session_forgotten_after_its_expiry_is_told_expired_not_an_invalid_transition():
    from lorapub import SessionExpired

    now = [1000.0]
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    registry = LocalRegistry(1, {n: await e.incarnation() for n, e in engines.items()}, clock=lambda: now[0])
    dep = await Deployment(engines, epoch=1, registry=registry, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate({"input_ids": [1, 2]})
    now[0] += 5000  # a worker stalled past lease_ttl and the tombstone window: expired, then forgotten
    await dep.reconcile()
    await dep.reconcile()  # a tombstone is forgotten a pass after the one that made it
    assert s.key not in (await dep.state()).sessions
    await dep.publish(lora_snapshot(2), "B")  # A, kept by nothing now, is reclaimed
    await dep.settle(30)  # returns once the reclaim ends
    with pytest.raises(SessionExpired, match="start a new session"):
        await s.generate({"input_ids": [1, 2]})
    assert (await dep.session("s").generate({"input_ids": [1, 2]}))["lorapub"]["version_id"] == "B"
    await dep.close()
