"""The registry in this process: the single writer of :class:`~lorapub.core.registry.RegistryState`, the
in-process :class:`~lorapub.ports.Registry` (beside the ports: ``lorapub.adapters.ray_registry`` runs it in a Ray actor).

:meth:`LocalRegistry.apply` reads the state, computes the transition and stores it with no suspension
point in between, so it is a correct single writer under asyncio and inside a Ray actor alike.
:meth:`LocalRegistry.handle` is its face as a Registry.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Mapping, TypeVar, cast

import attrs

from lorapub.core import registry as R
from lorapub.core.commands import Command, Returns, stamped
from lorapub.core.identity import MANAGED_PREFIX, check_epoch
from lorapub.core.registry import RegistryState, Result
from lorapub.core.session_table import SessionTable
from lorapub.errors import EpochMismatch, InvalidInput, LorapubError, StoreCorrupted, StoreError
from lorapub.ports import RegistryStore
from lorapub.clock import RegistryClock

log = logging.getLogger(__name__)

R_ = TypeVar("R_")  # a command's reply type (R is the core registry module here)

__all__ = ["MemoryStore", "LocalRegistry"]


class MemoryStore:
    """The default store: the state lives as long as the process."""

    def __init__(self) -> None:
        self._state: RegistryState | None = None

    def load(self) -> RegistryState | None:
        return self._state

    def save(self, state: RegistryState, command: Command | None = None) -> None:
        self._state = state


class LocalRegistry:
    """Takes command values, returns :class:`~lorapub.core.registry.Result` values.

    With a durable ``store`` it resumes the state the store holds. That state must belong
    to ``epoch`` (:class:`~lorapub.errors.EpochMismatch` naming the store otherwise: a new
    epoch starts with a new store); on resume ``engines`` and ``capacity`` come from the
    store, where :class:`~lorapub.core.commands.RegisterEngine` keeps them current.
    The settings given are checked before the store is opened, on resume too: a refused
    registry leaves no store file behind.
    """

    def __init__(
        self,
        epoch: int,
        engines: Mapping[str, str],
        capacity: int = R.DEFAULT_CAPACITY,
        store: RegistryStore | None = None,
        *,
        lease_ttl: float | None = R.DEFAULT_LEASE_TTL,
        tombstone_window: float | None = R.DEFAULT_TOMBSTONE_WINDOW,
        clock: Callable[[], float] | None = None,
        max_lag: int | None = None,
        on_stale: str | None = None,
        name_prefix: str = MANAGED_PREFIX,
        avoid_suspect: bool = False,
    ) -> None:
        # the settings are checked before the store is opened: a refused registry creates no store file
        check_epoch(epoch)  # a run id string would name versions "run-7-v1" and break every later read
        fresh = R.new_registry(epoch, engines, capacity, lease_ttl, tombstone_window, max_lag, on_stale,
                               name_prefix, avoid_suspect=avoid_suspect)
        self._store = store if store is not None else MemoryStore()
        # wall time (leases mean the same to every process and after a restart), advanced monotonically
        # while this registry runs: a step of the host's clock never expires a lease
        self._clock = clock if clock is not None else RegistryClock()
        self._logs_commands = _save_takes_command(self._store)
        where = _where(self._store)
        try:
            loaded = self._store.load()
        except LorapubError:
            raise
        except Exception as e:
            raise StoreError(f"registry store {where}: cannot load it: {type(e).__name__}: {e}") from None
        if loaded is None:
            self._state = fresh
            self._save(self._state, None)
        elif not isinstance(loaded, RegistryState):
            self.close()  # refused: the store is released for whoever repairs it
            raise StoreCorrupted(f"registry store {where} holds a {type(loaded).__name__}, not a registry state")
        elif loaded.epoch != epoch:
            self.close()
            raise EpochMismatch(
                f"registry store {where} holds deployment epoch {loaded.epoch}; this registry serves epoch "
                f"{epoch}: refusing to resume it (use a new store for a new epoch)"
            )
        elif not isinstance(loaded.sessions, SessionTable):
            # a state an earlier release stored (its sessions a PMap of records): every field
            # through its converter again gives today's representation of the same state
            self._state = attrs.evolve(loaded)
        else:
            self._state = loaded
        if loaded is not None:
            try:
                R.check_room_for_lag(self._state.capacity, self._state.max_lag)
            except InvalidInput as e:
                # stored before such settings were refused: it resumes (refusing would strand its sessions),
                # but every publication will wait for sessions to end, so the operator is told how to fix it
                log.warning("registry store %s resumes settings now refused (publications wait for sessions to "
                            "end; start the next epoch with others): %s", where, e.message)
        self.transitions = 0

    @property
    def state(self) -> RegistryState:
        return self._state

    @property
    def store(self) -> RegistryStore:
        return self._store

    def _save(self, state: RegistryState, command: Command | None) -> None:
        try:
            if self._logs_commands:
                self._store.save(state, command)
            else:
                self._store.save(state)
        except LorapubError:
            raise
        except Exception as e:  # a store that raised something untyped: still a store failure
            raise StoreError(
                f"registry store {_where(self._store)}: save failed: {type(e).__name__}: {e}"
            ) from None

    def apply(self, command: Returns[R_]) -> Result[R_]:
        """Apply one command whole; a rejection raises its typed error and changes nothing.

        A transition is durable before this returns. If the store cannot save it, this
        raises :class:`~lorapub.errors.StoreError` and the state stays as it was: the
        command counts as not applied (replaying it later is safe, as for every command).
        """
        # the one clock reading, before the transition (and the log)
        applied = stamped(cast(Command, command), self._clock())  # every Returns is a Command
        outcome = R.handle(self._state, applied)
        if not isinstance(applied, R.QUERIES):
            if outcome.state is not self._state:  # an idempotent replay changes nothing: nothing to store
                self._save(outcome.state, applied)  # durable before the reply leaves
                self._state = outcome.state
            self.transitions += 1
        return Result(outcome.reply, outcome.effects, outcome.facts)

    def apply_many(self, commands: list[Command]) -> list[Result[Any] | LorapubError]:
        """Apply commands in order, each answered on its own (a rejection is returned, not
        raised, and changes nothing); the transitions are made durable together — one group
        commit when the store has ``save_many`` — before any answer is returned. If that
        commit fails, every command of the batch counts as not applied (StoreError each)."""
        state = self._state
        answers: list[Result[Any] | LorapubError] = []
        changed: list[tuple[RegistryState, Command]] = []
        for command in commands:
            command = stamped(command, self._clock())
            try:
                outcome = R.handle(state, command)
            except LorapubError as e:
                answers.append(e)
                continue
            if not isinstance(command, R.QUERIES) and outcome.state is not state:
                state = outcome.state
                changed.append((state, command))
            answers.append(Result(outcome.reply, outcome.effects, outcome.facts))
        if changed:
            save_many = getattr(self._store, "save_many", None)
            try:
                if save_many is not None and self._logs_commands:
                    try:
                        save_many(changed)
                    except LorapubError:
                        raise
                    except Exception as e:
                        raise StoreError(f"registry store {_where(self._store)}: save failed: {type(e).__name__}: {e}") from None
                else:
                    for new, command in changed:
                        self._save(new, command)
            except StoreError as e:
                return [e if isinstance(a, Result) else a for a in answers]
            self._state = state
            self.transitions += len(changed)
        return answers

    async def handle(self, command: Returns[R_]) -> Result[R_]:
        return self.apply(command)

    def close(self) -> None:
        """Release the store (a durable store's file and lock); the registry is not usable after."""
        close = getattr(self._store, "close", None)
        if close is not None:
            close()


def _where(store: Any) -> str:
    return str(getattr(store, "path", None) or type(store).__name__)


def _save_takes_command(store: Any) -> bool:
    """Whether ``store.save`` accepts the command too (stores written before it did take only the state)."""
    try:
        params = list(inspect.signature(store.save).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2
