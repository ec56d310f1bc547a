"""Version lifecycle: LOADING -> PUBLISHED -> RETIRED -> RECLAIMING -> RECLAIMED,
with the failure path LOADING -> ABORTED -> FAILED_CLEAN, from which the same id and
digest may start a fresh attempt (FAILED_CLEAN -> LOADING)."""

from __future__ import annotations

import enum
from typing import TypedDict, Unpack

import attrs

from lorapub.core import _fields
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.errors import InvalidTransition

__all__ = [
    "VersionState", "SLOT_HOLDING", "NOT_DISPATCHABLE", "SERVING", "HELD_BY_ENGINES", "CommitReceipt", "Version",
    "VersionChanges", "advance", "add_session_ref", "drop_session_ref",
]


class VersionState(enum.Enum):
    LOADING = "LOADING"
    PUBLISHED = "PUBLISHED"
    RETIRED = "RETIRED"
    RECLAIMING = "RECLAIMING"
    RECLAIMED = "RECLAIMED"
    ABORTED = "ABORTED"
    FAILED_CLEAN = "FAILED_CLEAN"


# States that hold one of the logical capacity slots.
SLOT_HOLDING = frozenset(
    {
        VersionState.LOADING,
        VersionState.PUBLISHED,
        VersionState.RETIRED,
        VersionState.RECLAIMING,
        VersionState.ABORTED,
    }
)
# States for which no new request may be dispatched.
NOT_DISPATCHABLE = frozenset(
    {
        VersionState.LOADING,
        VersionState.RECLAIMING,
        VersionState.RECLAIMED,
        VersionState.ABORTED,
        VersionState.FAILED_CLEAN,
    }
)

_ALLOWED = {
    VersionState.LOADING: {VersionState.PUBLISHED, VersionState.ABORTED},
    VersionState.PUBLISHED: {VersionState.RETIRED},
    VersionState.RETIRED: {VersionState.RECLAIMING},
    VersionState.RECLAIMING: {VersionState.RECLAIMED},
    VersionState.ABORTED: {VersionState.FAILED_CLEAN},
    VersionState.RECLAIMED: set(),
    VersionState.FAILED_CLEAN: {VersionState.LOADING},
}

# States whose adapter sessions may still need on an engine (re-provisioned after a restart).
SERVING = frozenset({VersionState.PUBLISHED, VersionState.RETIRED})
# States in which engines may hold the version's adapter as the registry knows it (loaded or unloading).
HELD_BY_ENGINES = frozenset({VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING})


@attrs.frozen
class CommitReceipt:
    version: VersionKey
    token: AttemptToken
    default_revision: int
    retired: VersionKey | None


@attrs.frozen
class Version:
    key: VersionKey
    digest: str
    lora_name: str
    state: VersionState
    attempt: AttemptToken
    session_refs: int = 0
    # Engines that hold it once published; reclaim must hear from each of them. An engine
    # that restarts leaves this set until it is re-provisioned.
    engines: tuple[str, ...] = ()
    commit: CommitReceipt | None = None
    reclaim_id: str | None = None
    reclaim_pending: frozenset[str] = frozenset()
    # More than ``max_lag`` commits behind the default: the refs of its sessions no longer keep
    # it (they are told BINDING_STALE at their next generation), so it is reclaimed once the
    # requests already admitted on it end.
    retiring: bool = False
    # The canary saw an engine compute with it differently from its probe (why, or None): new
    # sessions may be kept off it (``avoid_suspect``); sessions bound to it keep it.
    suspect: str | None = None

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate

    @property
    def holds_slot(self) -> bool:
        return self.state in SLOT_HOLDING

    @property
    def reclaimable(self) -> bool:
        """RETIRED and kept by no session: no ref, or only the void refs of a retiring version."""
        return self.state is VersionState.RETIRED and (self.session_refs == 0 or self.retiring)

    def lag(self, default_revision: int) -> int | None:
        """Commits behind the default (0 for the default itself); None if never committed."""
        return None if self.commit is None else default_revision - self.commit.default_revision

    @property
    def dispatchable(self) -> bool:
        return self.state not in NOT_DISPATCHABLE


class VersionChanges(TypedDict, total=False):
    """The fields a lifecycle move may set besides the state."""

    attempt: AttemptToken
    engines: tuple[str, ...]
    commit: CommitReceipt
    reclaim_id: str
    reclaim_pending: frozenset[str]


def advance(version: Version, to: VersionState, **changes: Unpack[VersionChanges]) -> Version:
    if to not in _ALLOWED[version.state]:
        raise InvalidTransition(f"version {version.key}: {version.state.value} -> {to.value} is not a lifecycle move")
    return attrs.evolve(version, state=to, **changes)


def add_session_ref(version: Version) -> Version:
    if version.state is not VersionState.PUBLISHED:
        raise InvalidTransition(f"version {version.key} is {version.state.value}; only the PUBLISHED default is bound")
    return attrs.evolve(version, session_refs=version.session_refs + 1)


def drop_session_ref(version: Version) -> Version:
    if version.session_refs <= 0:
        raise InvalidTransition(f"version {version.key} has no session ref to release")
    return attrs.evolve(version, session_refs=version.session_refs - 1)
