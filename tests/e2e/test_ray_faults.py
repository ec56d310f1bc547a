"""Faults around the Ray registry, on a local cluster: a rollout worker's process is SIGKILLed, the
registry actor is killed and restarted from its durable store, and a batch carries bad commands.
Nothing acknowledged is lost, the live worker keeps its session, the dead one's ref is released by its
lease, and each bad command is refused alone.

Every wait polls with a generous bound (a loaded 2-core machine), none is a tight deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

ray = pytest.importorskip("ray")

from lorapub.adapters.ray_registry import RayRegistry  # noqa: E402
from lorapub.core.identity import SessionKey  # noqa: E402
from lorapub.core.registry import (  # noqa: E402
    BindFirst, CloseAndRelease, ExpireLeases, OpenSession, ReadState, RenewLeases,
)
from lorapub.errors import InvalidInput  # noqa: E402
from tests.e2e.test_ray_registry import _engines, _publish_commands  # noqa: E402

pytestmark = pytest.mark.ray

EPOCH = 5
LEASE_TTL = 6.0  # renewed every 0.5 s here: a stall of several seconds on a loaded machine is still fine


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0, max_restarts=0)
class RolloutWorker:
    """A rollout worker in its own process: binds one session through its own handle and renews its
    lease until the process dies."""

    async def start(self, name: str, session: SessionKey) -> int:
        self.registry = RayRegistry.lookup(name, call_timeout=20)
        await self.registry.handle(BindFirst(session))
        self.renewing = asyncio.ensure_future(_renew_forever(self.registry, session))
        return os.getpid()


async def _renew_forever(registry: RayRegistry, *sessions: SessionKey) -> None:
    while True:
        try:
            await registry.handle(RenewLeases(sessions))
        except Exception:  # noqa: BLE001 - the registry away for a moment: the next round tries again
            pass
        await asyncio.sleep(0.5)


async def _until(check, what: str, bound: float = 60.0, every: float = 0.5):
    loop = asyncio.get_running_loop()
    end = loop.time() + bound
    while True:
        found = await check()
        if found:
            return found
        if loop.time() > end:
            pytest.fail(f"{what}: not within {bound:.0f}s")
        await asyncio.sleep(every)


async def test_a_killed_worker_a_restarted_actor_and_a_bad_command(ray_cluster, tmp_path):
    name = "reg-faults"
    registry = RayRegistry.create(name, epoch=EPOCH, engines=_engines(), call_timeout=30, lease_ttl=LEASE_TTL,
                                  store_path=str(tmp_path / "registry.db"))
    renewing = None
    worker = None
    try:
        a = await _publish_commands(EPOCH, "A")(registry)
        mine, theirs = SessionKey(EPOCH, "live", "n"), SessionKey(EPOCH, "killed", "n")
        assert (await registry.handle(BindFirst(mine))).reply.version == a
        renewing = asyncio.ensure_future(_renew_forever(registry, mine))
        worker = RolloutWorker.remote()
        pid = await asyncio.wait_for(worker.start.remote(name, theirs), 120)  # a process to start: generous
        b = await _publish_commands(EPOCH, "B", revision=1)(registry)  # the default moves on; both sessions keep A
        before = (await registry.handle(ReadState())).reply
        assert before.default == b and before.versions[a].session_refs == 2

        # 1. the worker's process is SIGKILLed: nobody closes its session
        os.kill(pid, signal.SIGKILL)
        # 2. the registry actor dies; Ray restarts it from its durable store (calls made meanwhile are
        #    asked again by the handle once it is back)
        ray.kill(registry.actor, no_restart=False)
        after = (await registry.handle(ReadState())).reply
        assert after.default == b and after.versions[a].session_refs == 2  # nothing acknowledged was lost
        assert after.sessions[mine].version == a and after.sessions[theirs].version == a

        # 3. one batch: two bad commands among good ones, each answered on its own
        fresh = SessionKey(EPOCH, "fresh", "n")
        answers = await asyncio.wait_for(asyncio.gather(  # bounded: a batch must never hang its callers
            registry.handle(OpenSession(fresh)), registry.handle(BindFirst(key="junk")),
            registry.handle(OpenSession(SessionKey(EPOCH, "locked", "n"), group=threading.Lock())),
            registry.handle(ReadState()), return_exceptions=True), 60)
        assert isinstance(answers[1], InvalidInput) and isinstance(answers[2], InvalidInput), answers
        assert "BindFirst" in answers[1].message and "OpenSession.group" in answers[2].message
        assert fresh in answers[3].reply.sessions and SessionKey(EPOCH, "locked", "n") not in answers[3].reply.sessions

        # 4. the killed worker's lease runs out and releases its ref; the live worker keeps its own
        async def expired():
            await registry.handle(ExpireLeases())
            state = (await registry.handle(ReadState())).reply
            return state if state.sessions[theirs].state.value == "EXPIRED" else None

        state = await _until(expired, "the killed worker's session expired")
        assert state.sessions[mine].state.value == "BOUND" and state.versions[a].session_refs == 1
        renewing.cancel()
        await registry.handle(CloseAndRelease(mine))
        assert (await registry.handle(ReadState())).reply.versions[a].session_refs == 0  # A may be reclaimed
    finally:
        if renewing is not None:
            renewing.cancel()
        if worker is not None:
            ray.kill(worker)
        ray.kill(registry.actor, no_restart=True)
