"""SessionGroup: sessions that must see one policy (a GRPO prompt group, the n>1 children of one
prompt, forks of one trajectory). OPEN -> BOUND (at the first generation of any member) ->
CLOSED (when its last open member closes or expires). Every member binds the group's version, and the
group holds the one session ref on it while any member is open. A closed group takes no new member:
a group never spans two versions (except by an explicit rebind of the whole group, recorded in ``rebinds``).
See docs/design.md, "Lifecycles in the core".
"""

from __future__ import annotations

import enum

import attrs

from lorapub.core import _fields
from lorapub.core.identity import VersionKey
from lorapub.errors import GroupClosed

__all__ = ["GroupState", "GroupRecord", "joined", "bound", "rebound", "left"]


class GroupState(enum.Enum):
    OPEN = "OPEN"
    BOUND = "BOUND"
    CLOSED = "CLOSED"


@attrs.frozen
class GroupRecord:
    group: str
    state: GroupState = GroupState.OPEN
    members: int = 0  # members that joined and are not closed or expired
    version: VersionKey | None = None
    holds_ref: bool = False
    rebinds: int = 0
    closed_at: float | None = None  # registry time; the tombstone is forgotten a window later

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


def joined(record: GroupRecord | None, group: str) -> GroupRecord:
    """One more open member."""
    if record is None:
        record = GroupRecord(group)
    if record.state is GroupState.CLOSED:
        raise GroupClosed(
            f"group {group!r} is closed: every member that joined it has closed or expired, and a group never "
            "spans two versions — open a new group (members should open before any of them closes)",
            group=group,
        )
    return attrs.evolve(record, members=record.members + 1)


def bound(record: GroupRecord, version: VersionKey) -> GroupRecord:
    """The group's first generation: it binds ``version`` and takes its one ref."""
    return attrs.evolve(record, state=GroupState.BOUND, version=version, holds_ref=True)


def rebound(record: GroupRecord, version: VersionKey) -> tuple[GroupRecord, VersionKey | None]:
    """The whole group moves to ``version``; returns the version whose ref it drops (None if none)."""
    release = record.version if record.holds_ref else None
    return attrs.evolve(record, version=version, holds_ref=True, rebinds=record.rebinds + 1), release


def left(record: GroupRecord, now: float | None) -> tuple[GroupRecord, VersionKey | None]:
    """One member closed or expired; the last one closes the group and its ref is dropped."""
    members = record.members - 1
    if members > 0:
        return attrs.evolve(record, members=members), None
    release = record.version if record.holds_ref else None
    return attrs.evolve(record, state=GroupState.CLOSED, members=0, holds_ref=False, closed_at=now), release
