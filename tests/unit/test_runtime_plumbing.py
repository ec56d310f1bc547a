"""The runtime's plumbing: the one retry policy and the one owner of background tasks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lorapub.errors import InvalidInput
from lorapub.runtime.retry import RetryPolicy
from lorapub.runtime.tasks import TaskOwner


class RecordingClock:
    def __init__(self) -> None:
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return sum(self.slept)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


# -- RetryPolicy ---------------------------------------------------------------------------------
async def test_attempts_sleep_between_tries_on_the_clock_never_before_the_first():
    clock = RecordingClock()
    seen = [n async for n in RetryPolicy(tries=5, first=0.05, factor=2.0, cap=0.15).attempts(clock)]
    assert seen == [0, 1, 2, 3, 4]
    assert clock.slept == [0.05, 0.1, 0.15, 0.15]  # doubled, then held at the cap


async def test_a_success_stops_the_waits():
    clock = RecordingClock()
    async for n in RetryPolicy(tries=10).attempts(clock):
        if n == 2:
            break
    assert len(clock.slept) == 2


@pytest.mark.parametrize("field, bad", [("tries", 0), ("tries", True), ("tries", 1.5), ("first", -1),
                                        ("cap", float("inf")), ("factor", 0.5), ("first", "1")])
def test_a_policy_that_makes_no_sense_is_refused(field, bad):
    with pytest.raises(InvalidInput, match=f"RetryPolicy.{field}"):
        RetryPolicy(**{field: bad})


# -- TaskOwner -----------------------------------------------------------------------------------
async def test_one_task_per_key_and_the_key_frees_when_it_ends():
    owner = TaskOwner("t")
    gate = asyncio.Event()
    runs = []

    async def job(n):
        runs.append(n)
        await gate.wait()

    first = owner.spawn(job(1), name="a", key="k")
    assert owner.spawn(job(2), name="a", key="k") is first  # the second is never run (and never leaks)
    await asyncio.sleep(0)
    gate.set()
    await owner.wait(1)
    assert runs == [1] and owner.running("k") is None and len(owner) == 0
    owner.spawn(job(3), name="a", key="k")
    await owner.wait(1)
    assert runs == [1, 3]


async def test_a_failing_task_is_logged_by_name_and_stops_no_sibling(caplog):
    owner = TaskOwner("t")
    sibling_done = asyncio.Event()

    async def fails():
        raise ValueError("boom")

    async def sibling():
        await asyncio.sleep(0.01)
        sibling_done.set()

    with caplog.at_level(logging.WARNING, logger="lorapub.runtime.tasks"):
        owner.spawn(fails(), name="bad")
        owner.spawn(sibling(), name="good")
        assert await owner.wait(1)
    assert sibling_done.is_set()
    assert "t-bad failed" in caplog.text and "boom" in caplog.text


async def test_close_lets_tasks_finish_within_grace_then_cancels_and_joins_the_rest():
    owner = TaskOwner("t")
    quick_done, slow_cancelled = asyncio.Event(), asyncio.Event()

    async def quick():
        await asyncio.sleep(0.01)
        quick_done.set()

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            slow_cancelled.set()
            raise

    owner.spawn(quick(), name="quick")
    owner.spawn(slow(), name="slow")
    await owner.close(grace=0.2)
    assert quick_done.is_set() and slow_cancelled.is_set() and len(owner) == 0
    with pytest.raises(RuntimeError, match="closed"):
        owner.spawn(quick(), name="late")


async def test_wait_for_a_kind_waits_only_for_the_tasks_of_that_kind():
    owner = TaskOwner("t")
    forever = asyncio.Event()
    owner.spawn(forever.wait(), name="renewals", key="renewals")
    owner.spawn(asyncio.sleep(0.01), name="reclaim", key=("reclaim", "v1"))
    assert await owner.wait(1, kind="reclaim")
    assert not await owner.wait(0.05)  # the renewals still run
    await owner.close()
