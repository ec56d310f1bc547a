"""The registry's decisions: versions, attempts, sessions and reclaim in one state.

The single writer of default, capacity, refs and tombstones: ``handle(state, command) -> Outcome`` gives
the new state, the reply and the effects the I/O layer must perform; a rejection raises a typed
:mod:`lorapub.errors` error and changes nothing. The command values live in :mod:`lorapub.core.commands`
(importable from here), each with one transition function below of the same name in snake case.
See docs/design.md, "Shape".
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

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
from lorapub.core.effects import Effect
from lorapub.errors import InvalidInput

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
    "retry_reclaim", "start_reprovision", "record_lost", "abort_stale", "read_fleet", "COMMANDS", "handle", "Result",
    "AbortStale", "AuthorizeDispatch", "BeginClose", "BindFirst", "CancelWait", "ClaimReclaim", "CloseAndRelease",
    "ExpireLeases", "ExpireSessions", "Command", "Commit", "ForgetSessions", "ListReclaimable", "OpenSession",
    "QUERIES", "QueryAttempt", "ReadFleet", "ReadSessionsOf", "ReadState", "ReadVersion", "Rebind",
    "RecordBucketDone", "RecordCleaned", "RecordFailure", "RecordLost", "RecordPrepared", "RecordReady",
    "RecordUnknown", "RecordUnloaded", "RegisterEngine", "RenewLeases", "Reserve", "RetryCleanup", "RetryReclaim",
    "StartReprovision", "Membership", "AddEngine", "DrainEngine", "RemoveEngine", "add_engine", "drain_engine",
    "remove_engine", "admit_joined",
]


# -- the one door ----------------------------------------------------------------
# Tables keyed by a command's type: each entry takes that type's fields (a transition) or the
# command itself (a query), which no one callable type says for every key.
TRANSITIONS: dict[type, Callable[..., Outcome]] = {
    RegisterEngine: register_engine, Reserve: reserve, CancelWait: cancel_wait, RecordPrepared: record_prepared,
    RecordBucketDone: record_bucket_done, RecordReady: record_ready, RecordFailure: record_failure,
    RecordUnknown: record_unknown, RecordCleaned: record_cleaned, RetryCleanup: retry_cleanup, Commit: commit,
    OpenSession: open_session, BindFirst: bind_first, Rebind: rebind, BeginClose: begin_close,
    CloseAndRelease: close_and_release,
    ForgetSessions: forget_sessions, ClaimReclaim: claim_reclaim, RecordUnloaded: record_unloaded,
    RetryReclaim: retry_reclaim, RenewLeases: renew_leases, ExpireSessions: expire_sessions,
    ExpireLeases: expire_leases,
    StartReprovision: start_reprovision, AbortStale: abort_stale, RecordLost: record_lost,
    AddEngine: add_engine, DrainEngine: drain_engine, RemoveEngine: remove_engine,
    MarkSuspect: mark_suspect,
}

QUERY_HANDLERS: dict[type, Callable[[RegistryState, Any], object]] = {
    AuthorizeDispatch: lambda state, c: authorize_dispatch(state, c.key),
    QueryAttempt: lambda state, c: query_attempt(state, c.token),
    ReadVersion: lambda state, c: state.version(c.key),
    ListReclaimable: lambda state, c: state.reclaimable(),
    ReadState: lambda state, c: state,
    ReadFleet: lambda state, c: read_fleet(state, c.now),
    ReadSessionsOf: lambda state, c: read_sessions_of(state, c.version, c.limit),
}

COMMANDS: tuple[type, ...] = (*TRANSITIONS, *QUERY_HANDLERS)


def handle(state: RegistryState, command: Command) -> Outcome:
    """The one door: apply ``command`` to ``state``. A query returns the state unchanged."""
    query = QUERY_HANDLERS.get(type(command))
    if query is not None:
        return Outcome(state, query(state, command))
    transition = TRANSITIONS.get(type(command))
    if transition is None:
        raise InvalidInput(f"{command!r} is not a registry command")
    outcome = transition(state, *(getattr(command, f.name) for f in attrs.fields(type(command))))
    if outcome.state.members:  # a joining member may hold every needed version now (docs/elastic.md)
        admitted = admit_joined(outcome.state)
        if admitted is not outcome.state:
            outcome = attrs.evolve(outcome, state=admitted)
    return outcome


R = TypeVar("R")


@attrs.frozen
class Result(Generic[R]):
    """What a registry answers, in process or across an actor boundary: the reply (of the type the
    command names, :class:`~lorapub.core.commands.Returns`) and the effects the caller must run, never
    the state."""

    reply: R
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=as_effects)
