"""One clock drives every timer of a deployment: with ``Deployment(clock=ManualClock())`` lease
renewals and expiry, the reconcile interval and reclaim retries move when the test advances the
clock, and never with real time (issue #48)."""

from __future__ import annotations

import asyncio
import time

from lorapub import Deployment
from lorapub.core.session import SessionState
from lorapub.events import ReconcilePassed
from lorapub.testing import ManualClock, MemoryEngine, lora_snapshot
from tests.e2e.conftest import FAST
from tests.helpers.waiting import until

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def deployment(clock: ManualClock, **options) -> Deployment:
    engines = {n: MemoryEngine(n, max_loaded=3, max_per_batch=3) for n in ("e0", "e1")}
    return await Deployment(engines, epoch=1, capacity=2, deadlines=FAST, clock=clock, **options).start()


async def test_lease_renewals_and_expiry_move_with_the_manual_clock():
    clock = ManualClock()
    dep = await deployment(clock, lease_ttl=30.0, idle_ttl=None, reconcile_interval=None)  # renewals every 10 s
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    record = lambda: dep.registry.state.sessions[s.key]  # noqa: E731
    renewals = dep.sessions.renewals
    await asyncio.sleep(0.3)  # real time renews nothing: the renewal period is the clock's
    assert dep.sessions.renewals == renewals
    for step in range(1, 7):  # 60 s of the clock, twice the TTL: each period renews the lease
        clock.advance(10.0)
        await until(lambda: dep.sessions.renewals >= renewals + step, what=f"renewal {step}")
        await dep.reconcile(wait=0)  # an expiry pass finds the lease renewed
        assert record().state is SessionState.BOUND, record()
    await dep.sessions.tasks.cancel("leases")  # its worker stops renewing (a crashed rollout process)
    clock.advance(29.0)
    await dep.reconcile(wait=0)
    assert record().state is SessionState.BOUND  # within its TTL on the clock
    clock.advance(2.0)
    await dep.reconcile(wait=0)
    assert record().state is SessionState.EXPIRED  # past it: expired, with no real time spent
    await dep.close()


async def test_the_reconcile_loop_sleeps_its_interval_on_the_manual_clock():
    clock = ManualClock()
    passes: list[ReconcilePassed] = []
    dep = await deployment(clock, reconcile_interval=0.01, lease_ttl=None, idle_ttl=None,
                           observers=[lambda e: passes.append(e) if isinstance(e, ReconcilePassed) else None])
    await until(lambda: passes and clock.sleeping == 1, what="the first pass, then the loop asleep on the clock")
    seen = len(passes)
    await asyncio.sleep(0.3)  # thirty intervals of real time: no pass
    assert len(passes) == seen
    for step in range(1, 4):
        clock.advance(0.01)  # one interval of the clock: one pass
        await until(lambda: len(passes) == seen + step and clock.sleeping == 1, what=f"pass {step}")
    clock.advance(60.0)  # many intervals in one step: the loop runs once, then sleeps again
    await until(lambda: len(passes) == seen + 4 and clock.sleeping == 1, what="the pass after a long step")
    await asyncio.sleep(0.1)
    assert len(passes) == seen + 4
    await dep.close()


async def test_a_kick_still_runs_a_pass_before_the_interval_on_the_clock():
    clock = ManualClock()
    passes: list[ReconcilePassed] = []
    dep = await deployment(clock, reconcile_interval=600.0, lease_ttl=None, idle_ttl=None,
                           observers=[lambda e: passes.append(e) if isinstance(e, ReconcilePassed) else None])
    await until(lambda: passes and clock.sleeping == 1, what="the first pass")
    seen = len(passes)
    dep.reconciler.kick()
    await until(lambda: len(passes) > seen, what="the kicked pass")
    await until(lambda: clock.sleeping == 1, what="the loop asleep again, its clock sleep not left behind")
    await dep.close()
    assert clock.sleeping == 0  # close() leaves no sleep on the clock


async def test_reclaim_retries_wait_for_the_manual_clock():
    clock = ManualClock()
    dep = await deployment(clock, reclaim_backoff=30.0, reclaim_retries=5, reconcile_interval=None,
                           lease_ttl=None, idle_ttl=None)
    a = await dep.publish(lora_snapshot(1), "A")
    for engine in dep.engines.values():
        engine.fail_next("reclaim", "request", count=1)  # each engine's first unload gets no answer
    started = time.monotonic()
    await dep.publish(lora_snapshot(2), "B")  # A retires unused: its reclaim starts, fails, waits 30 s of the clock
    await until(lambda: clock.sleeping == 1, what="the reclaim's retry asleep on the clock")
    assert dep.reclaimer.tasks.of_kind("reclaim")
    clock.advance(29.0)
    await asyncio.sleep(0.2)
    assert clock.sleeping == 1 and any(e.serves(a.lora_name) for e in dep.engines.values())
    clock.advance(1.0)
    await dep.settle(30)
    assert not any(e.serves(a.lora_name) for e in dep.engines.values())
    assert time.monotonic() - started < 15.0  # 30 s of backoff took none of the real time
    await dep.close()
