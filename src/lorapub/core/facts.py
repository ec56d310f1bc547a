"""What a registry decision established, as values: the facts an ``Outcome`` (and a ``Result``) carries.

The transition that decides one records it (a READY taken, a version retired, a reclaim claimed, an unload
counted, a version reclaimed); a replayed command decides nothing new and records none. The observers turn
each into its :mod:`lorapub.events` event instead of re-deriving it from replies or state.
See docs/design.md, "Shape".
"""

from __future__ import annotations

from typing import Iterable, Union

import attrs

from lorapub.core.identity import VersionKey

__all__ = ["Claimed", "Fact", "Readied", "Reclaimed", "Retired", "Unloaded", "as_facts"]


@attrs.frozen
class Readied:
    """``engine``'s READY for ``version`` was taken: not late, unknown or of another attempt (a READY of the
    wrong digest is taken too: it aborts the attempt)."""

    version: VersionKey
    engine: str


@attrs.frozen
class Retired:
    """A commit of ``by`` retired ``version``, the default before it."""

    version: VersionKey
    by: VersionKey


@attrs.frozen
class Claimed:
    """The reclaim of ``version`` was claimed, as ``reclaim_id`` (a replayed claim is not a new one)."""

    version: VersionKey
    reclaim_id: str


@attrs.frozen
class Unloaded:
    """``engine``'s unload of ``version`` was counted for its reclaim."""

    version: VersionKey
    engine: str


@attrs.frozen
class Reclaimed:
    """The last unload of ``version`` was counted: it is RECLAIMED."""

    version: VersionKey


Fact = Union[Readied, Retired, Claimed, Unloaded, Reclaimed]


def as_facts(facts: Iterable[Fact]) -> tuple[Fact, ...]:
    return tuple(facts)
