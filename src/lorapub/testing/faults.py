"""Fault injection for embedders' tests: :class:`FaultyRegistry` wraps any
:class:`~lorapub.ports.Registry` and loses the request (nothing applied) or the reply (applied,
answer lost) of the next matching command, or of random non-query commands with ``rate=``.
See docs/testing.md, "Faults: `MemoryEngine` and `FaultyRegistry`".
"""

from __future__ import annotations

import random
from typing import Protocol, TypeVar, runtime_checkable

from lorapub.core.commands import QUERIES, Returns
from lorapub.core.registry import RegistryState, Result
from lorapub.errors import OutcomeUnknown
from lorapub.ports import Registry

R_ = TypeVar("R_")  # a command's reply type

__all__ = ["MODES", "FaultyRegistry"]

MODES = ("request", "reply")


@runtime_checkable
class _ShowsState(Protocol):
    @property
    def state(self) -> RegistryState: ...


class FaultyRegistry:
    """A :class:`~lorapub.ports.Registry` wrapper that loses planned or random requests and replies."""

    def __init__(self, inner: Registry, *, rate: float = 0.0, seed: int | None = None, queries: bool = False) -> None:
        self.inner = inner
        self.rate = rate
        self.queries = queries
        self._rng = random.Random(seed)
        self._planned: list[tuple[type | None, str]] = []
        self.injected: list[tuple[str, str]] = []  # (command type, mode), in order
        self.enabled = True

    def fail_next(self, command: type | None = None, mode: str = "reply", count: int = 1) -> None:
        """Fail the next ``count`` commands of type ``command`` (any type when None)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self._planned.extend([(command, mode)] * count)

    def clear_faults(self) -> None:
        """Drop the planned faults that have not fired yet."""
        self._planned.clear()

    def _fault_for(self, command: Returns[object]) -> str | None:
        if not self.enabled:
            return None
        for i, (kind, mode) in enumerate(self._planned):
            if kind is None or isinstance(command, kind):
                del self._planned[i]
                return mode
        if self.rate and (self.queries or not isinstance(command, QUERIES)) and self._rng.random() < self.rate:
            return self._rng.choice(MODES)
        return None

    async def handle(self, command: Returns[R_]) -> Result[R_]:
        mode = self._fault_for(command)
        if mode is not None:
            self.injected.append((type(command).__name__, mode))
        if mode == "request":
            raise OutcomeUnknown(f"injected: {type(command).__name__} was lost on the way")
        result = await self.inner.handle(command)
        if mode == "reply":
            raise OutcomeUnknown(f"injected: the reply to {type(command).__name__} was lost")
        return result

    @property
    def state(self) -> RegistryState:
        """The wrapped registry's state (for assertions; a registry that shows it, as LocalRegistry does)."""
        if not isinstance(self.inner, _ShowsState):
            raise AttributeError(f"{type(self.inner).__name__} shows no state")
        return self.inner.state
