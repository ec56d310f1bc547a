"""The registry's commands as values (as h11 and h2 take events).

A request is an imperative verb (``Reserve``, ``Commit``, ``BindFirst``…), a report of what happened
elsewhere is ``Record<Fact>`` (``RecordPrepared``, ``RecordReady``…), a query only reads
(``QueryAttempt``, ``ReadVersion``…). Each has one transition function of the same name in snake case
in :mod:`lorapub.core.registry`, whose :func:`~lorapub.core.registry.handle` is the one door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, Iterable, TypeVar

import attrs

from lorapub.core import _fields
from lorapub.core.attempt import ReadyLocal
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey
from lorapub.core.manifest import BucketPlan

if TYPE_CHECKING:  # the replies' types: the registry's own modules import this one
    from lorapub.core.attempt import Phase
    from lorapub.core.registry.state import (
        AttemptStatus, Fleet, Membership, RegistryState, ReserveReply, SessionsOf, Waiting,
    )
    from lorapub.core.session import Binding, SessionState
    from lorapub.core.version import CommitReceipt, Version, VersionState

__all__ = [
    "Returns", "RegisterEngine", "Reserve", "CancelWait", "RecordPrepared", "RecordBucketDone", "RecordReady", "RecordFailure",
    "RecordUnknown", "RecordCleaned", "RetryCleanup", "Commit", "OpenSession", "BindFirst", "Rebind", "RenewLeases",
    "ExpireSessions", "ExpireLeases", "StartReprovision", "RecordLost", "AbortStale", "BeginClose", "CloseAndRelease",
    "ForgetSessions", "ClaimReclaim", "RecordUnloaded", "RetryReclaim", "AuthorizeDispatch", "QueryAttempt",
    "ReadVersion", "ListReclaimable", "ReadState", "ReadFleet", "ReadSessionsOf", "Command", "QUERIES", "STAMPED",
    "stamped", "AddEngine", "DrainEngine", "RemoveEngine",
    "MarkSuspect",
]


R_co = TypeVar("R_co", covariant=True)


class Returns(Generic[R_co]):
    """A command whose registry reply is an ``R_co``: ``await registry.handle(command)`` is a
    ``Result[R_co]`` (lorapub.ports.Registry), so every ``.reply`` read is typed."""

    __slots__ = ()


def _session_keys(keys: Iterable[SessionKey]) -> tuple[SessionKey, ...]:
    return tuple(keys)


# requests and reports: they may change the state
@attrs.frozen
class RegisterEngine(Returns["None"]):
    engine: str
    incarnation: str


@attrs.frozen
class MarkSuspect(Returns["bool"]):
    """The canary found ``engine`` computing with a resident version differently from its probe:
    mark the version suspect (idempotent; only a PUBLISHED or RETIRED version)."""

    key: VersionKey
    engine: str
    reason: str


@attrs.frozen
class AddEngine(Returns["Membership"]):
    """``engine`` joins the fleet: JOINING (no traffic) until it holds every version sessions may use,
    then SERVING. A draining member added again rejoins; a member's new incarnation is a restart."""

    engine: str
    incarnation: str


@attrs.frozen
class DrainEngine(Returns["Membership"]):
    """``engine`` takes no new binding and no new version; its sessions move to another holder of their
    version at their next turn boundary. Refused for the last member that takes traffic."""

    engine: str


@attrs.frozen
class RemoveEngine(Returns["bool"]):
    """``engine`` leaves the fleet: only once draining (``force``: it is gone, e.g. unreachable). Reclaims
    and cleanups stop waiting for it; its versions' slots are counted without it."""

    engine: str
    force: bool = False


@attrs.frozen
class Reserve(Returns["ReserveReply | Waiting"]):
    """``publisher`` names the caller: its own replay (a lost reply) resumes the attempt,
    another publisher's same key and digest joins it.

    ``wait`` (seconds): when no slot is free, or another attempt runs, the call is recorded as
    the waiting publication (the reply says what holds the slots) instead of being refused; the
    caller asks again. A newer publication supersedes an older one still waiting."""

    key: VersionKey
    digest: str
    plan: BucketPlan
    publisher: str = ""
    wait: float | None = None
    now: float | None = None

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


@attrs.frozen
class CancelWait(Returns["bool"]):
    """The waiting publication of ``key`` stopped waiting (its caller's wait ran out)."""

    key: VersionKey


@attrs.frozen
class RecordPrepared(Returns["Phase"]):
    token: AttemptToken
    engine: str
    incarnation: str


@attrs.frozen
class RecordBucketDone(Returns["Phase"]):
    token: AttemptToken
    party: str
    index: int
    incarnation: str | None = None


@attrs.frozen
class RecordReady(Returns["Phase"]):
    receipt: ReadyLocal


@attrs.frozen
class RecordFailure(Returns["Phase"]):
    token: AttemptToken
    engine: str
    reason: str


@attrs.frozen
class RecordUnknown(Returns["Phase"]):
    token: AttemptToken
    engine: str
    operation: str


@attrs.frozen
class RecordCleaned(Returns["Phase"]):
    token: AttemptToken
    engine: str
    incarnation: str


@attrs.frozen
class RetryCleanup(Returns["Phase"]):
    token: AttemptToken


@attrs.frozen
class Commit(Returns["CommitReceipt"]):
    key: VersionKey
    token: AttemptToken
    expected_default_revision: int


@attrs.frozen
class OpenSession(Returns["SessionState"]):
    """Record the session (and its membership of ``group``) before its first generation."""

    key: SessionKey
    now: float | None = None  # stamped by the registry (see :func:`stamped`)
    group: str | None = None

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


@attrs.frozen
class BindFirst(Returns["Binding"]):
    """Bind the current default (a group member: its group's version, bound by its first member)."""

    key: SessionKey
    now: float | None = None
    group: str | None = None

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


@attrs.frozen
class Rebind(Returns["Binding"]):
    """``on_stale="rebind"``: move a session (or its whole group) whose version is retiring to
    the current default, at a turn boundary; recorded in its ``rebinds``."""

    key: SessionKey
    now: float | None = None


@attrs.frozen
class RenewLeases(Returns["tuple[SessionKey, ...]"]):
    """Renew the leases of sessions a live worker still holds (one batch, not per request)."""

    keys: tuple[SessionKey, ...] = attrs.field(converter=_session_keys)
    now: float | None = None


@attrs.frozen
class ExpireSessions(Returns["tuple[SessionKey, ...]"]):
    """Expire these sessions now (their worker saw no generation for its idle TTL): EXPIRED
    tombstones, each ref released once. Answers the keys of those expired, sorted."""

    keys: tuple[SessionKey, ...] = attrs.field(converter=_session_keys)
    now: float | None = None


@attrs.frozen
class ExpireLeases(Returns["tuple[SessionKey, ...]"]):
    """Release the refs of sessions whose lease ran out (their worker stopped renewing), and
    forget the tombstones of sessions born before the tombstone window. Answers the keys of the
    sessions expired, sorted."""

    now: float | None = None


@attrs.frozen
class StartReprovision(Returns["AttemptToken | None"]):
    """Load ``key`` again on ``engine``, which restarted and lost it, from lorapub's frozen copy."""

    key: VersionKey
    engine: str


@attrs.frozen
class RecordLost(Returns["bool"]):
    """``engine`` lost ``key`` without a restart (its inventory lacks it)."""

    engine: str
    key: VersionKey


@attrs.frozen
class AbortStale(Returns["Phase"]):
    """Abort an active attempt whose publisher stopped making progress (it is cleaned after)."""

    token: AttemptToken
    reason: str


@attrs.frozen
class BeginClose(Returns["SessionState"]):
    key: SessionKey
    now: float | None = None


@attrs.frozen
class CloseAndRelease(Returns["SessionState"]):
    key: SessionKey
    now: float | None = None


@attrs.frozen
class ForgetSessions(Returns["int"]):
    keys: tuple[SessionKey, ...] = attrs.field(converter=_session_keys)


@attrs.frozen
class ClaimReclaim(Returns["str"]):
    key: VersionKey


@attrs.frozen
class RecordUnloaded(Returns["VersionState"]):
    key: VersionKey
    reclaim_id: str
    engine: str


@attrs.frozen
class RetryReclaim(Returns["VersionState"]):
    key: VersionKey



# queries: the reply only, the state never changes
@attrs.frozen
class AuthorizeDispatch(Returns["Binding"]):
    """The binding a new backend request must carry (refused once closing or reclaiming)."""

    key: SessionKey


@attrs.frozen
class QueryAttempt(Returns["AttemptStatus"]):
    token: AttemptToken


@attrs.frozen
class ReadVersion(Returns["Version"]):
    """One version's record (cheap over an actor boundary, unlike ``ReadState``)."""

    key: VersionKey


@attrs.frozen
class ListReclaimable(Returns["list[VersionKey]"]):
    pass


@attrs.frozen
class ReadState(Returns["RegistryState"]):
    pass


@attrs.frozen
class ReadFleet(Returns["Fleet"]):
    """Which engine holds which version, and what the reconciler has to do (small, cheap); with
    the registry's clock reading (``now``, stamped by the registry) for processes that time sessions."""

    now: float | None = None


@attrs.frozen
class ReadSessionsOf(Returns["SessionsOf"]):
    """The sessions and groups that hold a ref on ``version`` (at most ``limit`` of them, and
    how many in all): what keeps it from being reclaimed."""

    version: VersionKey
    limit: int = 8


Command = (
    RegisterEngine | Reserve | CancelWait | RecordPrepared | RecordBucketDone | RecordReady | RecordFailure
    | RecordUnknown | RecordCleaned | RetryCleanup | Commit | OpenSession | BindFirst | Rebind | BeginClose
    | CloseAndRelease | ForgetSessions | ClaimReclaim | RecordUnloaded | RetryReclaim | RenewLeases
    | ExpireSessions | ExpireLeases | StartReprovision | AbortStale | RecordLost | AddEngine | DrainEngine
    | RemoveEngine | MarkSuspect
    | AuthorizeDispatch | QueryAttempt | ReadVersion | ListReclaimable | ReadState | ReadFleet | ReadSessionsOf
)

#: The commands that only read.
QUERIES: tuple[type, ...] = (
    AuthorizeDispatch, QueryAttempt, ReadVersion, ListReclaimable, ReadState, ReadFleet, ReadSessionsOf,
)


#: The commands that take the registry's clock reading (a ``now`` field).
STAMPED = (
    Reserve, OpenSession, BindFirst, Rebind, BeginClose, CloseAndRelease, RenewLeases, ExpireSessions, ExpireLeases,
    ReadFleet,
)


def stamped(command: Command, now: float) -> Command:
    """The command with the registry's clock reading filled in where it takes one.

    The core reads no clock: the single writer stamps the time once, before the
    transition, so a logged command replays to the same state.
    """
    if isinstance(command, STAMPED) and command.now is None:
        return attrs.evolve(command, now=now)
    return command
