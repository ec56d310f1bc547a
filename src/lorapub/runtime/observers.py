"""The observers of one deployment: every part hands its decisions (:mod:`lorapub.events`) to one
:class:`Observers`, which passes each to every observer; one that raises is logged once and never
breaks a publication. :class:`ObservedRegistry` times every registry decision.
See docs/operating.md, "Decision events".
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator, Protocol, TypeVar, runtime_checkable

from lorapub.core.commands import Returns
from lorapub.core.facts import Claimed, Fact, Readied, Reclaimed, Retired, Unloaded
from lorapub.core.identity import VersionKey
from lorapub.core.registry import Result
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
from lorapub.clock import SystemClock

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
    answers' facts (:mod:`lorapub.core.facts`, what the registry decided) become their events: an engine
    READY, a retirement, a reclaim claimed, an unload, a version reclaimed. A replayed command decides
    nothing new, so it is not a second event.
    ``clock``: the deployment's, which a reclaim's age (claimed to reclaimed, its retries' backoff
    included) is read from."""

    def __init__(self, inner: Registry, observers: Observers, clock: Clock | None = None) -> None:
        self.inner = inner
        self.observers = observers
        self.clock: Clock = clock or SystemClock()
        self._claims: dict[VersionKey, float] = {}  # reclaim claimed here -> when

    async def handle(self, command: Returns[R_]) -> Result[R_]:
        started = time.perf_counter()  # how long the registry took to decide, for the event: a duration, no timer
        outcome = "ok"
        try:
            result = await self.inner.handle(command)
            if self.observers:
                self._tell(result.facts)
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

    def _tell(self, facts: tuple[Fact, ...]) -> None:
        """Each fact the registry decided (:mod:`lorapub.core.facts`) as its event; a reclaim's age is
        read from this observer's clock, from the claim it saw to the reclaim."""
        emit = self.observers
        for fact in facts:
            if isinstance(fact, Readied):
                emit(EngineReady(fact.version, fact.engine))
            elif isinstance(fact, Retired):
                emit(VersionRetired(fact.version, fact.by))
            elif isinstance(fact, Claimed):
                self._claims[fact.version] = self.clock.monotonic()
                emit(ReclaimClaimed(fact.version, fact.reclaim_id))
            elif isinstance(fact, Unloaded):
                emit(VersionUnloaded(fact.version, fact.engine))
            elif isinstance(fact, Reclaimed):
                claimed = self._claims.pop(fact.version, None)
                emit(VersionReclaimed(fact.version, self.clock.monotonic() - claimed if claimed is not None else 0.0))

    def __getattr__(self, name: str) -> object:  # the inner registry's own reads (e.g. a store's state)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<ObservedRegistry {self.inner!r}>"
