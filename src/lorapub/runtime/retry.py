"""The one retry policy: how many tries, and how long to wait between them, on the Clock port.

Every loop of the runtime that tries again (a lost reserve or commit reply, an unload whose receipt did
not come, a session close the registry did not confirm, a reconciler pass that failed) takes its waits
from a :class:`RetryPolicy`, so a test's fake clock and a deployment's settings govern them all alike.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import attrs

from lorapub.errors import InvalidInput
from lorapub.ports import Clock

__all__ = ["RetryPolicy"]


def _check(policy: "RetryPolicy") -> None:
    if isinstance(policy.tries, bool) or not isinstance(policy.tries, int) or policy.tries < 1:
        raise InvalidInput(f"RetryPolicy.tries must be an int >= 1 (None: until stopped), got {policy.tries!r}")
    for name in ("first", "factor", "cap"):
        value = getattr(policy, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise InvalidInput(f"RetryPolicy.{name} must be a finite number >= 0, got {value!r}")
    if policy.factor < 1:
        raise InvalidInput(f"RetryPolicy.factor must be >= 1 (waits never shrink), got {policy.factor!r}")


@attrs.frozen
class RetryPolicy:
    """``tries`` tries in all; before try ``n`` (from 1) a wait of ``min(first * factor**(n-1), cap)``.

    ``async for n in policy.attempts(clock)`` yields the try numbers 0, 1, … and sleeps on ``clock``
    between them; the loop body ``break``s when a try succeeds."""

    tries: int = 5
    first: float = 0.05
    factor: float = 2.0
    cap: float = 1.0

    def __attrs_post_init__(self) -> None:
        _check(self)

    def delay(self, attempt: int) -> float:
        """The wait before try ``attempt + 1`` (``attempt`` counts the tries made, from 1)."""
        if attempt < 1:
            return 0.0
        return min(self.first * self.factor ** (attempt - 1), self.cap)

    async def attempts(self, clock: Clock) -> AsyncIterator[int]:
        for attempt in range(self.tries):
            if attempt:
                await clock.sleep(self.delay(attempt))
            yield attempt

    def with_tries(self, tries: int) -> "RetryPolicy":
        return attrs.evolve(self, tries=tries)
