"""Every single fault heals by itself: one example per fault, on the SGLang contract double.

Each test ends in a healthy state — the reconciler's typed health report is clean,
capacity is free for the next publication — without a human calling recover().
"""

from __future__ import annotations

import asyncio

import pytest

from lorapub.core.commands import ClaimReclaim, CloseAndRelease, Reserve
from lorapub.core.version import VersionState
from lorapub.errors import (
    AlreadyStarted,
    InvalidInput,
    OutcomeUnknown,
    PublicationBlocked,
    SessionExpired,
)
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.publisher import PublicationFailed
from lorapub.local_registry import LocalRegistry
from lorapub.testing import FaultyRegistry, lora_snapshot
from tests.e2e.conftest import FAST
from tests.helpers.waiting import until

GEN = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


async def faulty_deployment(engines, transport, **options) -> tuple[Deployment, FaultyRegistry]:
    incarnations = {name: await e.incarnation() for name, e in engines.items()}
    registry = FaultyRegistry(LocalRegistry(1, incarnations, lease_ttl=options.pop("lease_ttl", 120.0)))
    options.setdefault("reconcile_interval", None)  # passes run when the test says (or on kicks)
    dep = await Deployment(
        engines, epoch=1, registry=registry, deadlines=FAST, bucket_cap_bytes=8 << 10, transport=transport,
        **options,
    ).start()
    return dep, registry


def version(dep: Deployment, version_id: str):
    return next(v for k, v in dep.registry.state.versions.items() if k.version_id == version_id)


async def test_lost_reply_to_the_last_close_does_not_strand_the_reclaim(engines, doubles, transport):
    dep, registry = await faulty_deployment(engines, transport)
    a = await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")  # A is RETIRED, held by s
    registry.fail_next(CloseAndRelease, "reply")  # the close is applied; its reply is lost
    with pytest.raises(OutcomeUnknown):
        await s.close()
    await s.close()  # the retried close finds the tombstone: no effect, nothing to reclaim on this path
    assert version(dep, "A").state is VersionState.RETIRED and version(dep, "A").session_refs == 0
    await dep.settle()
    health = await dep.reconcile()  # what the periodic pass does
    assert health.healthy, health.describe()
    assert version(dep, "A").state is VersionState.RECLAIMED
    assert all(a.lora_name not in d.registered() for d in doubles.values())
    await dep.publish(lora_snapshot(3), "C")  # capacity is free again (was CAPACITY_ERROR forever)
    await dep.close()


async def test_registry_failure_inside_the_automatic_reclaim_is_retried(engines, doubles, transport):
    dep, registry = await faulty_deployment(engines, transport, reconcile_interval=0.05)
    await dep.publish(lora_snapshot(1), "A")
    registry.fail_next(ClaimReclaim, "request")  # the background reclaim's first call is lost
    await dep.publish(lora_snapshot(2), "B")  # A retires unbound: reclaim is due
    await dep.settle()
    for _ in range(100):  # the reconciler, kicked by the failed reclaim, finishes it
        if version(dep, "A").state is VersionState.RECLAIMED:
            break
        await asyncio.sleep(0.02)
    assert version(dep, "A").state is VersionState.RECLAIMED
    assert ("ClaimReclaim", "request") in registry.injected
    await dep.publish(lora_snapshot(3), "C")
    await dep.close()


async def test_restart_between_ready_and_commit_aborts_and_keeps_the_default(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport)
    await dep.publish(lora_snapshot(1), "A")
    e1 = engines["e1"]
    real_end = e1.end

    async def end_then_crash(token):
        ready = await real_end(token)
        doubles["e1"].restart()  # READY was true when sent; the engine dies before commit
        return ready

    e1.end = end_then_crash
    with pytest.raises(PublicationFailed, match="restarted"):
        await dep.publish(lora_snapshot(2), "B")
    e1.end = real_end
    state = await dep.state()
    assert state.default.version_id == "A"  # the default never moved to a version e1 lacks
    assert version(dep, "B").state is VersionState.FAILED_CLEAN
    assert not [n for d in doubles.values() for n in d.registered() if "-B-" in n]
    # the same id and snapshot start a fresh attempt (it is not burned for the epoch)
    health = await dep.reconcile()  # e1 lost A in the restart: it is loaded again first
    assert health.healthy, health.describe()
    report = await dep.publish(lora_snapshot(2), "B")
    assert report.receipt is not None and not report.reused
    await dep.close()


async def test_restarted_engine_is_reprovisioned_and_sessions_never_see_missing(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport, reconcile_interval=0.05)
    a = await dep.publish(lora_snapshot(1), "A")
    sessions = [dep.session(f"s{i}") for i in range(4)]
    for s in sessions:
        await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")  # A is RETIRED and still needed by the sessions
    new = dep.session("new")
    await new.generate(GEN)
    doubles["e0"].restart()
    # every bound session keeps working on its exact version, on e1 meanwhile, then on either
    for _ in range(3):
        for s in [*sessions, new]:
            await s.generate(GEN)
    for _ in range(200):
        if all(a.lora_name in d.registered() for d in doubles.values()) and dep.health.healthy:
            break
        await asyncio.sleep(0.02)
    assert a.lora_name in doubles["e0"].registered()  # re-provisioned from the frozen copy
    assert version(dep, "A").engines == ("e0", "e1") and version(dep, "B").engines == ("e0", "e1")
    for s in sessions:
        await s.close()
    await new.close()
    await dep.settle()
    await dep.reconcile()
    assert version(dep, "A").state is VersionState.RECLAIMED
    assert dep.publisher.frozen.get(version(dep, "A").key) is None  # the frozen copy is freed too
    await dep.close()


async def test_crashed_worker_sessions_expire_and_late_requests_are_refused(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport, lease_ttl=0.3)
    await dep.publish(lora_snapshot(1), "A")
    alive, crashed = dep.session("alive"), dep.session("crashed")
    await alive.generate(GEN)
    await crashed.generate(GEN)
    # the crashed worker's sessions are no longer renewed; the live one is, in batches
    dep.sessions.sessions.pop(crashed.key)
    await asyncio.sleep(0.45)
    await dep.reconcile()
    state = await dep.state()
    assert state.sessions[crashed.key].state.value == "EXPIRED" and state.expired_sessions == 1
    assert state.sessions[alive.key].state.value == "BOUND"  # renewed by its worker
    assert version(dep, "A").session_refs == 1
    with pytest.raises(SessionExpired):
        await crashed.generate(GEN)
    await alive.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    await alive.close()
    await dep.settle()
    await dep.reconcile()
    assert version(dep, "A").state is VersionState.RECLAIMED  # the expired ref does not pin it
    await dep.close()


async def test_lost_reserve_reply_is_resumed_by_the_replay(engines, doubles, transport):
    dep, registry = await faulty_deployment(engines, transport)
    registry.fail_next(Reserve, "reply")  # the reserve happened; the publisher never heard
    report = await dep.publish(lora_snapshot(1), "A")
    assert report.receipt is not None and not report.reused
    assert ("Reserve", "reply") in registry.injected
    await dep.close()


async def test_failed_publication_can_be_replayed_with_the_same_id(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport)
    doubles["e1"].inject("load", "error")
    with pytest.raises(PublicationFailed):
        await dep.publish(lora_snapshot(1), "A")
    report = await dep.publish(lora_snapshot(1), "A")  # same id, same digest: a fresh attempt
    assert report.state is VersionState.PUBLISHED and report.receipt.token.seq == 2
    await dep.close()


async def test_concurrent_duplicate_publish_joins_instead_of_aborting(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport)
    other = dep.publisher.__class__(
        dep.registry, engines, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10,
    )  # a second publisher process on the same registry
    doubles["e0"].inject("load", "slow", delay=0.3)
    first, second = await asyncio.gather(
        dep.publisher.publish(lora_snapshot(1), "A"), other.publish(lora_snapshot(1), "A"),
    )
    assert first.receipt == second.receipt and {first.reused, second.reused} == {False, True}
    assert version(dep, "A").state is VersionState.PUBLISHED
    await dep.close()


async def test_unconfirmed_cleanup_advice_works(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport)
    doubles["e1"].inject("load", "error")
    doubles["e0"].inject("unload", "error")  # e0 loaded A; its cleanup is refused once
    with pytest.raises(PublicationBlocked, match="reconcile") as err:
        await dep.publish(lora_snapshot(1), "A")
    with pytest.raises(PublicationBlocked, match="reconcile"):
        await dep.publish(lora_snapshot(2), "B")
    assert "recover()" not in str(err.value)
    health = await dep.reconcile()  # the advice: retries the cleanup
    assert health.healthy, health.describe()
    await dep.publish(lora_snapshot(2), "B")
    await dep.close()


async def test_dead_publisher_attempt_is_aborted_when_stale(engines, doubles, transport):
    dep, _ = await faulty_deployment(engines, transport, stale_attempt_after=0.2)
    doubles["e0"].inject("load", "hang")
    task = asyncio.create_task(dep.publish(lora_snapshot(1), "A"))
    await until(lambda: doubles["e0"].faults["load"].count == 0, what="e0's load hanging")
    task.cancel()  # the publishing process dies mid-attempt
    await asyncio.gather(task, return_exceptions=True)
    await dep.reconcile()  # first sighting
    await asyncio.sleep(0.25)
    await dep.reconcile()  # no progress since: aborted and cleaned
    health = await dep.reconcile()
    assert health.healthy, health.describe()
    assert version(dep, "A").state is VersionState.FAILED_CLEAN
    await dep.publish(lora_snapshot(1), "A")  # and the id is usable again
    await dep.close()


async def test_deployment_misuse_is_typed(engines, tmp_path):
    with pytest.raises(InvalidInput, match="differs"):
        Deployment({"e9": engines["e0"]}, epoch=1)
    with pytest.raises(InvalidInput):
        Deployment({}, epoch=1)
    with pytest.raises(InvalidInput):
        Deployment(engines, epoch=-1)
    dep = await Deployment(engines, epoch=1, deadlines=FAST, reconcile_interval=None).start()
    s = dep.session("s")
    with pytest.raises(AlreadyStarted):
        await dep.start()
    assert dep.sessions.sessions[s.key] is s  # the live session survived the refused start
    with pytest.raises(InvalidInput):
        await dep.publish({"not": "a snapshot"}, "A")
    await dep.close()
