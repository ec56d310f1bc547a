"""The lives each engine was seen to have, most recent last, a few per engine: a turn an engine
served in a life it has since left (a restart while the answer travelled back) is still a turn of
that engine. See docs/provenance.md, "Stamp"."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["LIVES_KEPT", "LivesSeen"]

#: How many lives are kept per engine: a turn outlives at most a restart or two, and a record that
#: never forgets would grow with every restart of a long run.
LIVES_KEPT = 8


class LivesSeen:
    """Per engine, the last :data:`LIVES_KEPT` incarnations it said, or the registry recorded for it."""

    def __init__(self, kept: int = LIVES_KEPT) -> None:
        self._kept = kept
        self._lives: dict[str, deque[str]] = {}

    def saw(self, engine: str, incarnation: object) -> None:
        if not isinstance(incarnation, str) or not incarnation:
            return
        lives = self._lives.setdefault(engine, deque(maxlen=self._kept))
        if incarnation in lives:
            lives.remove(incarnation)  # seen again: the most recent
        lives.append(incarnation)

    def of(self, engines: Iterable[str]) -> set[str]:
        """Every life kept for any of ``engines``."""
        return {life for e in engines for life in self._lives.get(e, ())}
