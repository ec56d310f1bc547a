"""The registry's decisions: versions, attempts, sessions and reclaim in one state.

The single writer of default, capacity, refs and tombstones: ``handle(state, command) -> Outcome`` gives the
new state, the reply, the effects to run and the facts decided (:mod:`lorapub.core.facts`); a rejection raises
a typed error and changes nothing. Each command (:mod:`lorapub.core.commands`) has one handler of its name in
snake case, ``(state, command) -> Outcome``, in the door's tables (:mod:`lorapub.core.door`).
See docs/design.md, "Shape".
"""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from lorapub.core.commands import (  # noqa: F401 - the command values are part of this package's face
    AbortStale,
    AddEngine,
    DrainEngine,
    RemoveEngine,
    AuthorizeDispatch,
    BeginClose,
    BindFirst,
    CancelWait,
    ClaimReclaim,
    CloseAndRelease,
    ExpireLeases,
    ExpireSessions,
    Command,
    Commit,
    ForgetSessions,
    ListReclaimable,
    MarkSuspect,
    OpenSession,
    QUERIES,
    QueryAttempt,
    ReadFleet,
    ReadSessionsOf,
    ReadState,
    ReadVersion,
    Rebind,
    RecordBucketDone,
    RecordCleaned,
    RecordFailure,
    RecordLost,
    RecordPrepared,
    RecordReady,
    RecordUnknown,
    RecordUnloaded,
    RegisterEngine,
    RenewLeases,
    Reserve,
    RetryCleanup,
    RetryReclaim,
    StartReprovision,
)
from lorapub.core.door import Table, on
from lorapub.core.effects import Effect
from lorapub.core.facts import Fact, as_facts

from .state import (
    as_effects,
    AttemptStatus,
    DEFAULT_CAPACITY,
    DEFAULT_LEASE_TTL,
    DEFAULT_TOMBSTONE_WINDOW,
    Fleet,
    Membership,
    ON_STALE,
    Outcome,
    RegistryState,
    ReserveReply,
    SessionsOf,
    SlotHolder,
    Waiter,
    Waiting,
    check_capacity,
    check_max_lag,
    check_room_for_lag,
    new_registry,
)
from .publication import (
    cancel_wait,
    commit,
    mark_suspect,
    query_attempt,
    record_bucket_done,
    record_cleaned,
    record_failure,
    record_prepared,
    record_ready,
    record_unknown,
    register_engine,
    reserve,
    retry_cleanup,
)
from .sessions import (
    authorize_dispatch,
    begin_close,
    bind_first,
    close_and_release,
    expire_leases,
    expire_sessions,
    forget_sessions,
    open_session,
    read_sessions_of,
    rebind,
    renew_leases,
)
from .reclaims import (
    claim_reclaim,
    record_unloaded,
    retry_reclaim,
)
from .membership import (
    add_engine,
    admit_joined,
    drain_engine,
    remove_engine,
)
from .recovery import (
    abort_stale,
    read_fleet,
    record_lost,
    start_reprovision,
)

__all__ = [
    "DEFAULT_CAPACITY", "DEFAULT_LEASE_TTL", "DEFAULT_TOMBSTONE_WINDOW", "ON_STALE", "Waiter", "RegistryState",
    "Outcome", "ReserveReply", "SlotHolder", "Waiting", "SessionsOf", "Fleet", "AttemptStatus", "new_registry",
    "check_capacity", "check_max_lag", "check_room_for_lag", "register_engine", "reserve", "cancel_wait", "record_prepared", "record_bucket_done",
    "record_ready", "record_failure", "record_unknown", "record_cleaned", "retry_cleanup", "commit", "query_attempt",
    "open_session", "bind_first", "rebind", "begin_close", "close_and_release", "forget_sessions", "renew_leases",
    "expire_sessions", "expire_leases", "authorize_dispatch", "read_sessions_of", "claim_reclaim", "record_unloaded",
    "retry_reclaim", "start_reprovision", "record_lost", "abort_stale", "read_fleet", "read_version", "list_reclaimable", "read_state", "COMMANDS",
    "TRANSITIONS", "QUERY_HANDLERS", "handle", "Result",
    "AbortStale", "AuthorizeDispatch", "BeginClose", "BindFirst", "CancelWait", "ClaimReclaim", "CloseAndRelease",
    "ExpireLeases", "ExpireSessions", "Command", "Commit", "ForgetSessions", "ListReclaimable", "OpenSession",
    "QUERIES", "QueryAttempt", "ReadFleet", "ReadSessionsOf", "ReadState", "ReadVersion", "Rebind",
    "RecordBucketDone", "RecordCleaned", "RecordFailure", "RecordLost", "RecordPrepared", "RecordReady",
    "RecordUnknown", "RecordUnloaded", "RegisterEngine", "RenewLeases", "Reserve", "RetryCleanup", "RetryReclaim",
    "StartReprovision", "Membership", "AddEngine", "DrainEngine", "RemoveEngine", "add_engine", "drain_engine",
    "remove_engine", "admit_joined",
]


# -- the one door ----------------------------------------------------------------
def read_version(state: RegistryState, c: ReadVersion) -> Outcome:
    return Outcome(state, state.version(c.key))


def list_reclaimable(state: RegistryState, c: ListReclaimable) -> Outcome:
    return Outcome(state, state.reclaimable())


def read_state(state: RegistryState, c: ReadState) -> Outcome:
    return Outcome(state, state)


#: Each command type and its transition, ``(state, command: ThatCommand) -> Outcome`` (see :mod:`lorapub.core.door`).
TRANSITIONS: Table[RegistryState, Outcome] = Table(
    "registry",
    on(RegisterEngine, register_engine), on(Reserve, reserve), on(CancelWait, cancel_wait),
    on(RecordPrepared, record_prepared), on(RecordBucketDone, record_bucket_done), on(RecordReady, record_ready),
    on(RecordFailure, record_failure), on(RecordUnknown, record_unknown), on(RecordCleaned, record_cleaned),
    on(RetryCleanup, retry_cleanup), on(Commit, commit), on(OpenSession, open_session), on(BindFirst, bind_first),
    on(Rebind, rebind), on(BeginClose, begin_close), on(CloseAndRelease, close_and_release),
    on(ForgetSessions, forget_sessions), on(ClaimReclaim, claim_reclaim), on(RecordUnloaded, record_unloaded),
    on(RetryReclaim, retry_reclaim), on(RenewLeases, renew_leases), on(ExpireSessions, expire_sessions),
    on(ExpireLeases, expire_leases), on(StartReprovision, start_reprovision), on(AbortStale, abort_stale),
    on(RecordLost, record_lost), on(AddEngine, add_engine), on(DrainEngine, drain_engine),
    on(RemoveEngine, remove_engine), on(MarkSuspect, mark_suspect),
)

#: The queries: the same shape; each answers ``Outcome(state, reply)`` and never changes the state.
QUERY_HANDLERS: Table[RegistryState, Outcome] = Table(
    "registry query",
    on(AuthorizeDispatch, authorize_dispatch), on(QueryAttempt, query_attempt), on(ReadVersion, read_version),
    on(ListReclaimable, list_reclaimable), on(ReadState, read_state), on(ReadFleet, read_fleet),
    on(ReadSessionsOf, read_sessions_of),
)

COMMANDS: tuple[type, ...] = (*TRANSITIONS, *QUERY_HANDLERS)


def handle(state: RegistryState, command: Command) -> Outcome:
    """The one door: apply ``command`` to ``state`` through its table's handler (InvalidInput: not a
    registry command). A query returns the state unchanged."""
    if type(command) in QUERY_HANDLERS:
        return QUERY_HANDLERS(state, command)
    outcome = TRANSITIONS(state, command)
    if outcome.state.members:  # a joining member may hold every needed version now (docs/elastic.md)
        admitted = admit_joined(outcome.state)
        if admitted is not outcome.state:
            outcome = attrs.evolve(outcome, state=admitted)
    return outcome


R = TypeVar("R")


@attrs.frozen
class Result(Generic[R]):
    """What a registry answers, in process or across an actor boundary: the reply (of the type the
    command names, :class:`~lorapub.core.commands.Returns`), the effects the caller must run and the
    facts the decision established (:mod:`lorapub.core.facts`), never the state."""

    reply: R
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=as_effects)
    facts: tuple[Fact, ...] = attrs.field(default=(), converter=as_facts)
