"""Clocks. Durations inside one process come from the monotonic clock; the registry's own time is
wall time anchored once and advanced by the monotonic clock, so an NTP step or a VM resume of the
host's wall clock never moves a lease."""

from __future__ import annotations

import asyncio
import time

__all__ = ["SystemClock", "RegistryClock", "Elapsed"]


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class RegistryClock:
    """The registry's time: the wall clock read once, at start, then advanced by the monotonic clock.

    Leases are deadlines on this clock, judged when the registry receives a renewal: a step of the
    host's wall clock after start changes nothing, and a timestamp another machine wrote is never
    compared with it."""

    def __init__(self) -> None:
        self._offset = time.time() - time.monotonic()

    def __call__(self) -> float:
        return self._offset + time.monotonic()


class Elapsed:
    """A remote clock carried forward locally: a reading ``at`` received from it, advanced by this
    process's monotonic clock (what a worker uses where it must speak in the registry's time)."""

    def __init__(self, at: float | None = None) -> None:
        self._base: float | None = None
        self._mono = 0.0
        if at is not None:
            self.set(at)

    def set(self, at: float) -> None:
        self._base, self._mono = at, time.monotonic()

    def __call__(self) -> float:
        if self._base is None:
            return time.time()  # nothing heard from the registry yet: the host's own wall time
        return self._base + (time.monotonic() - self._mono)
