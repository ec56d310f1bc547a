"""The registry in this process: the single writer of :class:`~lorapub.core.registry.RegistryState`.

:meth:`LocalRegistry.apply` is synchronous on purpose: it reads the state, computes
the transition and stores it with no suspension point in between, so it is a
correct single writer under asyncio and inside a Ray actor alike.
:meth:`LocalRegistry.handle` is its face as a :class:`~lorapub.ports.Registry`;
``lorapub.adapters.ray_registry.RayRegistry`` is the same face over a Ray actor.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from lorapub.core import registry as R
from lorapub.core.commands import Command, stamped
from lorapub.core.registry import RegistryState, Result
from lorapub.ports import RegistryStore


class MemoryStore:
    """The default store: the state lives as long as the process."""

    def __init__(self) -> None:
        self._state: RegistryState | None = None

    def load(self) -> RegistryState | None:
        return self._state

    def save(self, state: RegistryState) -> None:
        self._state = state


class LocalRegistry:
    """Takes command values, returns :class:`~lorapub.core.registry.Result` values."""

    def __init__(
        self,
        epoch: int,
        engines: Mapping[str, str],
        capacity: int = R.DEFAULT_CAPACITY,
        store: RegistryStore | None = None,
        *,
        lease_ttl: float | None = R.DEFAULT_LEASE_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store or MemoryStore()
        self._clock = clock  # wall time: leases must mean the same to every process and after a restart
        self._state = self._store.load() or R.new_registry(epoch, engines, capacity, lease_ttl)
        self._store.save(self._state)
        self.transitions = 0

    @property
    def state(self) -> RegistryState:
        return self._state

    def apply(self, command: Command) -> Result:
        """Apply one command whole; a rejection raises its typed error and changes nothing."""
        command = stamped(command, self._clock())  # the one clock reading, before the transition
        outcome = R.handle(self._state, command)
        if not isinstance(command, R.QUERIES):
            self._state = outcome.state
            self._store.save(outcome.state)  # durable before the reply leaves
            self.transitions += 1
        return Result(outcome.reply, outcome.effects)

    async def handle(self, command: Command) -> Result:
        return self.apply(command)
