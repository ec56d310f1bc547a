"""The observers of one deployment: every part hands its decisions (:mod:`lorapub.events`) to one
:class:`Observers`, which passes each to every observer; one that raises is logged once and never
breaks a publication. :class:`ObservedRegistry` times every registry decision.
See docs/operating.md, "Decision events".
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator, Protocol, TypeVar, runtime_checkable

from lorapub.core.commands import ClaimReclaim, Command, Commit, RecordReady, RecordUnloaded, Returns
from lorapub.core.effects import Ignored
from lorapub.core.identity import VersionKey
from lorapub.core.registry import Result
from lorapub.core.version import CommitReceipt, VersionState
from lorapub.errors import InvalidInput, LorapubError
from lorapub.events import (
    EngineReady,
    Event,
    Observer,
    ReclaimClaimed,
    RegistryDecided,
    VersionReclaimed,
    VersionRetired,
    VersionUnloaded,
)
from lorapub.ports import Clock, Registry
from lorapub.runtime.clock import SystemClock

R_ = TypeVar("R_")  # a command's reply type

__all__ = ["Observers", "ObservedRegistry", "Exposes", "exposition_of"]

log = logging.getLogger(__name__)


@runtime_checkable
class Exposes(Protocol):
    """An observer that also serves what it counted as a text exposition (the status endpoint's
    ``/metrics``): ``(body, content type)``, e.g. :class:`lorapub.adapters.prometheus.Metrics`."""

    def exposition(self) -> tuple[bytes, str]: ...


def exposition_of(observers: Iterable[object]) -> Callable[[], tuple[bytes, str]] | None:
    """The first of ``observers`` that serves an exposition: its ``exposition`` (None: none does)."""
    return next((o.exposition for o in observers if isinstance(o, Exposes) and callable(o.exposition)), None)


class Observers:
    """Fan-out to observers (callables taking one :class:`~lorapub.events.Event`)."""

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self._observers: list[Observer] = []
        self._failed: set[int] = set()
        for observer in observers:
            self.add(observer)

    def add(self, observer: Observer) -> None:
        if not callable(observer):
            raise InvalidInput(f"an observer is a callable taking one lorapub.events.Event, got {observer!r}")
        self._observers.append(observer)

    def remove(self, observer: Observer) -> None:
        self._observers = [o for o in self._observers if o is not observer]

    def __len__(self) -> int:
        return len(self._observers)

    def __iter__(self) -> Iterator[Observer]:
        return iter(tuple(self._observers))

    def __call__(self, event: Event) -> None:
        for observer in tuple(self._observers):
            try:
                observer(event)
            except Exception:  # noqa: BLE001 - an observer's bug never breaks a decision
                if id(observer) not in self._failed:  # once per observer: a broken one would flood the log
                    self._failed.add(id(observer))
                    log.exception("observer %r failed on %s (further failures of it are not logged)",
                                  observer, event.KIND)


class ObservedRegistry:
    """A :class:`~lorapub.ports.Registry` whose every answer is also a
    :class:`~lorapub.events.RegistryDecided` (command, seconds, ok or the error's code), and whose
    answers that record a decision become its event: an engine READY, a retirement, a reclaim
    claimed, an unload, a version reclaimed. A replayed command's answer is not a second event.
    ``clock``: the deployment's, which a reclaim's age (claimed to reclaimed, its retries' backoff
    included) is read from."""

    def __init__(self, inner: Registry, observers: Observers, clock: Clock | None = None) -> None:
        self.inner = inner
        self.observers = observers
        self.clock: Clock = clock or SystemClock()
        self._claims: dict[VersionKey, tuple[str, float]] = {}  # reclaim claimed here -> (id, when)
        self._retired: dict[VersionKey, None] = {}  # retirements told (the newest few)

    async def handle(self, command: Returns[R_]) -> Result[R_]:
        started = time.perf_counter()  # how long the registry took to decide, for the event: a duration, no timer
        outcome = "ok"
        try:
            result = await self.inner.handle(command)
            if self.observers:
                self._derive(command, result)
            return result
        except LorapubError as e:
            outcome = e.code
            raise
        except BaseException as e:
            outcome = type(e).__name__
            raise
        finally:
            if self.observers:
                self.observers(RegistryDecided(type(command).__name__, time.perf_counter() - started, outcome))

    def _derive(self, command: object, result: Result[Any]) -> None:
        reply, emit = result.reply, self.observers
        if isinstance(command, RecordReady):
            if not any(isinstance(fx, Ignored) for fx in result.effects):  # a late READY changes nothing
                emit(EngineReady(command.receipt.token.version, command.receipt.engine))
        elif isinstance(command, Commit) and isinstance(reply, CommitReceipt) and reply.retired is not None:
            if reply.retired not in self._retired:  # a replayed commit answers the same receipt
                self._retired[reply.retired] = None
                while len(self._retired) > 256:
                    del self._retired[next(iter(self._retired))]
                emit(VersionRetired(reply.retired, reply.version))
        elif isinstance(command, ClaimReclaim) and isinstance(reply, str):
            if self._claims.get(command.key, ("",))[0] != reply:
                self._claims[command.key] = (reply, self.clock.monotonic())
                emit(ReclaimClaimed(command.key, reply))
        elif isinstance(command, RecordUnloaded):
            if any(isinstance(fx, Ignored) for fx in result.effects):  # a late or replayed receipt changes nothing
                return
            emit(VersionUnloaded(command.key, command.engine))
            if reply is VersionState.RECLAIMED:
                claimed = self._claims.pop(command.key, None)
                emit(VersionReclaimed(command.key, self.clock.monotonic() - claimed[1] if claimed else 0.0))

    def __getattr__(self, name: str) -> object:  # the inner registry's own reads (e.g. a store's state)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<ObservedRegistry {self.inner!r}>"
