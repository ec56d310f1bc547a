"""SessionBinding: OPEN -> BOUND (first generation) -> CLOSING -> CLOSED tombstone,
or -> EXPIRED tombstone when its lease runs out (its worker stopped renewing it).

A session holds at most one session ref, on the one version it bound first, released exactly once (by
close_and_release or by expiry). A CLOSING, CLOSED or EXPIRED session never opens, binds or dispatches again.
See docs/design.md, "Lifecycles in the core".
"""

from __future__ import annotations

import enum
from typing import TypedDict, Unpack

import attrs

from lorapub.core import _fields
from lorapub.core.identity import SessionKey, VersionKey
from lorapub.errors import InvalidTransition, SessionClosed, SessionExpired

__all__ = [
    "SessionState", "ENDING", "TOMBSTONES", "LEASED", "SessionRecord", "Binding", "opened", "bound", "closing",
    "closed", "leased", "expired", "require_dispatchable",
]


class SessionState(enum.Enum):
    OPEN = "OPEN"
    BOUND = "BOUND"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"
    EXPIRED = "EXPIRED"


ENDING = frozenset({SessionState.CLOSING, SessionState.CLOSED, SessionState.EXPIRED})
# Tombstones: the ref is released; only late messages can still arrive.
TOMBSTONES = frozenset({SessionState.CLOSED, SessionState.EXPIRED})
# States whose ref a lease keeps alive (a worker that dies mid-close leaves CLOSING).
LEASED = frozenset({SessionState.OPEN, SessionState.BOUND, SessionState.CLOSING})


#: The lifecycle moves, as the module's docstring draws them (a new record starts OPEN, or CLOSING when a close
#: arrives first); every function below moves a record only through :func:`_move`, which refuses any other.
_ALLOWED: dict[SessionState, frozenset[SessionState]] = {
    SessionState.OPEN: frozenset({SessionState.BOUND, SessionState.CLOSING, SessionState.EXPIRED}),
    SessionState.BOUND: frozenset({SessionState.CLOSING, SessionState.EXPIRED}),
    SessionState.CLOSING: frozenset({SessionState.CLOSED, SessionState.EXPIRED}),
    SessionState.CLOSED: frozenset(),
    SessionState.EXPIRED: frozenset(),
}


@attrs.frozen
class SessionRecord:
    key: SessionKey
    state: SessionState
    version: VersionKey | None = None
    holds_ref: bool = False  # a group member never holds one: its group does
    lease_until: float | None = None  # None: no lease (never expires)
    group: str | None = None  # the group it joined (counted in the group's open members)
    rebinds: int = 0  # times it was moved to a newer version on purpose (on_stale="rebind")

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


@attrs.frozen
class Binding:
    """What a session dispatches with, for its whole life (or until an explicit rebind).

    ``revision`` is the default revision the version was committed at: its lag at any moment
    is the default revision then minus this."""

    session: SessionKey
    version: VersionKey
    lora_name: str
    digest: str
    revision: int = 0
    group: str | None = None
    rebinds: int = 0
    #: its group's rebinds when it was bound: above 0, the group's members were not all served by one
    #: version (on_stale="rebind" moved the group), even where this member itself never moved
    group_rebinds: int = 0


class _Changes(TypedDict, total=False):
    version: VersionKey | None
    holds_ref: bool
    group: str | None
    lease_until: float | None


def _move(record: "SessionRecord", to: SessionState, **changes: Unpack[_Changes]) -> "SessionRecord":
    if to not in _ALLOWED[record.state]:
        raise InvalidTransition(f"session {record.key}: {record.state.value} -> {to.value} is not a lifecycle move",
                                session=record.key)
    return attrs.evolve(record, state=to, **changes)


def _refuse_if_ending(record: SessionRecord, what: str) -> None:
    if record.state is SessionState.EXPIRED:
        raise SessionExpired(
            f"session {record.key} expired (its lease was not renewed) and its version ref was released; "
            f"{what} refused — start a new session", session=record.key,
        )
    if record.state in ENDING:
        raise SessionClosed(f"session {record.key} is {record.state.value}; {what} refused — open a new session "
                            "(dep.session(id) again starts a new lifecycle of the id)", session=record.key)


def opened(record: SessionRecord | None, key: SessionKey) -> SessionRecord:
    if record is None:
        return SessionRecord(key, SessionState.OPEN)
    _refuse_if_ending(record, "open")
    return record


def bound(
    record: SessionRecord | None, key: SessionKey, version: VersionKey, *, holds_ref: bool = True,
    group: str | None = None,
) -> SessionRecord:
    """The caller checked the record is not bound yet and adds the version's ref (or, for a
    group member, its group holds it)."""
    record = opened(record, key)
    if record.state is not SessionState.OPEN:
        raise InvalidTransition(f"session {key} is already {record.state.value}")
    return _move(record, SessionState.BOUND, version=version, holds_ref=holds_ref, group=group)


def closing(record: SessionRecord | None, key: SessionKey) -> SessionRecord:
    if record is None:
        return SessionRecord(key, SessionState.CLOSING)
    if record.state in ENDING:
        return record
    return _move(record, SessionState.CLOSING)


def closed(record: SessionRecord | None, key: SessionKey) -> tuple[SessionRecord, VersionKey | None]:
    """Returns the tombstone and the version whose ref must be dropped now (None if none)."""
    record = closing(record, key)
    if record.state in TOMBSTONES:
        return record, None
    release = record.version if record.holds_ref else None
    return _move(record, SessionState.CLOSED, holds_ref=False), release


def leased(record: SessionRecord, lease_until: float | None) -> SessionRecord:
    if lease_until is None or record.state not in LEASED:
        return record
    return attrs.evolve(record, lease_until=lease_until)


def expired(record: SessionRecord) -> tuple[SessionRecord, VersionKey | None]:
    """The EXPIRED tombstone and the version whose ref must be dropped now (None if none); a tombstone
    stays as it is (its ref was released when it became one)."""
    if record.state in TOMBSTONES:
        return record, None
    release = record.version if record.holds_ref else None
    return _move(record, SessionState.EXPIRED, holds_ref=False, lease_until=None), release


def require_dispatchable(record: SessionRecord | None, key: SessionKey) -> SessionRecord:
    if record is None:  # never bound here, or expired so long ago that its tombstone was forgotten
        raise InvalidTransition(f"session {key} is unknown; bind it before dispatching", session=key, unknown=True)
    _refuse_if_ending(record, "dispatch")
    if record.state is not SessionState.BOUND:
        raise InvalidTransition(f"session {key} is {record.state.value}; bind it before dispatching")
    return record
