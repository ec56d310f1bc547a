"""Freshness at training cadence: capacity N, waiting and superseded publications, bounded
staleness (max_lag), group binding, activity leases, the lag every result carries.

In-process engines (:class:`~lorapub.testing.MemoryEngine`) keep these fast; the capacity check
against SGLang's own limits runs on the HTTP contract double.
"""

from __future__ import annotations

import asyncio

import pytest

from lorapub import (
    BindingStale,
    CapacityError,
    Deployment,
    DeploymentClosed,
    EngineCapacityError,
    GroupClosed,
    PublicationSuperseded,
    SessionClosed,
    SessionExpired,
)
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.core.session import SessionState
from lorapub.core.version import VersionState
from lorapub.testing import MemoryEngine, SGLangDouble, lora_snapshot
from tests.e2e.conftest import FAST
from tests.helpers.waiting import until as _until

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def deployment(capacity: int = 2, slots: int | None = None, **options) -> Deployment:
    slots = slots or capacity + 1  # SGLang pins at most max_loras_per_batch - 1 adapters
    engines = {n: MemoryEngine(n, max_loaded=slots, max_per_batch=slots, **options.pop("engine", {}))
               for n in ("e0", "e1")}
    options.setdefault("reconcile_interval", None)
    return await Deployment(engines, epoch=1, capacity=capacity, deadlines=FAST, **options).start()


def version(dep: Deployment, version_id: str):
    return next((v for k, v in dep.registry.state.versions.items() if k.version_id == version_id), None)


async def bound_session(dep: Deployment, name: str, **kw):
    s = dep.session(name, **kw)
    await s.generate(GEN)
    return s


# -- capacity N ----------------------------------------------------------------------------------
async def test_capacity_n_holds_n_versions_and_names_what_holds_each_slot():
    dep = await deployment(capacity=4)
    sessions = []
    for i in range(4):  # each version kept by a session bound to it
        await dep.publish(lora_snapshot(i), f"v{i}")
        sessions.append(await bound_session(dep, f"s{i}"))
    assert dep.registry.state.slots_held == 4
    for e in dep.engines.values():
        assert len(e.loaded) == 4
    with pytest.raises(CapacityError) as err:
        await dep.publish(lora_snapshot(9), "v9")
    assert "4 managed version slots are held" in err.value.message
    assert "1-v0 RETIRED (lag 3): kept by 1 session ref(s)" in err.value.message
    assert "wait=" in err.value.message  # says what to do
    assert version(dep, "v9") is None  # nothing was reserved, nothing sent
    await sessions[0].close()
    await dep.settle()
    assert (await dep.publish(lora_snapshot(9), "v9")).state is VersionState.PUBLISHED
    await dep.close()


async def test_start_refuses_a_capacity_an_engine_cannot_hold():
    with pytest.raises(EngineCapacityError) as err:
        await deployment(capacity=3, slots=3)  # 3 per batch: SGLang pins at most 2
    assert "engine e0 holds at most 2 pinned managed versions" in err.value.message
    assert "--max-loras-per-batch 4" in err.value.message
    assert err.value.details["engine"] == "e0"


async def test_the_capacity_check_reads_sglangs_own_limits_over_http():
    doubles = [await SGLangDouble(f"e{i}", max_loaded_loras=5, max_loras_per_batch=4).start() for i in range(2)]
    engines = {d.name: SGLangWireEngine(d.name, d.url) for d in doubles}
    try:
        limits = await engines["e0"].limits()
        assert (limits.max_loaded_loras, limits.max_loras_per_batch, limits.managed_capacity()) == (5, 4, 3)
        dep = await Deployment(engines, epoch=1, capacity=3, deadlines=FAST, reconcile_interval=None,
                               own_engines=False).start()
        await dep.close()  # the engines stay open for the next deployment
        with pytest.raises(EngineCapacityError, match="max_loaded_loras=5, max_loras_per_batch=4"):
            await Deployment(engines, epoch=2, capacity=4, deadlines=FAST, reconcile_interval=None).start()
    finally:
        for e in engines.values():
            await e.close()
        for d in doubles:
            await d.stop()


async def test_the_double_refuses_to_pin_every_batch_slot_as_sglang_does():
    double = await SGLangDouble("e0", max_loaded_loras=3).start()
    engines = {"e0": SGLangWireEngine("e0", double.url)}
    try:  # capacity 2 is the most 3 batch slots allow; a third pinned load is SGLang's own refusal
        dep = await Deployment(engines, epoch=1, deadlines=FAST, reconcile_interval=None).start()
        for i in range(2):
            await dep.publish(lora_snapshot(i), f"v{i}")
            await bound_session(dep, f"s{i}")
        with pytest.raises(ValueError, match="not allowed to pin all slots"):
            await double._load("third", "unused", pinned=True, signature="x")
        await dep.close()
    finally:
        await engines["e0"].close()
        await double.stop()


# -- waiting and superseded publications -------------------------------------------------------------
async def test_a_waiting_publication_lands_once_a_slot_frees_and_says_what_it_waited_for():
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")  # A RETIRED, kept by s: both slots held
    call = asyncio.ensure_future(dep.publish(lora_snapshot(3), "C", wait=10))
    await asyncio.sleep(0.3)
    assert not call.done()
    health = await dep.reconcile()
    waiting = [b for b in health.blockers if b.kind == "publication_waiting"]
    assert waiting and waiting[0].subject == "1-C" and "1-A kept by session s (bound)" in waiting[0].detail, \
        health.describe()
    # health and status name what holds a version in one form
    held = next(v for v in (await dep.status()).versions if v.version == "1-A")
    assert held.blocked_by and held.blocked_by[0].startswith("session s (bound"), held
    await s.close()
    report = await asyncio.wait_for(call, 5)
    assert report.state is VersionState.PUBLISHED and report.waited >= 0.3
    assert "1-A RETIRED" in report.waited_for.describe() and "1 session ref" in report.waited_for.describe()
    assert [h.version.version_id for h in report.waited_for.holders] == ["A", "B"]
    await dep.close()


async def test_a_newer_publication_supersedes_a_waiting_one_which_never_commits():
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    older = asyncio.ensure_future(dep.publish(lora_snapshot(3), "C", wait=10))
    await asyncio.sleep(0.1)
    newer = asyncio.ensure_future(dep.publish(lora_snapshot(4), "D", wait=10))
    with pytest.raises(PublicationSuperseded) as err:
        await asyncio.wait_for(older, 5)
    assert err.value.code == "SUPERSEDED" and err.value.details["by"].version_id == "D"
    assert "superseded by 1-D" in err.value.message and "it waited" in err.value.message
    await s.close()
    assert (await asyncio.wait_for(newer, 5)).state is VersionState.PUBLISHED
    assert version(dep, "C") is None  # never reserved, never sent, never committed
    with pytest.raises(PublicationSuperseded) as again:  # and it stays superseded, refused at once
        await dep.publish(lora_snapshot(3), "C", wait=1)
    assert "(it waited" not in again.value.message and "new version id" in again.value.message
    await dep.close()


def _waiter(dep: Deployment) -> str | None:
    waiter = dep.registry.state.waiter
    return None if waiter is None else waiter.key.version_id


async def test_a_superseding_call_that_is_cancelled_leaves_no_waiter_and_revives_nothing():
    """C waits, D supersedes it, then D's caller cancels: D's wait is withdrawn (no ghost for D's
    whole wait), and C stays superseded (docs/freshness.md says so): nothing publishes either."""
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    older = asyncio.ensure_future(dep.publish(lora_snapshot(3), "C", wait=30))
    await _until(lambda: _waiter(dep) == "C")
    newer = asyncio.ensure_future(dep.publish(lora_snapshot(4), "D", wait=30))
    with pytest.raises(PublicationSuperseded) as err:
        await asyncio.wait_for(older, 5)
    assert err.value.details["by"].version_id == "D"
    await _until(lambda: _waiter(dep) == "D")
    newer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await newer
    await _until(lambda: _waiter(dep) is None)  # before the fix: D stayed the waiter for 30 s
    health = await dep.reconcile(wait=0)
    assert not [b for b in health.blockers if b.kind == "publication_waiting"], health.describe()
    await s.close()
    await dep.settle()
    with pytest.raises(PublicationSuperseded):  # D never committed, and C is not revived
        await dep.publish(lora_snapshot(3), "C")
    assert version(dep, "C") is None and version(dep, "D") is None
    assert (await dep.publish(lora_snapshot(5), "E")).state is VersionState.PUBLISHED
    await dep.close()


async def test_close_while_a_publish_waits_tells_its_caller_the_deployment_closed():
    """Before the fix the caller got PUBLICATION_BLOCKED 'the publication … this call joined was
    cancelled by its caller … publish again': wrong on all three counts."""
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    call = asyncio.ensure_future(dep.publish(lora_snapshot(3), "C", wait=30))
    await _until(lambda: _waiter(dep) == "C")
    await dep.close()
    with pytest.raises(DeploymentClosed) as err:
        await call
    assert err.value.code == "DEPLOYMENT_CLOSED" and err.value.details["waiting"] is True
    assert "closed while publish of 1-C waited for a slot" in err.value.message
    assert "new Deployment" in err.value.message  # what to do
    assert "joined" not in err.value.message and "publish again" not in err.value.message
    assert _waiter(dep) is None and version(dep, "C") is None  # no waiter left, nothing reserved


async def test_close_while_a_publish_runs_tells_its_caller_the_deployment_closed():
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    for e in dep.engines.values():
        e.fail_next("end", "stall")  # B's end answers only at its deadline: B is running at close
    call = asyncio.ensure_future(dep.publish(lora_snapshot(2), "B"))
    await _until(lambda: version(dep, "B") is not None)
    await dep.close()
    with pytest.raises(DeploymentClosed) as err:
        await call
    assert err.value.details["waiting"] is False and "aborted and cleaned" in err.value.message
    assert version(dep, "B").state is not VersionState.PUBLISHED


async def test_a_wait_that_runs_out_is_refused_with_what_held_the_slots():
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    with pytest.raises(CapacityError) as err:
        await dep.publish(lora_snapshot(3), "C", wait=0.3)
    assert err.value.details["waited"] >= 0.3 and "waited" in err.value.message
    assert dep.registry.state.waiter is None  # it stopped waiting: no waiter left behind
    with pytest.raises(CapacityError):  # wait=0 keeps the old behaviour: at once
        await dep.publish(lora_snapshot(3), "C")
    await dep.close()


async def test_a_publication_waits_for_a_running_attempt_instead_of_being_blocked():
    dep = await deployment(capacity=3, engine={"generate_seconds": 0})
    await dep.publish(lora_snapshot(1), "A")
    for e in dep.engines.values():
        e.fail_next("end", "stall")  # B's end answers only at its deadline (2 s): B runs meanwhile
    first = asyncio.ensure_future(dep.publish(lora_snapshot(2), "B"))
    await asyncio.sleep(0.1)
    second = await asyncio.wait_for(dep.publish(lora_snapshot(3), "C", wait=10), 10)
    assert second.state is VersionState.PUBLISHED and second.waited > 0.5
    assert "attempt 1-B#" in second.waited_for.describe()
    await asyncio.gather(first, return_exceptions=True)
    await dep.close()


async def test_two_concurrent_publishes_of_one_version_share_one_attempt():
    dep = await deployment(capacity=2)
    snapshot = lora_snapshot(1)
    a, b = await asyncio.gather(dep.publish(snapshot, "A"), dep.publish(snapshot, "A"))
    assert a.receipt == b.receipt and sorted([a.reused, b.reused]) == [False, True]
    assert len([t for t in dep.registry.state.attempts if t.version.version_id == "A"]) == 1
    await dep.close()


# -- bounded staleness ----------------------------------------------------------------------------
async def test_a_session_beyond_max_lag_is_told_binding_stale_and_its_version_is_reclaimed():
    dep = await deployment(capacity=3, max_lag=1, on_stale="error")
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    out = await s.generate(GEN)  # lag 1: still allowed
    assert out["lorapub"]["version_id"] == "A" and out["lorapub"]["lag"] == 1
    await dep.publish(lora_snapshot(3), "C")  # A is now 2 behind: retiring
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED  # s never closed, yet A is gone
    with pytest.raises(BindingStale) as err:
        await s.generate(GEN)
    assert err.value.code == "BINDING_STALE" and "max_lag" in err.value.message
    assert err.value.details["lag"] == 2 and err.value.details["max_lag"] == 1  # how far behind, against what
    assert str(err.value.details["default"]) == "1-C"
    with pytest.raises(BindingStale):  # a stale session never generates again
        await s.generate(GEN)
    await s.close()
    assert dep.registry.state.versions[version(dep, "A").key].session_refs == 0
    fresh = await dep.session("t").generate(GEN)
    assert fresh["lorapub"]["version_id"] == "C" and fresh["lorapub"]["lag"] == 0
    await dep.close()


async def test_a_request_running_when_its_version_retires_completes_and_holds_the_unload():
    dep = await deployment(capacity=3, max_lag=0, on_stale="error", engine={"generate_seconds": 1.5})
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    running = asyncio.ensure_future(s.generate(GEN))
    await _until(lambda: any(sum(e.refs.values()) for e in dep.engines.values()), what="the request running")
    await dep.publish(lora_snapshot(2), "B")  # A retiring at once (max_lag 0), its request still runs
    await asyncio.sleep(0.05)
    assert not running.done()
    assert version(dep, "A").state in (VersionState.RETIRED, VersionState.RECLAIMING)  # not unloaded under it
    out = await running  # never cut in the middle of a request
    assert out["lorapub"]["version_id"] == "A"
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED
    with pytest.raises(BindingStale):
        await s.generate(GEN)
    await dep.close()


async def test_on_stale_rebind_moves_the_session_to_the_default_at_a_turn_boundary():
    dep = await deployment(capacity=3, max_lag=0, on_stale="rebind")
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    out = await s.generate(GEN)
    assert out["lorapub"]["version_id"] == "B" and out["lorapub"]["rebinds"] == 1
    assert [(v.version_id, first) for v, first in s.provenance] == [("A", 0), ("B", 1)]
    record = dep.registry.state.sessions[s.key]
    assert record.version.version_id == "B" and record.rebinds == 1 and record.holds_ref
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED and version(dep, "B").session_refs == 1
    await s.close()
    await dep.close()


async def test_with_max_lag_set_a_stale_session_rebinds_by_default_and_every_result_names_each_turns_version():
    dep = await deployment(capacity=3, max_lag=0)  # on_stale left out
    assert dep.on_stale == "rebind" and dep.registry.state.on_stale == "rebind"
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.publish(lora_snapshot(2), "B")
    out = await s.generate(GEN)  # not BINDING_STALE: no rollout is thrown away by default
    assert out["lorapub"]["version_id"] == "B" and out["lorapub"]["rebinds"] == 1
    assert out["lorapub"]["turn_versions"] == ["1-A", "1-B"]
    await s.close()
    await dep.close()
    strict = await deployment(capacity=3, max_lag=0, on_stale="error")  # still there for trainers that need it
    await strict.publish(lora_snapshot(1), "A")
    s = await bound_session(strict, "s")
    await strict.publish(lora_snapshot(2), "B")
    with pytest.raises(BindingStale):
        await s.generate(GEN)
    await strict.close()
    unbounded = await deployment(capacity=2)  # no max_lag: nothing goes stale, the setting stays "error"
    assert unbounded.on_stale == "error"
    await unbounded.close()


def test_one_rule_sets_the_on_stale_default_wherever_a_registry_is_made():
    from lorapub.core.registry import check_max_lag, new_registry
    from lorapub.local_registry import LocalRegistry

    assert check_max_lag(2) == "rebind" and check_max_lag(None) == "error" and check_max_lag(2, "error") == "error"
    assert new_registry(1, {"e0": "i"}, capacity=4, max_lag=2).on_stale == "rebind"
    assert LocalRegistry(1, {"e0": "i"}, 4, max_lag=2).state.on_stale == "rebind"
    assert LocalRegistry(1, {"e0": "i"}, 4).state.on_stale == "error"


# -- groups ------------------------------------------------------------------------------------
async def test_a_group_binds_one_version_and_keeps_it_while_any_member_is_open():
    dep = await deployment(capacity=3)
    await dep.publish(lora_snapshot(1), "A")
    members = [dep.session(f"g{i}", group="G") for i in range(3)]
    for m in members:
        await m.open()  # members count from here
    first = await members[0].generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    later = [await m.generate(GEN) for m in members[1:]]  # bound after B became the default: still A
    assert {r["lorapub"]["version_id"] for r in [first, *later]} == {"A"}
    assert version(dep, "A").session_refs == 1  # the group's one ref
    loner = await dep.session("loner").generate(GEN)
    assert loner["lorapub"]["version_id"] == "B"
    await members[0].close()
    await members[1].close()
    await dep.settle()
    assert version(dep, "A").state is VersionState.RETIRED  # the last member keeps it
    await members[2].close()
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED
    with pytest.raises(GroupClosed):  # a closed group never binds again (it would span two versions)
        await dep.session("g9", group="G").generate(GEN)
    await dep.close()


async def test_a_stale_group_retires_together():
    dep = await deployment(capacity=3, max_lag=0, on_stale="error")
    await dep.publish(lora_snapshot(1), "A")
    a, b = dep.session("a", group="G"), dep.session("b", group="G")
    await a.generate(GEN)
    await b.open()
    await dep.publish(lora_snapshot(2), "B")
    for member in (a, b):  # b never generated: it would have bound A, now retiring
        with pytest.raises(BindingStale):
            await member.generate(GEN)
    with pytest.raises(BindingStale, match="stale group retires together") as err:
        await dep.session("c", group="G").generate(GEN)
    assert (err.value.details["lag"], err.value.details["max_lag"], str(err.value.details["default"])) == (1, 0, "1-B")
    await dep.settle()
    assert version(dep, "A").state is VersionState.RECLAIMED
    await dep.close()


# -- activity leases, async with, one Session per id ---------------------------------------------------
async def test_a_session_idle_past_idle_ttl_expires_in_a_live_worker():
    dep = await deployment(capacity=2, idle_ttl=0.3, lease_ttl=30)
    await dep.publish(lora_snapshot(1), "A")
    forgotten = await bound_session(dep, "forgotten")  # the rollout code raised before close()
    busy = dep.session("busy")
    dep.engines["e0"].generate_seconds = dep.engines["e1"].generate_seconds = 2.0
    running = asyncio.ensure_future(busy.generate(GEN))  # running: never idle
    await _until(lambda: dep.registry.state.sessions[forgotten.key].state is SessionState.EXPIRED,
                 what="the forgotten session expired")
    assert not running.done()  # the busy one ran all along, past its idle_ttl many times over
    assert dep.registry.state.sessions[busy.key].state is SessionState.BOUND
    await running
    await dep.publish(lora_snapshot(2), "B")
    with pytest.raises(SessionExpired):
        await forgotten.generate(GEN)
    await dep.close()


async def test_an_idle_sessions_version_is_reclaimed_at_its_expiry_without_a_reconcile_pass():
    dep = await deployment(capacity=2, idle_ttl=0.3, lease_ttl=30)  # reconcile_interval=None: no pass runs
    await dep.publish(lora_snapshot(1), "A")
    await bound_session(dep, "forgotten")  # keeps A once B is the default, until it idles out
    await dep.publish(lora_snapshot(2), "B")
    await _until(lambda: version(dep, "A").state is VersionState.RECLAIMED, seconds=10.0)
    assert (await dep.publish(lora_snapshot(3), "C")).state is VersionState.PUBLISHED  # A's slot is free
    await dep.close()


async def test_async_with_closes_the_session_even_when_the_rollout_raises():
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    with pytest.raises(RuntimeError):
        async with dep.session("s") as s:
            await s.generate(GEN)
            raise RuntimeError("the tool call failed")
    assert dep.registry.state.sessions[s.key].state is SessionState.CLOSED
    with pytest.raises(SessionClosed):
        await s.generate(GEN)
    await dep.close()


async def test_the_same_live_session_id_gives_the_same_session():
    dep = await deployment(capacity=2)
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    assert dep.session("s") is s
    await s.generate(GEN)
    assert dep.session("s") is s
    await s.close()
    again = dep.session("s")
    assert again is not s and again.key.nonce != s.key.nonce  # a new lifecycle after close
    await dep.close()


async def test_health_follows_a_publication_at_once_not_at_the_next_interval():
    dep = await deployment(reconcile_interval=30.0)  # the interval's own pass would come after the test
    await asyncio.sleep(0.2)  # the first pass, at start
    before = dep.health.passes
    await dep.publish(lora_snapshot(1), "A")
    for _ in range(50):
        if dep.health.passes > before:
            break
        await asyncio.sleep(0.02)
    status = await dep.status(probe=False)
    assert dep.health.passes > before and status.healthy, status.blockers  # no 'attempt_running' left over
    await dep.close()


async def test_a_session_of_a_closed_deployment_refuses_new_turns():
    dep = await deployment()
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await dep.close()
    with pytest.raises(DeploymentClosed, match="deployment was closed") as e:
        await s.generate(GEN)  # its lease is no longer renewed: never served on a version nobody protects
    assert e.value.code == "DEPLOYMENT_CLOSED"
    with pytest.raises(DeploymentClosed, match="Deployment is closed"):  # one code for a closed deployment
        dep.session("s2")
    with pytest.raises(DeploymentClosed, match="Deployment is closed"):
        await dep.publish(lora_snapshot(2), "B")


async def test_a_refused_start_leaves_no_connection_open_and_can_be_retried_with_the_same_adapters():
    double = await SGLangDouble("e0", max_loaded_loras=3, max_loras_per_batch=3).start()
    engine = SGLangWireEngine("e0", double.url)
    try:
        dep = Deployment({"e0": engine}, epoch=1, capacity=3, deadlines=FAST, reconcile_interval=None)
        with pytest.raises(EngineCapacityError) as err:  # 3 batch slots pin at most 2
            await dep.start()
        http = engine.client.current_http
        assert http is None or http.closed  # nothing the caller could never close is left open
        # the adapter is still usable: a deployment that fits starts with it and closes it
        ok = await Deployment({"e0": engine}, epoch=1, capacity=2, deadlines=FAST, reconcile_interval=None).start()
        await ok.publish(lora_snapshot(1), "A")
        await ok.close()
        assert engine.client.current_http is not None and engine.client.current_http.closed
    finally:
        await engine.close()
        await double.stop()


@pytest.mark.parametrize("capacity, slots, max_lag, told", [
    (2, 2, None, " (capacity 2 is the least lorapub runs with)"),  # 2 batch slots pin 1: no lower capacity
    (4, 4, None, ", or lower capacity to 3"),
    (4, 4, 1, ", or lower capacity to 3"),  # 3 still serves max_lag 1
    (4, 4, 2, ", or lower capacity and max_lag together (capacity 3 serves max_lag=1 at most)"),
])
async def test_engine_capacity_suggests_only_a_capacity_lorapub_would_accept(capacity, slots, max_lag, told):
    with pytest.raises(EngineCapacityError) as err:
        await deployment(capacity=capacity, slots=slots, max_lag=max_lag)
    assert err.value.message.endswith(told), err.value.message


async def test_a_member_that_joins_a_rebound_group_is_told_its_group_spans_versions():
    dep = await deployment(capacity=2, max_lag=0, on_stale="rebind")
    a, b = dep.session("a", group="g"), dep.session("b", group="g")
    await dep.publish(lora_snapshot(1), "v1")
    first_b = (await b.generate(GEN))["lorapub"]
    await dep.publish(lora_snapshot(2), "v2")  # the group is stale: it moves at its next turn
    first_a = (await a.generate(GEN))["lorapub"]  # a never moved, but its group did
    assert (first_b["version_id"], first_b["group_rebinds"]) == ("v1", 0)
    assert (first_a["version_id"], first_a["rebinds"], first_a["group_rebinds"]) == ("v2", 0, 1)
    next_b = (await b.generate(GEN))["lorapub"]
    assert (next_b["version_id"], next_b["rebinds"], next_b["group_rebinds"]) == ("v2", 1, 1)
    solo = (await dep.session("solo").generate(GEN))["lorapub"]
    assert solo["group_rebinds"] == 0
    await dep.close()


async def test_a_manual_clock_drives_idle_ttl_and_reconcile_expires_what_it_made_idle():
    from lorapub.testing import ManualClock

    clock = ManualClock()
    dep = await deployment(capacity=2, idle_ttl=600, clock=clock)  # the renewal loop's own period is long
    await dep.publish(lora_snapshot(1), "A")
    forgotten = await bound_session(dep, "forgotten")
    await dep.publish(lora_snapshot(2), "B")  # A kept by the forgotten session
    clock.advance(599)
    await dep.reconcile()
    assert version(dep, "A").state is VersionState.RETIRED  # not idle yet
    clock.advance(2)
    await dep.reconcile()  # no sleep: the pass expires it, and A's reclaim starts
    await dep.settle(30)  # returns once the reclaim ends
    assert version(dep, "A").state is VersionState.RECLAIMED
    with pytest.raises(SessionExpired):
        await forgotten.generate(GEN)
    await dep.close()


# -- a stale session never closed, a second refusal, a closed session's bind, a closed group (issue 45) -----
async def test_a_session_cut_as_stale_and_never_closed_is_expired_by_idle_ttl():
    from lorapub.core.session import SessionState
    from lorapub.testing import ManualClock

    clock = ManualClock()
    dep = await deployment(capacity=3, max_lag=1, on_stale="error", idle_ttl=600, clock=clock)
    await dep.publish(lora_snapshot(1), "A")
    member = await bound_session(dep, "m", group="G")
    await dep.publish(lora_snapshot(2), "B")
    await dep.publish(lora_snapshot(3), "C")  # A is 2 behind: retiring
    with pytest.raises(BindingStale):
        await member.generate(GEN)  # cut, and its rollout never closes it
    clock.advance(601)
    await dep.reconcile()
    assert member.key not in dep.sessions.sessions  # the local record is dropped
    assert dep.registry.state.sessions[member.key].state is SessionState.EXPIRED  # and the registry's expired
    await dep.close()


async def test_a_group_member_refused_twice_is_told_its_lag_and_version_both_times():
    dep = await deployment(capacity=3, max_lag=0, on_stale="error")
    await dep.publish(lora_snapshot(1), "A")
    await bound_session(dep, "a", group="G")
    await dep.publish(lora_snapshot(2), "B")
    late = dep.session("late", group="G")
    refusals = []
    for _ in range(2):
        with pytest.raises(BindingStale) as err:
            await late.generate(GEN)
        refusals.append((err.value.details.get("lag"), str(err.value.details.get("version"))))
    assert refusals[0] == refusals[1] == (1, "1-A"), refusals
    await dep.close()


async def test_bind_on_a_closed_session_is_a_typed_refusal_not_its_old_binding():
    dep = await deployment()
    await dep.publish(lora_snapshot(1), "A")
    s = await bound_session(dep, "s")
    await s.close()
    with pytest.raises(SessionClosed):
        await s.bind()
    await dep.close()


async def test_a_member_refused_by_a_closed_group_is_not_left_open():
    dep = await deployment()
    await dep.publish(lora_snapshot(1), "A")
    first = await bound_session(dep, "a", group="G")
    await first.close()  # the group closes with its last open member
    late = dep.session("late", group="G")
    with pytest.raises(GroupClosed):
        await late.generate(GEN)
    from lorapub.runtime.sessions import LocalState

    assert late.state is LocalState.CLOSED and late.key not in dep.sessions.sessions
    record = dep.registry.state.sessions.get(late.key)
    assert record is None or record.state is not SessionState.OPEN
    await dep.close()


async def test_a_manual_clock_drives_reclaim_retries_without_sleeping():
    """Deployment(clock=) reaches the reclaimer: a reclaim whose unload fails is retried after its
    backoff on that clock (30 s of it, once the test advances it), so a test waits for none of it."""
    import time

    from lorapub.testing import ManualClock

    clock = ManualClock()
    dep = await deployment(capacity=2, clock=clock, reclaim_backoff=30.0, reclaim_retries=5)
    a = await dep.publish(lora_snapshot(1), "A")
    for engine in dep.engines.values():
        engine.fail_next("reclaim", "request", count=1)  # each engine's first unload gets no answer
    started, asleep = time.monotonic(), clock.sleeping  # the lease renewals' loop sleeps on it too
    await dep.publish(lora_snapshot(2), "B")  # A retires unused: its reclaim starts
    await _until(lambda: clock.sleeping > asleep, what="the reclaim's retry asleep on the manual clock")
    assert version(dep, "A").state is VersionState.RECLAIMING  # it waits for the clock, not for real time
    clock.advance(30.0)  # the backoff runs on the manual clock
    await dep.settle(10)
    assert version(dep, "A").state is VersionState.RECLAIMED
    assert time.monotonic() - started < 5.0  # and took no real time
    assert not any(e.serves(a.lora_name) for e in dep.engines.values())
    await dep.close()
