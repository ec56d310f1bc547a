"""A clock a test moves by hand: the one ``Deployment(clock=)`` hands every part (leases, session idleness,
the reconcile interval, retries' backoff), and what ``MemoryEngine(clock=)`` ages its stashes by.
``sleep`` waits until the test advances the clock past its deadline.
See docs/testing.md, "Time: `ManualClock`".
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["ManualClock"]


class ManualClock:
    """``monotonic()`` is ``now``; ``advance(seconds)`` moves it on (never back) and wakes, in deadline
    order, every ``sleep`` that is due by then. Nothing else moves it: a task sleeping on it waits for
    the test, as in ``trio.testing.MockClock`` without its autojump, so a run is the same every time.

    ``sleeping`` counts the sleeps not yet due and ``next_wakeup`` is the earliest one's deadline (None
    without any): ``clock.advance(clock.next_wakeup - clock.now)`` runs the next timer. One advance
    wakes a periodic loop once, however many of its periods it spans (its next sleep starts from the
    new ``now``). Setting ``now`` (``clock.now += 5``) is an advance."""

    def __init__(self, now: float = 1000.0) -> None:
        self._now = float(now)
        self._order = itertools.count()  # sleeps due at the same time wake in the order they began
        self._sleeps: list[tuple[float, int, asyncio.Future[None]]] = []  # a heap by deadline

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        self._now = float(value)
        self._wake()

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back, got {seconds!r}")
        self.now = self._now + seconds

    async def sleep(self, seconds: float) -> None:
        """Return once the clock reaches ``now + seconds`` (at once, after a scheduling point, when
        that is not in the future); a cancelled sleep leaves nothing behind."""
        if not seconds > 0:
            await asyncio.sleep(0)  # a scheduling point, as a real sleep is
            return
        due: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleeps, (self._now + seconds, next(self._order), due))
        try:
            await due
        finally:
            if not due.done():  # cancelled: its entry is dropped when it comes up (see _wake)
                due.cancel()

    @property
    def sleeping(self) -> int:
        """How many sleeps wait for the clock now."""
        return sum(1 for _, _, due in self._sleeps if not due.done())

    @property
    def next_wakeup(self) -> float | None:
        """The deadline of the earliest sleep still waiting (None: nothing sleeps on this clock)."""
        while self._sleeps and self._sleeps[0][2].done():
            heapq.heappop(self._sleeps)  # a cancelled one
        return self._sleeps[0][0] if self._sleeps else None

    def _wake(self) -> None:
        while self._sleeps and self._sleeps[0][0] <= self._now:
            _, _, due = heapq.heappop(self._sleeps)
            if not due.done():
                due.set_result(None)
