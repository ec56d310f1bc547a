"""lorapub.testing.ManualClock: a sleep waits for the test to advance the clock, wakes in deadline
order, and a cancelled one leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from lorapub.testing import ManualClock


async def test_a_sleep_waits_until_the_clock_is_advanced_past_its_deadline():
    clock = ManualClock(now=0.0)
    woke: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.ensure_future(sleeper(n, s)) for n, s in (("late", 10.0), ("soon", 5.0), ("also-soon", 5.0))]
    for _ in range(5):
        await asyncio.sleep(0)
    assert woke == [] and clock.sleeping == 3 and clock.next_wakeup == 5.0
    clock.advance(4.9)
    for _ in range(5):
        await asyncio.sleep(0)
    assert woke == []
    clock.advance(0.1)
    for _ in range(5):
        await asyncio.sleep(0)
    assert woke == ["soon", "also-soon"]  # same deadline: in the order they began
    clock.now += 100  # setting now is an advance
    await asyncio.gather(*tasks)
    assert woke == ["soon", "also-soon", "late"] and clock.sleeping == 0 and clock.next_wakeup is None


async def test_a_cancelled_sleep_leaves_nothing_and_a_zero_sleep_returns_at_once():
    clock = ManualClock()
    task = asyncio.ensure_future(clock.sleep(30))
    await asyncio.sleep(0)
    assert clock.sleeping == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock.sleeping == 0 and clock.next_wakeup is None
    clock.advance(60)  # nothing to wake
    await clock.sleep(0)
    await clock.sleep(-1)
    assert clock.monotonic() == 1060.0


def test_the_clock_never_goes_back():
    with pytest.raises(ValueError):
        ManualClock().advance(-1)
