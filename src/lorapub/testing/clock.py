"""A clock a test moves by hand: what ``Deployment(clock=)`` reads session ages from, and what
``MemoryEngine(clock=)`` ages its stashes by. ``sleep`` advances it and returns at once."""

from __future__ import annotations

import asyncio

__all__ = ["ManualClock"]


class ManualClock:
    """``monotonic()`` is ``now``; ``advance(seconds)`` moves it on (never back)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = float(now)

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back, got {seconds!r}")
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)  # a scheduling point, as a real sleep is
