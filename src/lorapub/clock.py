"""Clocks. Durations inside one process come from the monotonic clock; the registry's own time is
wall time anchored once and advanced by the monotonic clock, so an NTP step or a VM resume of the
host's wall clock never moves a lease."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorapub.ports import Clock

__all__ = ["SystemClock", "RegistryClock", "Elapsed"]


class SystemClock:
    """The default :class:`~lorapub.ports.Clock`: the monotonic clock, and asyncio's sleep."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class RegistryClock:
    """The registry's time: the wall clock read once, at start, then advanced by the monotonic clock.

    Leases are deadlines on this clock, judged when the registry receives a renewal: a step of the
    host's wall clock after start changes nothing, and a timestamp another machine wrote is never
    compared with it. ``clock``: what advances it (a deployment's own, so a test's manual clock
    drives lease expiry too; default: the monotonic clock)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._offset = time.time() - self._clock.monotonic()  # the wall clock, read once: an anchor

    def __call__(self) -> float:
        return self._offset + self._clock.monotonic()


class Elapsed:
    """A remote clock carried forward locally: a reading ``at`` received from it, advanced by this
    process's clock (what a worker uses where it must speak in the registry's time; default: the
    monotonic clock)."""

    def __init__(self, at: float | None = None, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._base: float | None = None
        self._mono = 0.0
        if at is not None:
            self.set(at)

    def set(self, at: float) -> None:
        self._base, self._mono = at, self._clock.monotonic()

    def __call__(self) -> float:
        if self._base is None:
            return time.time()  # nothing heard from the registry yet: the host's own wall time
        return self._base + (self._clock.monotonic() - self._mono)
