"""The Ray actor registry, for real on the CPU: shared by callers, survives a caller restart."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from lorapub.adapters.ray_registry import RayRegistry  # noqa: E402
from lorapub.core.identity import SessionKey  # noqa: E402
from lorapub.core.registry import (  # noqa: E402
    BindFirst, Commit, ReadState, RecordBucketDone, RecordPrepared, RecordReady, Reserve,
)
from lorapub.core.version import VersionState  # noqa: E402
from lorapub.runtime.deployment import Deployment  # noqa: E402
from lorapub.errors import CapacityError, InvalidInput, NoPublishedVersion  # noqa: E402
from lorapub.testing.fixtures import lora_snapshot  # noqa: E402
from tests.e2e.conftest import FAST  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


async def test_ray_registry_shared_and_replayable(ray_cluster, engines, transport):
    incarnations = {n: await e.incarnation() for n, e in engines.items()}
    registry = RayRegistry.create("reg-test", epoch=1, engines=incarnations)
    try:
        with pytest.raises(NoPublishedVersion):  # typed errors cross the actor boundary
            await registry.handle(BindFirst(SessionKey(1, "s", "n")))
        dep = await Deployment(engines, epoch=1, registry=registry, deadlines=FAST, transport=transport).start()
        a = await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s1", nonce="n1")
        await s.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        # the caller "restarts": a fresh handle found by name, replaying its last calls
        again = RayRegistry.lookup("reg-test")
        bound = await again.handle(BindFirst(SessionKey(1, "s1", "n1")))
        assert bound.reply.version == a.version
        replay = await again.handle(Commit(a.version, a.receipt.token, 0))
        assert replay.reply == a.receipt
        state = (await again.handle(ReadState())).reply
        assert state.versions[a.version].session_refs == 1 and state.default_revision == 1
        await dep.publish(lora_snapshot(2), "B")
        with pytest.raises(CapacityError) as refused:
            await dep.publish(lora_snapshot(3), "C")
        # the refusal's details cross the actor as they are in one process
        assert refused.value.details["held_by_sessions"] == 1 and refused.value.details["held"]
        await s.close()
        await dep.settle()
        assert (await again.handle(ReadState())).reply.versions[a.version].state is VersionState.RECLAIMED
    finally:
        ray.kill(registry.actor)


async def test_durable_ray_registry_survives_an_actor_restart(ray_cluster, tmp_path):
    import asyncio

    from lorapub.errors import OutcomeUnknown

    registry = RayRegistry.create("reg-durable", epoch=3, engines={"e0": "e0-a", "e1": "e1-a"},
                                  store_path=str(tmp_path / "registry.pickle"))
    try:
        # one publication driven through the actor, so each transition is stored there
        from lorapub.core.attempt import ReadyLocal
        from lorapub.core.effects import SOURCE
        from lorapub.core.identity import VersionKey
        from lorapub.testing.fixtures import fake_plan

        digest, plan = fake_plan("A")
        key = VersionKey(3, "A")
        tok = (await registry.handle(Reserve(key, digest, plan))).reply.token
        for e, inc in (("e0", "e0-a"), ("e1", "e1-a")):
            await registry.handle(RecordPrepared(tok, e, inc))
        for i in range(len(plan)):
            for p, inc in ((SOURCE, None), ("e0", "e0-a"), ("e1", "e1-a")):
                await registry.handle(RecordBucketDone(tok, p, i, inc))
        for e, inc in (("e0", "e0-a"), ("e1", "e1-a")):
            await registry.handle(RecordReady(ReadyLocal(e, tok, digest, inc)))
        receipt = (await registry.handle(Commit(key, tok, 0))).reply
        bound = (await registry.handle(BindFirst(SessionKey(3, "s", "n")))).reply
        ray.kill(registry.actor, no_restart=False)  # the actor process dies; Ray restarts it

        async def replay(command):  # what a caller does with OUTCOME_UNKNOWN: replay the same command
            for _ in range(200):
                try:
                    return await registry.handle(command)
                except OutcomeUnknown:
                    await asyncio.sleep(0.05)
            raise AssertionError(f"{command} never answered")

        assert (await replay(Commit(key, tok, 0))).reply == receipt
        assert (await replay(BindFirst(SessionKey(3, "s", "n")))).reply == bound
        assert (await replay(ReadState())).reply.versions[key].session_refs == 1
    finally:
        ray.kill(registry.actor, no_restart=True)


# -- store failures reach callers typed, never as a lost reply ---------------------------------
def _engines():
    return {"e0": "e0-a", "e1": "e1-a"}


async def test_a_corrupted_store_reaches_callers_as_store_corrupted(ray_cluster, tmp_path):
    from lorapub.errors import StoreCorrupted

    path = tmp_path / "registry.db"
    path.write_bytes(b"not a registry store" * 64)
    registry = RayRegistry.create("reg-corrupt", epoch=3, engines=_engines(), store_path=str(path), call_timeout=20)
    try:
        for _ in range(2):  # every call answers the same, typed: callers stop instead of replaying forever
            with pytest.raises(StoreCorrupted) as e:
                await registry.handle(ReadState())
            assert str(path) in e.value.message and e.value.code == "STORE_CORRUPTED"
        path.unlink()  # an operator moves the broken file away: the next call opens a new store
        assert (await registry.handle(ReadState())).reply.epoch == 3
    finally:
        ray.kill(registry.actor, no_restart=True)


async def test_a_store_of_another_epoch_is_refused_through_the_actor(ray_cluster, tmp_path):
    from lorapub.errors import EpochMismatch
    from lorapub.local_registry import LocalRegistry
    from lorapub.adapters.stores import SQLiteStore

    path = str(tmp_path / "registry.db")
    LocalRegistry(3, _engines(), store=SQLiteStore(path)).close()  # written by epoch 3
    registry = RayRegistry.create("reg-epoch", epoch=4, engines=_engines(), store_path=path, call_timeout=20)
    try:
        with pytest.raises(EpochMismatch) as e:
            await registry.handle(ReadState())
        assert path in e.value.message and "epoch 3" in e.value.message and "epoch 4" in e.value.message
    finally:
        ray.kill(registry.actor, no_restart=True)


async def test_a_failed_save_in_the_actor_is_a_store_error_and_the_actor_keeps_serving(ray_cluster, tmp_path):
    from lorapub.core.registry import CloseAndRelease, OpenSession
    from lorapub.errors import SessionClosed, StoreError

    path = str(tmp_path / "registry.db")
    poison = SessionKey(3, "poison", "n")

    def store_factory():  # built inside the actor; the disk is "full" for one command only
        from lorapub.adapters.stores import SQLiteStore

        class FullForPoison(SQLiteStore):
            def save_many(self, items):  # the group commit every save goes through
                if any(getattr(command, "key", None) == poison for _, command in items):
                    raise OSError(28, "No space left on device")
                super().save_many(items)

        return FullForPoison(path)

    registry = RayRegistry.create("reg-full", epoch=3, engines=_engines(), store_factory=store_factory,
                                  call_timeout=20)
    try:
        await registry.handle(OpenSession(SessionKey(3, "ok", "n")))
        with pytest.raises(StoreError) as e:
            await registry.handle(OpenSession(poison))
        assert e.value.code == "STORE_ERROR" and path in e.value.message and "No space left" in e.value.message
        state = (await registry.handle(ReadState())).reply
        assert poison not in state.sessions and SessionKey(3, "ok", "n") in state.sessions  # not applied
        await registry.handle(CloseAndRelease(SessionKey(3, "ok", "n")))
        with pytest.raises(SessionClosed):  # every typed rejection keeps its class and code
            await registry.handle(OpenSession(SessionKey(3, "ok", "n")))
    finally:
        ray.kill(registry.actor, no_restart=True)


async def test_only_a_dead_actor_is_outcome_unknown(ray_cluster):
    from lorapub.errors import OutcomeUnknown

    registry = RayRegistry.create("reg-dead", epoch=3, engines=_engines(), call_timeout=20)
    assert (await registry.handle(ReadState())).reply.epoch == 3
    ray.kill(registry.actor, no_restart=True)  # returns before the actor is gone: a call may still land
    import asyncio

    for _ in range(50):
        try:
            await registry.handle(ReadState())
        except OutcomeUnknown:
            break  # dead: no reply, never any other error
        await asyncio.sleep(0.2)
    else:
        pytest.fail("the killed actor kept answering for 10 s")


async def test_commands_of_one_process_travel_in_one_actor_call_each_answered_on_its_own(ray_cluster):
    import asyncio

    from lorapub.core.registry import CloseAndRelease

    registry = RayRegistry.create("reg-batch", epoch=3, engines=_engines(), call_timeout=20)
    try:
        keys = [SessionKey(3, f"s{i}", "n") for i in range(100)]
        # no version yet: every bind is refused, each with its own typed error, in one call
        results = await asyncio.gather(*(registry.handle(BindFirst(k)) for k in keys), return_exceptions=True)
        assert all(isinstance(r, NoPublishedVersion) for r in results)
        assert registry.calls == 1
        # a batch mixing answers and rejections: closes succeed, binds are refused
        mixed = await asyncio.gather(
            *(registry.handle(CloseAndRelease(k) if i % 2 else BindFirst(k)) for i, k in enumerate(keys)),
            return_exceptions=True,
        )
        assert [isinstance(r, NoPublishedVersion) for r in mixed] == [i % 2 == 0 for i in range(100)]
        assert registry.calls == 2
        state = (await registry.handle(ReadState())).reply
        assert sum(1 for k in keys if k in state.sessions) == 50  # applied in order, none lost
    finally:
        ray.kill(registry.actor)


async def test_the_registry_actor_takes_its_start_up_objects_out_of_the_collector(ray_cluster):
    """The actor's process is the registry's alone: what Ray's worker and the imports made is
    frozen out of later collections (a full collection of it was the p99 of 100 callers);
    the same class built in a caller's own process freezes nothing there."""
    import gc

    registry = RayRegistry.create("reg-gc", epoch=3, engines=_engines(), call_timeout=20)
    try:
        frozen = await registry.actor.__ray_call__.remote(lambda actor: gc.get_freeze_count())
        assert frozen > 10_000, frozen
        assert (await registry.handle(ReadState())).reply.epoch == 3  # the registry still answers
    finally:
        ray.kill(registry.actor)
    from lorapub.adapters.ray_registry import _RegistryActor

    before = gc.get_freeze_count()
    _RegistryActor(3, _engines(), 2)
    assert gc.get_freeze_count() == before


async def test_a_ray_registry_is_made_with_every_setting_a_local_one_takes(ray_cluster):
    """max_lag, on_stale, name_prefix and avoid_suspect reach the actor's registry, so a Deployment
    asking for them on a shared registry finds them there (it refuses a registry that differs)."""
    with pytest.raises(InvalidInput, match="use capacity=4 or more"):  # refused before any actor is made
        RayRegistry.create("reg-refused", epoch=3, engines=_engines(), call_timeout=20, max_lag=2)
    with pytest.raises(ValueError):
        ray.get_actor("reg-refused", namespace="lorapub")
    registry = RayRegistry.create("reg-settings", epoch=3, engines=_engines(), call_timeout=20, capacity=4, max_lag=2,
                                  on_stale="rebind", name_prefix="team_a_lora@", avoid_suspect=True)
    try:
        state = (await registry.handle(ReadState())).reply
        assert (state.max_lag, state.on_stale, state.name_prefix, state.avoid_suspect) == (
            2, "rebind", "team_a_lora@", True)
    finally:
        ray.kill(registry.actor)


# -- bad commands are refused alone, typed, and never hold up the rest of their batch ----------
async def test_an_unserializable_command_is_refused_alone_and_its_batch_is_answered(ray_cluster):
    import asyncio
    import threading

    from lorapub.core.registry import OpenSession

    registry = RayRegistry.create("reg-unserializable", epoch=3, engines=_engines(), call_timeout=20)
    try:
        bad, good = SessionKey(3, "bad", "n"), SessionKey(3, "good", "n")
        results = await asyncio.wait_for(asyncio.gather(
            registry.handle(OpenSession(bad, group=threading.Lock())), registry.handle(OpenSession(good)),
            return_exceptions=True), 30)
        assert isinstance(results[0], InvalidInput), results[0]
        assert "OpenSession" in results[0].message and "group" in results[0].message and "lock" in results[0].message
        assert not isinstance(results[1], Exception), results[1]
        state = (await registry.handle(ReadState())).reply
        assert good in state.sessions and bad not in state.sessions
    finally:
        ray.kill(registry.actor)


async def test_a_malformed_command_fails_alone_and_the_rest_of_its_batch_is_applied(ray_cluster):
    import asyncio

    from lorapub.core.registry import OpenSession

    registry = RayRegistry.create("reg-malformed", epoch=3, engines=_engines(), call_timeout=20)
    try:
        k = SessionKey(3, "k", "n")
        results = await asyncio.gather(registry.handle(OpenSession(k)), registry.handle(BindFirst(key="junk")),
                                       registry.handle(ReadState()), return_exceptions=True)
        assert not isinstance(results[0], Exception), results[0]
        assert isinstance(results[1], InvalidInput) and "BindFirst" in results[1].message, results[1]
        assert k in results[2].reply.sessions  # applied in order, before the state was read
        assert registry.calls == 1  # still one actor call for the batch
        with pytest.raises(InvalidInput, match="BindFirst"):  # sent alone: the same typed refusal
            await registry.handle(BindFirst(key="junk"))
    finally:
        ray.kill(registry.actor)


async def test_without_batching_bad_commands_are_refused_typed(ray_cluster):
    import threading

    from lorapub.core.registry import OpenSession

    registry = RayRegistry.create("reg-unbatched", epoch=3, engines=_engines(), call_timeout=20, batch=False)
    try:
        with pytest.raises(InvalidInput, match="group"):
            await registry.handle(OpenSession(SessionKey(3, "bad", "n"), group=threading.Lock()))
        with pytest.raises(InvalidInput, match="BindFirst"):
            await registry.handle(BindFirst(key="junk"))
        with pytest.raises(InvalidInput, match="could not read OpenSession"):
            await registry.handle(OpenSession(SessionKey(3, "bad", "n"), group=_UnreadableInTheActor()))
        assert (await registry.handle(ReadState())).reply.epoch == 3
    finally:
        ray.kill(registry.actor)


# -- the actor's life: another epoch, a restart, a pause, a successor --------------------------
async def test_creating_an_actor_of_another_epoch_under_a_taken_name_is_refused(ray_cluster):
    from lorapub.errors import EpochMismatch

    registry = RayRegistry.create("reg-epochs", epoch=1, engines=_engines(), call_timeout=20)
    try:
        with pytest.raises(EpochMismatch) as refused:
            RayRegistry.create("reg-epochs", epoch=2, engines=_engines(), call_timeout=20)
        assert "reg-epochs" in refused.value.message and "epoch 1" in refused.value.message
        assert "another name" in refused.value.message  # what to do
        again = RayRegistry.create("reg-epochs", epoch=1, engines=_engines(), call_timeout=20)  # the same epoch: shared
        assert (await again.handle(ReadState())).reply.epoch == 1
    finally:
        ray.kill(registry.actor)


def _publish_commands(epoch: int, name: str, revision: int = 0):
    """The commands that publish ``name`` on the two engines of :func:`_engines` (no engine involved),
    committed over default ``revision``."""
    from lorapub.core.attempt import ReadyLocal
    from lorapub.core.effects import SOURCE
    from lorapub.core.identity import VersionKey
    from lorapub.testing.fixtures import fake_plan

    digest, plan = fake_plan(name)
    key = VersionKey(epoch, name)

    async def publish(registry):
        tok = (await registry.handle(Reserve(key, digest, plan))).reply.token
        for e, inc in _engines().items():
            await registry.handle(RecordPrepared(tok, e, inc))
        for i in range(len(plan)):
            for p, inc in ((SOURCE, None), *_engines().items()):
                await registry.handle(RecordBucketDone(tok, p, i, inc))
        for e, inc in _engines().items():
            await registry.handle(RecordReady(ReadyLocal(e, tok, digest, inc)))
        await registry.handle(Commit(key, tok, revision))
        return key

    return publish


async def test_a_close_in_flight_when_a_durable_actor_dies_lands_once_it_restarts(ray_cluster, tmp_path):
    """The close is not lost to the caller's next lease round: it is replayed (every command is safe
    to replay) as soon as the restarted actor answers, within call_timeout."""
    import asyncio
    import time

    from lorapub.core.registry import CloseAndRelease

    registry = RayRegistry.create("reg-inflight", epoch=3, engines=_engines(), call_timeout=30,
                                  store_path=str(tmp_path / "registry.db"))
    try:
        key = await _publish_commands(3, "A")(registry)
        s = SessionKey(3, "s", "n")
        await registry.handle(BindFirst(s))
        busy = registry.actor.__ray_call__.remote(lambda actor: time.sleep(1.0))  # the close queues behind it
        close = asyncio.ensure_future(registry.handle(CloseAndRelease(s)))
        await asyncio.sleep(0.3)
        ray.kill(registry.actor, no_restart=False)  # both die with the process; Ray restarts it
        await close  # answered by the restarted actor, not OUTCOME_UNKNOWN
        assert (await registry.handle(ReadState())).reply.versions[key].session_refs == 0
        del busy
    finally:
        ray.kill(registry.actor, no_restart=True)


async def test_a_paused_actor_does_not_expire_live_sessions_when_it_resumes(ray_cluster):
    """Lease ages count only time the actor ran: a worker could not renew while it was stopped."""
    import asyncio
    import os
    import signal

    from lorapub.core.registry import ExpireLeases, OpenSession, RenewLeases

    registry = RayRegistry.create("reg-paused", epoch=3, engines=_engines(), call_timeout=30, lease_ttl=5)
    pid = await registry.actor.__ray_call__.remote(lambda actor: os.getpid())
    try:
        live, dead = SessionKey(3, "live", "n"), SessionKey(3, "dead", "n")
        await asyncio.gather(registry.handle(OpenSession(live)), registry.handle(OpenSession(dead)))
        await registry.handle(RenewLeases((live,)))
        os.kill(pid, signal.SIGSTOP)
        try:
            expire = asyncio.ensure_future(registry.handle(ExpireLeases()))  # queued: first on resume
            await asyncio.sleep(7)  # longer than the lease
        finally:
            os.kill(pid, signal.SIGCONT)
        assert (await expire).reply == ()  # nothing expired: the live worker's renewal comes next
        await registry.handle(RenewLeases((live,)))
        # leases still run out while the actor runs: the session nobody renews expires
        for _ in range(60):
            if (await registry.handle(ExpireLeases())).reply:
                break
            await registry.handle(RenewLeases((live,)))
            await asyncio.sleep(0.5)
        state = (await registry.handle(ReadState())).reply
        assert state.sessions[dead].state.value == "EXPIRED" and state.sessions[live].state.value == "OPEN"
    finally:
        ray.kill(registry.actor)


async def test_a_handle_looked_up_before_the_actor_was_made_again_finds_the_new_one(ray_cluster):
    import asyncio

    from lorapub.errors import OutcomeUnknown

    first = RayRegistry.create("reg-again", epoch=3, engines=_engines(), call_timeout=20)
    old = RayRegistry.lookup("reg-again", call_timeout=20)
    assert (await old.handle(ReadState())).reply.epoch == 3
    ray.kill(first.actor, no_restart=True)
    for _ in range(100):  # the name is free once the old actor is gone
        try:
            ray.get_actor("reg-again", namespace="lorapub")
        except ValueError:
            break
        await asyncio.sleep(0.1)
    second = RayRegistry.create("reg-again", epoch=3, engines=_engines(), capacity=3, call_timeout=20)
    try:
        for _ in range(20):  # a lost reply at most, then the replay reaches the new actor
            try:
                state = (await old.handle(ReadState())).reply
                break
            except OutcomeUnknown:
                await asyncio.sleep(0.2)
        else:
            pytest.fail("the handle looked up earlier never found the new actor")
        assert state.capacity == 3
    finally:
        ray.kill(second.actor)


async def test_a_durable_actor_made_again_after_a_downtime_does_not_count_it_against_leases(ray_cluster, tmp_path):
    """A restarted actor's time goes on from the last lease it granted, not from the wall clock: while
    no actor ran, no worker could renew."""
    import asyncio

    from lorapub.core.registry import ExpireLeases, OpenSession

    path = str(tmp_path / "registry.db")
    first = RayRegistry.create("reg-downtime", epoch=3, engines=_engines(), call_timeout=20, lease_ttl=6,
                               store_path=path)
    s = SessionKey(3, "s", "n")
    await first.handle(OpenSession(s))
    ray.kill(first.actor, no_restart=True)
    await asyncio.sleep(8)  # longer than the lease, with no actor running
    second = RayRegistry.create("reg-downtime", epoch=3, engines=_engines(), call_timeout=20, lease_ttl=6,
                                store_path=path)
    try:
        assert (await second.handle(ExpireLeases())).reply == ()
        for _ in range(40):  # the lease still runs out once the actor runs again
            if (await second.handle(ExpireLeases())).reply:
                break
            await asyncio.sleep(0.5)
        assert (await second.handle(ReadState())).reply.sessions[s].state.value == "EXPIRED"
    finally:
        ray.kill(second.actor, no_restart=True)


class _UnreadableInTheActor:
    """Serializes, but cannot be read back (as a class the actor's process cannot import)."""

    def __reduce__(self):
        import operator

        return operator.truediv, (1, 0)


async def test_a_command_the_actor_cannot_read_is_refused_alone(ray_cluster):
    import asyncio

    from lorapub.core.registry import OpenSession

    registry = RayRegistry.create("reg-unreadable", epoch=3, engines=_engines(), call_timeout=20)
    try:
        good = SessionKey(3, "good", "n")
        results = await asyncio.wait_for(asyncio.gather(
            registry.handle(OpenSession(SessionKey(3, "bad", "n"), group=_UnreadableInTheActor())),
            registry.handle(OpenSession(good)), return_exceptions=True), 30)
        assert isinstance(results[0], InvalidInput) and "OpenSession" in results[0].message, results[0]
        assert not isinstance(results[1], Exception), results[1]
        assert good in (await registry.handle(ReadState())).reply.sessions
    finally:
        ray.kill(registry.actor)


def test_the_actor_clock_leaves_out_a_stop_and_the_time_between_two_lives():
    from lorapub.adapters.ray_registry import _RunningClock

    mono = [100.0]
    clock = _RunningClock(tick=0.25, slack=2.0, monotonic=lambda: mono[0], wall=lambda: 5000.0, beat=False)
    assert clock() == 5000.0
    mono[0] += 1.0  # running: time passes as it does
    assert clock() == 5001.0
    mono[0] += 60.0  # nothing noted for a minute: the process was stopped
    assert clock() == 5001.25 and clock.stopped == 59.75
    mono[0] += 1.0
    assert clock() == 5002.25  # and runs on from there

    resumed = _RunningClock(monotonic=lambda: mono[0], wall=lambda: 5000.0, beat=False)
    resumed.go_on_from(4000.0)  # the last lease an earlier life granted
    assert resumed() == 4000.0
    ahead = _RunningClock(monotonic=lambda: mono[0], wall=lambda: 5000.0, beat=False)
    ahead.go_on_from(9000.0)  # never ahead of wall time
    assert ahead() == 5000.0


async def test_a_session_closed_while_the_durable_actor_restarts_frees_its_slot_at_once(ray_cluster, engines, tmp_path):
    """The close in flight when the actor dies lands on the restarted actor: its version's slot is
    free for the next publication, not held until the worker's next lease round."""
    import asyncio
    import time

    from lorapub.adapters.sglang_wire import HTTPBytes

    incarnations = {n: await e.incarnation() for n, e in engines.items()}
    registry = RayRegistry.create("reg-close-restart", epoch=1, engines=incarnations, call_timeout=30,
                                  store_path=str(tmp_path / "registry.db"))
    dep = None
    try:
        dep = await Deployment(engines, epoch=1, registry=registry, deadlines=FAST, transport=HTTPBytes()).start()
        await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s1", nonce="n1")
        await s.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        await dep.publish(lora_snapshot(2), "B")  # both slots held: A by the session, B the default
        busy = registry.actor.__ray_call__.remote(lambda actor: time.sleep(1.0))  # the close queues behind it
        closing = asyncio.ensure_future(s.close())
        await asyncio.sleep(0.3)
        ray.kill(registry.actor, no_restart=False)
        await closing  # answered by the restarted actor
        await dep.publish(lora_snapshot(3), "C", wait=20)  # A's slot is freed by the close, not a lease round
        del busy
    finally:
        if dep is not None:
            await dep.close()
        ray.kill(registry.actor, no_restart=True)
