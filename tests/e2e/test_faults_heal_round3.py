"""Every fault heals, round 3: a registry whose replies take a round trip, lost membership replies,
cancelled and retried waiting publications, sessions cut and never closed, a restarted trainer.
One test per defect, each failing on the code before its fix."""

from __future__ import annotations

import asyncio
import time

import pytest

from lorapub import Deployment, VersionKey
from lorapub.core.commands import Reserve
from lorapub.core.version import VersionState
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.runner import Deadlines
from lorapub.testing import MemoryEngine, lora_snapshot

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
QUICK = Deadlines(begin=1, bucket=1, end=3, cleanup=1, commit=1, reclaim=30)


class RoundTripRegistry:
    """A registry whose replies come back ``delay`` seconds after the command was applied, as a
    Ray actor's do: a caller cancelled meanwhile never sees what the registry did."""

    def __init__(self, inner, delay: float = 0.5, slow: tuple[type, ...] = (Reserve,)) -> None:
        self.inner, self.delay, self.slow = inner, delay, slow
        self.applied: list[object] = []

    async def handle(self, command):
        result = await self.inner.handle(command)
        self.applied.append(command)
        if isinstance(command, self.slow):
            await asyncio.sleep(self.delay)
        return result

    @property
    def state(self):
        return self.inner.state


def memory_engines(**kw) -> dict[str, MemoryEngine]:
    return {n: MemoryEngine(n, **kw) for n in ("e0", "e1")}


async def registry_for(engines, **kw) -> LocalRegistry:
    return LocalRegistry(1, {n: await e.incarnation() for n, e in engines.items()}, **kw)


def version(dep: Deployment, version_id: str):
    return dep.registry.state.versions.get(VersionKey(1, version_id))


# -- item 1: a publish cancelled while its Reserve reply is in flight ---------------------------
async def test_a_publish_cancelled_while_its_reserve_reply_travels_aborts_its_attempt():
    engines = memory_engines()
    registry = RoundTripRegistry(await registry_for(engines))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    task = asyncio.create_task(dep.publish(lora_snapshot(2), "B"))
    while not any(isinstance(c, Reserve) and c.key.version_id == "B" for c in registry.applied):
        await asyncio.sleep(0.01)
    task.cancel()  # the registry applied B's Reserve; its reply is still on the way
    with pytest.raises(asyncio.CancelledError):
        await task
    started = time.monotonic()
    report = await dep.publish(lora_snapshot(3), "C", wait=5)  # not PUBLICATION_BLOCKED until stale_attempt_after
    assert report.state is VersionState.PUBLISHED and time.monotonic() - started < 4
    assert version(dep, "B").state is VersionState.FAILED_CLEAN
    assert (await dep.reconcile()).healthy
    await dep.close()


# -- item 7: publish() without wait is refused at once, never held by a reclaim -----------------
async def test_publish_without_wait_does_not_wait_for_a_reclaim_held_by_a_running_request():
    engines = {n: MemoryEngine(n, max_loaded=5, max_per_batch=5, generate_seconds=3.0) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, capacity=4, max_lag=0, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "v1")
    running = asyncio.ensure_future(dep.session("s").generate(GEN))  # 3 s on v1
    await asyncio.sleep(0.1)
    await dep.publish(lora_snapshot(2), "v2")  # v1 retires (max_lag 0); its reclaim waits on the request
    await asyncio.sleep(0.1)
    started = time.monotonic()
    await dep.publish(lora_snapshot(3), "v3")  # a slot is free: no reason to wait for v1's unload
    assert time.monotonic() - started < 1.0
    assert (await running)["lorapub"]["version_id"] == "v1"  # the running request was never cut
    await dep.close()


# -- item 8: a cancelled waiting publish retried at once under the same id ------------------------
async def test_a_cancelled_waiting_publish_retried_at_once_under_the_same_id_waits_afresh():
    engines = memory_engines()
    dep = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")  # A kept by s, B the default: both slots held
    first = asyncio.create_task(dep.publish(lora_snapshot(3), "C", wait=30))
    await asyncio.sleep(0.2)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    retry = asyncio.create_task(dep.publish(lora_snapshot(3), "C", wait=10))  # at once: the same id, a new wait
    await asyncio.sleep(0.2)
    assert not retry.done()
    await s.close()  # A's slot frees: the retried call lands
    report = await asyncio.wait_for(retry, 5)
    assert report.state is VersionState.PUBLISHED and not report.reused
    await dep.close()


# -- item 14: a restarted trainer's reused publish keeps the frozen copy --------------------------
async def test_a_reused_publish_after_a_trainer_restart_keeps_the_snapshot_for_reprovisioning():
    engines = memory_engines()
    registry = await registry_for(engines)
    first = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None,
                             own_engines=False).start()
    await first.publish(lora_snapshot(1), "p1")
    # trainer A dies (its deployment is never closed); trainer B publishes the same snapshot again
    second = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None,
                              own_engines=False).start()
    report = await second.publish(lora_snapshot(1), "p1")
    assert report.reused
    engines["e1"].restart()
    await second.reconcile()
    await second.settle(3)
    health = await second.reconcile()
    assert health.healthy, health.describe()
    assert version(second, "p1").lora_name in engines["e1"].loaded
    await second.close()
    await first.close()


# -- item 2: a lost AddEngine reply ---------------------------------------------------------------
async def test_a_lost_add_engine_reply_strands_nothing_and_a_retried_add_is_idempotent():
    from lorapub import OutcomeUnknown
    from lorapub.core.commands import AddEngine
    from lorapub.testing import FaultyRegistry

    engines = memory_engines()
    registry = FaultyRegistry(await registry_for(engines))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    a = await dep.publish(lora_snapshot(1), "A")
    e2 = MemoryEngine("e2")
    registry.fail_next(AddEngine, "reply", count=5)  # applied: e2 is a joining member; every reply is lost
    with pytest.raises(OutcomeUnknown, match="add_engine with the same engine again"):
        await dep.add_engine(e2, timeout=0.5)
    health = await dep.reconcile()  # the pass that follows loads A there, with the adapter kept
    await dep.settle(2)
    b = await dep.publish(lora_snapshot(2), "B")  # never UNKNOWN_ENGINE, never a KeyError
    assert b.state is VersionState.PUBLISHED
    await dep.add_engine(e2, timeout=5)  # the retry: the same member, now serving
    assert e2.serves(b.lora_name) and "e2" not in (await dep.fleet.refresh()).joining
    assert (await dep.reconcile()).healthy, health.describe()
    await dep.close()


async def test_a_lost_add_engine_reply_then_a_publish_without_the_retry_is_typed():
    from lorapub import OutcomeUnknown
    from lorapub.core.commands import AddEngine
    from lorapub.testing import FaultyRegistry

    engines = memory_engines()
    registry = FaultyRegistry(await registry_for(engines))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    registry.fail_next(AddEngine, "reply", count=5)
    with pytest.raises(OutcomeUnknown):
        await dep.add_engine(MemoryEngine("e2"), timeout=0.5)
    report = await dep.publish(lora_snapshot(2), "B")  # no bare KeyError from the fleet view
    assert report.state is VersionState.PUBLISHED
    await dep.close()


async def test_one_lost_add_engine_reply_is_replayed():
    from lorapub.core.commands import AddEngine
    from lorapub.testing import FaultyRegistry

    engines = memory_engines()
    registry = FaultyRegistry(await registry_for(engines))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    a = await dep.publish(lora_snapshot(1), "A")
    registry.fail_next(AddEngine, "reply")
    e2 = MemoryEngine("e2")
    await dep.add_engine(e2, timeout=5)
    assert e2.serves(a.lora_name)
    await dep.close()


# -- item 5: a forced removal of a silent engine ------------------------------------------------------
async def test_removing_a_silent_engine_honours_its_timeout_and_ends_the_publish_it_aborted():
    from lorapub import LorapubError

    engines = {n: MemoryEngine(n) for n in ("e0", "e1", "e2")}
    dep = await Deployment(engines, epoch=1, deadlines=Deadlines(begin=20, end=60), reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    engines["e2"].fail_next("begin", "stall")  # e2 goes silent in the middle of B's begin
    publishing = asyncio.create_task(dep.publish(lora_snapshot(2), "B"))
    while ("begin", "stall") not in engines["e2"].injected:
        await asyncio.sleep(0.01)
    engines["e2"].fail_next("incarnation", "stall", count=1000)  # and answers nothing more
    started = time.monotonic()
    await asyncio.wait_for(dep.remove_engine("e2", timeout=5), 8)
    assert time.monotonic() - started < 6
    started = time.monotonic()
    with pytest.raises(LorapubError):  # the publication needed e2: it aborted, and its caller hears now
        await asyncio.wait_for(publishing, 5)
    assert time.monotonic() - started < 3
    c = await dep.publish(lora_snapshot(3), "C", wait=5)
    assert c.state is VersionState.PUBLISHED and "e2" not in (await dep.fleet.refresh()).engines
    await dep.close()


async def test_lost_drain_and_remove_replies_are_replayed_and_the_removal_completes():
    from lorapub.core.commands import DrainEngine, RemoveEngine
    from lorapub.testing import FaultyRegistry

    engines = {n: MemoryEngine(n) for n in ("e0", "e1", "e2")}
    registry = FaultyRegistry(await registry_for(engines))
    dep = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    registry.fail_next(DrainEngine, "reply")
    await dep.drain_engine("e2", timeout=2)  # the replay finds it draining: the same answer
    registry.fail_next(RemoveEngine, "reply")  # applied, its reply lost: the replay finds no such member
    await dep.remove_engine("e2", timeout=2)  # done, not UNKNOWN_ENGINE
    assert "e2" not in dep.engines and "e2" not in registry.state.engines
    assert (await dep.publish(lora_snapshot(2), "B")).state is VersionState.PUBLISHED
    await dep.close()


async def test_a_member_this_process_has_no_adapter_for_fails_a_publish_typed_and_leaves_no_attempt_running():
    from lorapub import LorapubError
    from lorapub.core.attempt import Phase

    engines = memory_engines()
    registry = await registry_for(engines)
    other = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None,
                             own_engines=False).start()
    here = await Deployment(engines, epoch=1, registry=registry, deadlines=QUICK, reconcile_interval=None,
                            own_engines=False).start()
    await other.publish(lora_snapshot(1), "A")
    await other.add_engine(MemoryEngine("e2"), timeout=5)  # another process's member: no adapter here
    with pytest.raises(LorapubError) as err:
        await here.publish(lora_snapshot(2), "B")
    assert "e2" in err.value.message
    attempt = registry.state.attempts[version(here, "B").attempt]
    assert attempt.phase not in (Phase.BEGINNING, Phase.TRANSFERRING, Phase.ENDING), attempt.phase
    await here.close()
    await other.close()


async def test_an_orphan_on_an_engine_that_left_the_fleet_no_longer_blocks_health():
    engines = {n: MemoryEngine(n) for n in ("e0", "e1", "e2")}
    old = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None, own_engines=False).start()
    await old.publish(lora_snapshot(1), "A")  # the trainer dies with its registry: A is an orphan for epoch 2
    engines["e2"].fail_next("reclaim", "stall", count=1000)  # e2 never lets it go
    short = Deadlines(begin=1, bucket=1, end=3, cleanup=1, commit=1, reclaim=2)  # the stalled unload ends soon
    dep = await Deployment(engines, epoch=2, deadlines=short, reconcile_interval=None, own_engines=False).start()
    await dep.publish(lora_snapshot(2), "B")
    assert any(b.kind == "orphan_pending" for b in (await dep.reconcile(wait=0)).blockers)
    await dep.drain_engine("e2", timeout=2)
    await dep.remove_engine("e2", timeout=2)
    health = await dep.reconcile(wait=0)
    assert not any(b.subject.startswith("e2:") for b in health.blockers), health.describe()
    await dep.close()
