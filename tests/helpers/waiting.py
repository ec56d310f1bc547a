"""Waiting in tests without betting on the machine's speed: poll a condition, with an upper bound
generous enough for a loaded machine (the happy path returns as soon as the condition holds)."""

from __future__ import annotations

from typing import Callable

from lorapub.demo.workload import until as _poll

#: The bound on any wait for something that should happen soon: a busy 2-core machine may take
#: many times the usual; a test that claims "at once, not after N seconds" passes a bound below N.
PATIENCE = 10.0


async def until(condition: Callable[[], object], seconds: float = PATIENCE, what: str = "the condition") -> None:
    """Return once ``condition()`` holds; fail naming ``what`` if it does not within ``seconds``."""
    try:
        await _poll(lambda: bool(condition()), timeout=seconds)
    except TimeoutError:
        raise AssertionError(f"{what} did not hold within {seconds:g} s") from None
