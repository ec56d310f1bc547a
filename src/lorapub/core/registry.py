"""The registry's decisions: versions, attempts, sessions and reclaim in one state.

"The registry" is this one thing: the single writer of default, capacity, refs
and tombstones. Callers talk to it with command values (as h11 and h2 take
events): ``handle(state, command) -> Outcome`` gives the new state, the reply
for the caller and the effects the I/O layer must perform. Rejections raise a
typed :mod:`lorapub.errors` error and leave the state as it was.

The command values live in :mod:`lorapub.core.commands` (and are importable from
here); each has one transition function below of the same name in snake case.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Concatenate, Iterable, Mapping, ParamSpec, TypeVar

import attrs
from pyrsistent import PMap, pmap

from lorapub.core import _fields
from lorapub.core import attempt as att
from lorapub.core import group as grp
from lorapub.core import reclaim as rec
from lorapub.core import session as ses
from lorapub.core.attempt import Attempt, Phase, ReadyLocal, TargetState
from lorapub.core.commands import (  # noqa: F401 - the command values are part of this module's face
    AbortStale,
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
from lorapub.core.effects import Effect, Ignored, ReadyToCommit, ReclaimEligible
from lorapub.core.identity import (
    MANAGED_PREFIX,
    AttemptToken,
    SessionKey,
    VersionKey,
    check_digest,
    check_id,
    check_name_prefix,
    lora_name_for,
)
from lorapub.core.manifest import BucketPlan
from lorapub.core.group import GroupRecord, GroupState
from lorapub.core.session import Binding, SessionRecord, SessionState
from lorapub.core.session_table import SessionTable
from lorapub.core.version import (
    HELD_BY_ENGINES,
    SERVING,
    CommitReceipt,
    Version,
    VersionState,
    add_session_ref,
    advance,
    drop_session_ref,
)
from lorapub.errors import (
    BindingStale,
    SessionExpired,
    CapacityError,
    EpochMismatch,
    InvalidInput,
    NoPublishedVersion,
    NotReady,
    PublicationBlocked,
    PublicationSuperseded,
    SessionClosed,
    StaleAttempt,
    UnknownEngine,
    UnknownVersion,
    VersionConflict,
    VersionReclaiming,
)

__all__ = [
    "DEFAULT_CAPACITY", "DEFAULT_LEASE_TTL", "DEFAULT_TOMBSTONE_WINDOW", "ON_STALE", "Waiter", "RegistryState",
    "Outcome", "ReserveReply", "SlotHolder", "Waiting", "SessionsOf", "Fleet", "AttemptStatus", "new_registry",
    "check_max_lag", "register_engine", "reserve", "cancel_wait", "record_prepared", "record_bucket_done",
    "record_ready", "record_failure", "record_unknown", "record_cleaned", "retry_cleanup", "commit", "query_attempt",
    "open_session", "bind_first", "rebind", "begin_close", "close_and_release", "forget_sessions", "renew_leases",
    "expire_sessions", "expire_leases", "authorize_dispatch", "read_sessions_of", "claim_reclaim", "record_unloaded",
    "retry_reclaim", "start_reprovision", "record_lost", "abort_stale", "read_fleet", "COMMANDS", "handle", "Result",
    "AbortStale", "AuthorizeDispatch", "BeginClose", "BindFirst", "CancelWait", "ClaimReclaim", "CloseAndRelease",
    "ExpireLeases", "ExpireSessions", "Command", "Commit", "ForgetSessions", "ListReclaimable", "OpenSession",
    "QUERIES", "QueryAttempt", "ReadFleet", "ReadSessionsOf", "ReadState", "ReadVersion", "Rebind",
    "RecordBucketDone", "RecordCleaned", "RecordFailure", "RecordLost", "RecordPrepared", "RecordReady",
    "RecordUnknown", "RecordUnloaded", "RegisterEngine", "RenewLeases", "Reserve", "RetryCleanup", "RetryReclaim",
    "StartReprovision",
]

DEFAULT_CAPACITY = 2
#: Seconds a session's ref outlives the last renewal from its worker (None: no leases).
DEFAULT_LEASE_TTL = 120.0
#: Seconds a closed or expired session's tombstone is kept after the session began (None: for
#: the epoch). Messages for a session born before the window are refused without one.
DEFAULT_TOMBSTONE_WINDOW = 3600.0
#: What a session bound to a version more than ``max_lag`` commits behind the default gets at
#: its next generation: ``"error"`` (BINDING_STALE, the session generates no more) or
#: ``"rebind"`` (it moves to the default at that turn boundary, recorded in its provenance).
ON_STALE = ("error", "rebind")


@attrs.frozen
class Waiter:
    """The one publication waiting for a slot (the newest: a newer one supersedes it)."""

    key: VersionKey
    digest: str
    publisher: str
    since: float | None  # registry time it began waiting
    until: float | None  # registry time its caller stops waiting (dropped after that)

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate


_K = TypeVar("_K")
_V = TypeVar("_V")
_P = ParamSpec("_P")


def _frozen_map(value: Mapping[_K, _V]) -> PMap[_K, _V]:
    # attrs.evolve re-runs converters: an existing PMap must pass through, not be copied.
    return value if isinstance(value, PMap) else pmap(value)


# One converter a field (mypy's attrs plugin types the field's argument by its converter's).
def _engines(value: Mapping[str, str]) -> PMap[str, str]:
    return _frozen_map(value)


def _versions(value: Mapping[VersionKey, Version]) -> PMap[VersionKey, Version]:
    return _frozen_map(value)


def _attempts(value: Mapping[AttemptToken, Attempt]) -> PMap[AttemptToken, Attempt]:
    return _frozen_map(value)


def _reprovisions(value: Mapping[tuple[str, VersionKey], AttemptToken]) -> PMap[tuple[str, VersionKey], AttemptToken]:
    return _frozen_map(value)


def _groups(value: Mapping[str, GroupRecord]) -> PMap[str, GroupRecord]:
    return _frozen_map(value)


def _superseded(value: Mapping[VersionKey, VersionKey]) -> PMap[VersionKey, VersionKey]:
    return _frozen_map(value)


def _session_table(value: Mapping[SessionKey, SessionRecord]) -> SessionTable:
    # as _frozen_map: an existing table passes through; a mapping of records becomes one
    return value if isinstance(value, SessionTable) else SessionTable(value)


def _effects(effects: Iterable[Effect]) -> tuple[Effect, ...]:
    return tuple(effects)


@attrs.frozen
class RegistryState:
    epoch: int
    engines: PMap[str, str] = attrs.field(converter=_engines)  # engine -> current incarnation
    capacity: int = DEFAULT_CAPACITY
    versions: PMap[VersionKey, Version] = attrs.field(factory=pmap, converter=_versions)
    attempts: PMap[AttemptToken, Attempt] = attrs.field(factory=pmap, converter=_attempts)
    # SessionKey -> SessionRecord, held as atoms the garbage collector does not track, with
    # the lease and tombstone indexes ExpireLeases reads (see lorapub.core.session_table)
    sessions: SessionTable = attrs.field(factory=SessionTable, converter=_session_table)
    default: VersionKey | None = None
    default_revision: int = 0
    attempt_seq: int = 0
    reclaim_seq: int = 0
    lease_ttl: float | None = DEFAULT_LEASE_TTL
    # (engine, VersionKey) -> the re-provisioning attempt loading it there again
    reprovisions: PMap[tuple[str, VersionKey], AttemptToken] = attrs.field(factory=pmap, converter=_reprovisions)
    expired_sessions: int = 0
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW
    forgotten_sessions: int = 0
    # Bounded staleness: a version more than max_lag commits behind the default is retiring
    # (None: a session keeps its version for life, the RFC's rule).
    max_lag: int | None = None
    on_stale: str = "error"
    groups: PMap[str, GroupRecord] = attrs.field(factory=pmap, converter=_groups)  # group id -> GroupRecord
    waiter: Waiter | None = None
    # a version whose waiting publication a newer one superseded -> that newer version
    superseded: PMap[VersionKey, VersionKey] = attrs.field(factory=pmap, converter=_superseded)
    # how this deployment's versions are named on the engines (each engine protects one prefix)
    name_prefix: str = MANAGED_PREFIX

    __getstate__ = _fields.getstate
    __setstate__ = _fields.setstate

    # -- reads ---------------------------------------------------------------
    @property
    def slots_held(self) -> int:
        return sum(1 for v in self.versions.values() if v.holds_slot)

    def slot_holders(self) -> tuple["SlotHolder", ...]:
        return tuple(
            SlotHolder(k, v.state, v.session_refs, v.lag(self.default_revision), v.retiring,
                       tuple(sorted(v.reclaim_pending)))
            for k, v in sorted(self.versions.items()) if v.holds_slot
        )

    def unresolved_attempt(self) -> Attempt | None:
        # Versions hold at most `capacity` live attempts, so this scan is tiny.
        for v in self.versions.values():
            a = self.attempts[v.attempt]
            if not a.resolved:
                return a
        return None

    def version(self, key: VersionKey) -> Version:
        try:
            return self.versions[key]
        except KeyError:
            raise UnknownVersion(f"version {key} was never reserved in epoch {self.epoch}") from None

    def attempt(self, token: AttemptToken) -> Attempt:
        try:
            return self.attempts[token]
        except KeyError:
            raise StaleAttempt(f"attempt {token} was never issued by this registry") from None

    def reclaimable(self) -> list[VersionKey]:
        return sorted(k for k, v in self.versions.items() if v.reclaimable)

    def needed(self) -> list[Version]:
        """Versions sessions can still use: the default and RETIRED versions with refs (not retiring)."""
        return [
            v for k, v in sorted(self.versions.items())
            if v.state is VersionState.PUBLISHED
            or (v.state is VersionState.RETIRED and v.session_refs > 0 and not v.retiring)
        ]

    def missing(self) -> list[tuple[str, VersionKey]]:
        """(engine, version) pairs to re-provision: a needed version an engine lost in a restart."""
        return [
            (engine, v.key) for v in self.needed() for engine in sorted(self.engines)
            if engine not in v.engines and (engine, v.key) not in self.reprovisions
        ]


@attrs.frozen
class Outcome:
    state: RegistryState
    # what the command answers: its type depends on the command (see each transition and query)
    reply: Any = None
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=_effects)


@attrs.frozen
class ReserveReply:
    token: AttemptToken
    lora_name: str
    state: VersionState
    expected_default_revision: int
    created: bool


@attrs.frozen
class SlotHolder:
    """A version that holds one of the managed slots, and what keeps it."""

    version: VersionKey
    state: VersionState
    session_refs: int
    lag: int | None
    retiring: bool
    unloading_on: tuple[str, ...] = ()  # RECLAIMING: engines whose unload is not confirmed

    def describe(self) -> str:
        what = f"{self.version} {self.state.value}"
        if self.lag is not None and self.state is not VersionState.PUBLISHED:
            what += f" (lag {self.lag})"
        if self.state is VersionState.RETIRED and self.session_refs and not self.retiring:
            what += f": kept by {self.session_refs} session ref(s) until they close or expire"
        elif self.state is VersionState.RETIRED:
            what += ": being reclaimed"
        elif self.state is VersionState.RECLAIMING:
            what += f": waiting for requests still running on {', '.join(self.unloading_on) or 'its engines'}"
        elif self.state is VersionState.ABORTED:
            what += ": cleanup of its failed attempt not confirmed"
        return what


@attrs.frozen
class Waiting:
    """Reserve's reply to a call that waits: no slot yet (``holders`` keep them), or an
    unresolved ``attempt`` runs. Ask again; a newer publication supersedes this one."""

    key: VersionKey
    since: float | None
    holders: tuple[SlotHolder, ...]
    attempt: AttemptToken | None = None
    attempt_phase: str | None = None

    def describe(self) -> str:
        if self.attempt is not None:
            return f"attempt {self.attempt} is {self.attempt_phase}"
        return "every slot is held: " + "; ".join(h.describe() for h in self.holders)


@attrs.frozen
class SessionsOf:
    """What :class:`ReadSessionsOf` answers: who holds refs on a version."""

    version: VersionKey
    sessions: int  # solo sessions holding a ref
    groups: int  # groups holding a ref
    session_ids: tuple[tuple[str, str, float | None], ...]  # (session id, state, lease_until), at most limit
    group_ids: tuple[tuple[str, int], ...]  # (group id, open members), at most limit


@attrs.frozen
class Fleet:
    """What the reconciler and the session router need, without the sessions (cheap to ship).

    ``holders`` maps each version sessions may still use to the engines that hold it now.
    """

    epoch: int
    engines: Mapping[str, str]
    default: VersionKey | None
    holders: Mapping[VersionKey, frozenset[str]]
    missing: tuple[tuple[str, VersionKey], ...]
    reclaimable: tuple[VersionKey, ...]
    reclaiming: tuple[VersionKey, ...]
    cleaning: tuple[AttemptToken, ...]  # aborted attempts whose cleanup is not confirmed
    active: Mapping[AttemptToken, att.Progress]  # live attempts -> their progress value
    expired_sessions: int
    lease_ttl: float | None
    default_revision: int = 0
    retiring: frozenset[VersionKey] = frozenset()
    max_lag: int | None = None
    on_stale: str = "error"
    capacity: int = DEFAULT_CAPACITY
    slots: tuple[SlotHolder, ...] = ()
    waiting: Waiter | None = None
    now: float | None = None  # the registry's clock when it answered
    name_prefix: str = MANAGED_PREFIX
    lora_names: Mapping[VersionKey, str] = attrs.field(factory=dict)  # every version engines may still hold

    @property
    def routable(self) -> frozenset[str]:
        """Engines that hold every version sessions may still use."""
        if not self.holders:
            return frozenset(self.engines)
        return frozenset.intersection(*self.holders.values())


@attrs.frozen
class AttemptStatus:
    token: AttemptToken
    phase: Phase
    version_state: VersionState
    commit: CommitReceipt | None
    targets: tuple[tuple[str, str], ...]  # (engine, target state)
    publisher: str = ""  # who started it (its own replay may take it over)


def new_registry(
    epoch: int,
    engines: Mapping[str, str],
    capacity: int = DEFAULT_CAPACITY,
    lease_ttl: float | None = DEFAULT_LEASE_TTL,
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW,
    max_lag: int | None = None,
    on_stale: str = "error",
    name_prefix: str = MANAGED_PREFIX,
) -> RegistryState:
    if not engines:
        raise InvalidInput("a registry needs at least one target engine")
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise InvalidInput(f"capacity must be an int >= 1, got {capacity!r}")
    if lease_ttl is not None and (not isinstance(lease_ttl, (int, float)) or not lease_ttl > 0):
        raise InvalidInput(f"lease_ttl must be a positive number of seconds or None, got {lease_ttl!r}")
    if tombstone_window is not None and (not isinstance(tombstone_window, (int, float)) or not tombstone_window > 0):
        raise InvalidInput(f"tombstone_window must be a positive number of seconds or None, got {tombstone_window!r}")
    if lease_ttl is not None and tombstone_window is not None and tombstone_window < 2 * lease_ttl:
        raise InvalidInput(f"tombstone_window ({tombstone_window:g}s) must be at least twice lease_ttl ({lease_ttl:g}s)")
    check_max_lag(max_lag, on_stale)
    check_name_prefix(name_prefix)
    return RegistryState(
        epoch=epoch, engines=dict(engines), capacity=capacity, lease_ttl=lease_ttl, tombstone_window=tombstone_window,
        max_lag=max_lag, on_stale=on_stale, name_prefix=name_prefix,
    )


def check_max_lag(max_lag: object, on_stale: object) -> None:
    if max_lag is not None and (not isinstance(max_lag, int) or isinstance(max_lag, bool) or max_lag < 0):
        raise InvalidInput(f"max_lag must be an int >= 0 (commits behind the default) or None, got {max_lag!r}")
    if on_stale not in ON_STALE:
        raise InvalidInput(f"on_stale must be one of {', '.join(map(repr, ON_STALE))}, got {on_stale!r}")


def _check_epoch(state: RegistryState, epoch: int, what: object) -> None:
    if epoch != state.epoch:
        raise EpochMismatch(f"{what} belongs to epoch {epoch}; this registry serves epoch {state.epoch}")


# -- engines -----------------------------------------------------------------
def register_engine(state: RegistryState, engine: str, incarnation: str) -> Outcome:
    """Add an engine, or record that it restarted: attempts bound to its old life abort."""
    old = state.engines.get(engine)
    if old == incarnation:
        return Outcome(state)
    state = attrs.evolve(state, engines=state.engines.set(engine, incarnation))
    if old is None:
        return Outcome(state)
    # The new life holds no adapter: it leaves every version's holders (re-provisioned later
    # where sessions still need it), and a reclaim has nothing left to unload there.
    versions = state.versions
    for key, v in state.versions.items():
        if v.state in SERVING and engine in v.engines:
            versions = versions.set(key, attrs.evolve(v, engines=tuple(e for e in v.engines if e != engine)))
        elif v.state is VersionState.RECLAIMING and engine in v.reclaim_pending:
            versions = versions.set(key, rec.confirm(v, v.reclaim_id or "", engine)[0])
    state = attrs.evolve(state, versions=versions)
    effects: list[Effect] = []
    for token, a in list(state.attempts.items()):
        if a.resolved or a.target(engine) is None:
            continue
        new, fx = att.on_engine_restarted(a, engine, incarnation)
        state = _put_attempt(state, new)
        effects += fx
    return Outcome(state, None, effects)


# -- publication ---------------------------------------------------------------
def _blocked_advice(blocker: Attempt) -> str:
    if blocker.phase is Phase.ABORTED:
        waiting = [t.engine for t in blocker.targets if t.state is not TargetState.CLEANED]
        return (
            f"attempt {blocker.token} failed and its cleanup is not confirmed on {', '.join(waiting)}; "
            "lorapub retries the cleanup in the background — publish again once it is confirmed "
            "(`await deployment.reconcile()` retries it now)"
        )
    return (
        f"attempt {blocker.token} is {blocker.phase.value}; publish again once it finishes — if its "
        "publisher died, the reconciler aborts and cleans it when it stops making progress "
        "(`deployment.recover()` does so now, for a publisher known to be dead)"
    )


def _capacity_advice(state: RegistryState) -> str:
    return (
        f"{state.capacity} managed version slots are held: "
        + "; ".join(h.describe() for h in state.slot_holders())
        + ". publish(..., wait=seconds) waits for a slot (a newer publication supersedes a waiting one); "
        "Deployment(max_lag=k) bounds how long sessions keep old versions; Deployment(capacity=N) holds more"
    )


def reserve(
    state: RegistryState, key: VersionKey, digest: str, plan: BucketPlan, publisher: str = "",
    wait: float | None = None, now: float | None = None,
) -> Outcome:
    """Take a logical slot for ``key`` and start its attempt (begin on every engine).

    Same key and digest again sends nothing and joins the existing attempt, except that the
    same ``publisher``'s replay of a reserve whose reply was lost resumes it, and a version
    whose attempt failed clean starts a fresh attempt. With ``wait``, a call that finds no
    slot (or another attempt running) becomes the waiting publication and is answered
    :class:`Waiting`; the newest call always wins: it supersedes the waiting one.
    """
    _check_epoch(state, key.deployment_epoch, f"version {key}")
    check_digest(digest)
    by = state.superseded.get(key)
    if by is not None:
        raise PublicationSuperseded(
            f"version {key} was superseded by {by} while it waited for a slot; it is never committed — "
            "publish the newest snapshot under a new version id", version=key, by=by,
        )
    existing = state.versions.get(key)
    if existing is not None:
        if existing.digest != digest:
            raise VersionConflict(
                f"version {key} already has digest {existing.digest[:12]}…, not {digest[:12]}…",
                version=key,
            )
        if existing.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            rev = existing.commit.default_revision if existing.commit else "?"
            raise VersionReclaiming(
                f"version {key} was published (default revision {rev}) and is {existing.state.value} now; a "
                "version id is published once per epoch — publish the snapshot under a new version id",
                version=key,
            )
        a = state.attempts[existing.attempt]
        if existing.state is not VersionState.FAILED_CLEAN:
            if (
                publisher and a.publisher == publisher and a.phase is Phase.BEGINNING
                and all(t.state is TargetState.BEGIN_SENT for t in a.targets)
            ):
                # Our own reserve whose reply was lost: resume it (begin is idempotent).
                return Outcome(
                    state,
                    ReserveReply(existing.attempt, existing.lora_name, existing.state, a.expected_default_revision, True),
                    att.resend_begins(a),
                )
            # Committed, or running (or cleaning) elsewhere: the caller joins it.
            return Outcome(
                state,
                ReserveReply(existing.attempt, existing.lora_name, existing.state, a.expected_default_revision, False),
            )
        # FAILED_CLEAN: nothing of the failed attempt survives on any engine; start afresh.
    if plan.digest != digest:
        raise InvalidInput(f"bucket plan was made for digest {plan.digest[:12]}…, not {digest[:12]}…")
    if wait is not None and (not isinstance(wait, (int, float)) or isinstance(wait, bool) or not wait >= 0):
        raise InvalidInput(f"wait must be a number of seconds >= 0, got {wait!r}")
    blocker = state.unresolved_attempt()
    full = state.slots_held >= state.capacity
    if blocker is not None or full:
        if wait:
            return _wait(state, key, digest, publisher, wait, now, blocker)
        if blocker is not None:
            raise PublicationBlocked(_blocked_advice(blocker), attempt=blocker.token)
        raise CapacityError(_capacity_advice(state), held=[h.describe() for h in state.slot_holders()])
    # A slot is free: this call takes it. A different publication still waiting is older: superseded.
    state = _supersede_waiter(state, key)
    token = AttemptToken(key, state.attempt_seq + 1)
    name = lora_name_for(key, digest, state.name_prefix)
    attempt, effects = att.start(token, name, digest, plan, state.engines, state.default_revision, publisher=publisher)
    if existing is not None:
        version = advance(existing, VersionState.LOADING, attempt=token)
    else:
        version = Version(key=key, digest=digest, lora_name=name, state=VersionState.LOADING, attempt=token)
    state = attrs.evolve(
        state,
        attempt_seq=token.seq,
        versions=state.versions.set(key, version),
        attempts=state.attempts.set(token, attempt),
    )
    return Outcome(state, ReserveReply(token, name, VersionState.LOADING, state.default_revision, True), effects)


def _supersede_waiter(state: RegistryState, key: VersionKey) -> RegistryState:
    """``key`` is newer than the waiting publication (if another): that one is superseded."""
    waiter = state.waiter
    if waiter is None:
        return state
    superseded = state.superseded if waiter.key == key else state.superseded.set(waiter.key, key)
    return attrs.evolve(state, waiter=None, superseded=superseded)


def _wait(
    state: RegistryState, key: VersionKey, digest: str, publisher: str, wait: float, now: float | None,
    blocker: Attempt | None,
) -> Outcome:
    old = state.waiter
    since = old.since if old is not None and old.key == key else now
    state = _supersede_waiter(state, key)
    until = None if now is None else now + wait
    state = attrs.evolve(state, waiter=Waiter(key, digest, publisher, since, until))
    reply = Waiting(
        key, since, state.slot_holders(),
        blocker.token if blocker is not None else None, blocker.phase.value if blocker is not None else None,
    )
    return Outcome(state, reply)


def cancel_wait(state: RegistryState, key: VersionKey) -> Outcome:
    """The caller of the waiting publication ``key`` stopped waiting."""
    if state.waiter is None or state.waiter.key != key:
        return Outcome(state, False)
    return Outcome(attrs.evolve(state, waiter=None), True)


def _put_attempt(state: RegistryState, new: Attempt) -> RegistryState:
    """Store an attempt and carry an abort or a confirmed cleanup over to its version."""
    state = attrs.evolve(state, attempts=state.attempts.set(new.token, new))
    version = state.versions[new.token.version]
    if version.attempt != new.token:
        return state
    if new.phase is Phase.ABORTED and version.state is VersionState.LOADING:
        version = advance(version, VersionState.ABORTED)
    elif new.phase is Phase.CLEAN and version.state is VersionState.ABORTED:
        version = advance(version, VersionState.FAILED_CLEAN)
    else:
        return state
    return attrs.evolve(state, versions=state.versions.set(version.key, version))


def _step_attempt(
    state: RegistryState, token: AttemptToken, fn: Callable[Concatenate[Attempt, _P], att.Step],
    *args: _P.args, **kwargs: _P.kwargs,
) -> Outcome:
    a = state.attempts.get(token)
    if a is None:
        return Outcome(state, None, [Ignored(f"attempt {token} is unknown here")])
    new, effects = fn(a, *args, **kwargs)
    if new.reprovision:
        return _step_reprovision(state, new, effects)
    state = _put_attempt(state, new)
    if new.phase is Phase.READY and a.phase is not Phase.READY:
        effects = [*effects, ReadyToCommit(token, new.expected_default_revision)]
    return Outcome(state, new.phase, effects)


def _step_reprovision(state: RegistryState, new: Attempt, effects: list[Effect]) -> Outcome:
    """A re-provisioning attempt never commits: READY adds its engine to the version's holders."""
    (target,) = new.targets
    version = state.versions[new.token.version]
    index = (target.engine, version.key)
    if new.phase is Phase.READY:
        if version.state in SERVING and not version.retiring and att.all_ready_current(new, state.engines):
            new = att.mark_committed(new)
            version = attrs.evolve(version, engines=tuple(sorted({*version.engines, target.engine})))
            state = attrs.evolve(state, versions=state.versions.set(version.key, version))
        else:  # reclaim began meanwhile: unload what was just loaded
            new, more = att.abort(new, f"{version.key} is {version.state.value}; re-provisioning not needed")
            effects = [*effects, *more]
    state = attrs.evolve(state, attempts=state.attempts.set(new.token, new))
    if new.resolved and state.reprovisions.get(index) == new.token:
        state = attrs.evolve(state, reprovisions=state.reprovisions.remove(index))
    return Outcome(state, new.phase, effects)


def record_prepared(state: RegistryState, token: AttemptToken, engine: str, incarnation: str) -> Outcome:
    return _step_attempt(state, token, att.on_prepared, engine, incarnation)


def record_bucket_done(
    state: RegistryState, token: AttemptToken, party: str, index: int, incarnation: str | None = None
) -> Outcome:
    return _step_attempt(state, token, att.on_bucket_done, party, index, incarnation)


def record_ready(state: RegistryState, receipt: ReadyLocal) -> Outcome:
    return _step_attempt(state, receipt.token, att.on_ready, receipt)


def record_failure(state: RegistryState, token: AttemptToken, engine: str, reason: str) -> Outcome:
    """A definite failure of one target (or of the source): the attempt aborts."""
    return _step_attempt(state, token, att.abort, f"{engine}: {reason}")


def record_unknown(state: RegistryState, token: AttemptToken, engine: str, operation: str) -> Outcome:
    """No answer from ``engine`` for ``operation``: an active attempt aborts (it can never
    commit), an unanswered cleanup keeps its slot and blocks publication."""
    a = state.attempts.get(token)
    if a is not None and a.phase is Phase.ABORTED:
        return _step_attempt(state, token, att.on_cleanup_unknown, engine)
    return _step_attempt(state, token, att.abort, f"{engine}: outcome of {operation} unknown")


def record_cleaned(state: RegistryState, token: AttemptToken, engine: str, incarnation: str) -> Outcome:
    return _step_attempt(state, token, att.on_cleaned, engine, incarnation)


def retry_cleanup(state: RegistryState, token: AttemptToken) -> Outcome:
    return _step_attempt(state, token, att.retry_cleanup)


def commit(state: RegistryState, key: VersionKey, token: AttemptToken, expected_default_revision: int) -> Outcome:
    """Make ``key`` the default. A replay of a commit that happened returns its receipt."""
    version = state.version(key)
    a = state.attempt(token)
    if token.version != key:
        raise StaleAttempt(f"attempt {token} does not belong to version {key}")
    if a.phase is Phase.COMMITTED:  # a replay says again what the commit said
        assert version.commit is not None
        return Outcome(state, version.commit, _reclaim_eligible(state, version.commit.retired))
    if version.attempt != token or version.state is not VersionState.LOADING:
        raise StaleAttempt(f"attempt {token} is not the live attempt of {key} ({version.state.value})")
    if not att.all_ready_current(a, state.engines):
        waiting = [f"{t.engine}={t.state.value}" for t in a.targets]
        raise NotReady(f"attempt {token} is {a.phase.value}: {', '.join(waiting)}", targets=waiting)
    if expected_default_revision != state.default_revision:
        raise VersionConflict(
            f"default revision is {state.default_revision}, commit expected {expected_default_revision}",
            version=key,
        )
    versions = state.versions
    retired = state.default
    if retired is not None:
        versions = versions.set(retired, advance(versions[retired], VersionState.RETIRED))
    receipt = CommitReceipt(key, token, state.default_revision + 1, retired)
    versions = versions.set(key, advance(version, VersionState.PUBLISHED, engines=a.engines, commit=receipt))
    state = attrs.evolve(
        state,
        versions=versions,
        attempts=state.attempts.set(token, att.mark_committed(a)),
        default=key,
        default_revision=receipt.default_revision,
    )
    state, retiring = _retire_beyond_lag(state)
    eligible = sorted({*([retired] if retired is not None else []), *retiring})
    return Outcome(state, receipt, [fx for k in eligible for fx in _reclaim_eligible(state, k)])


def _retire_beyond_lag(state: RegistryState) -> tuple[RegistryState, list[VersionKey]]:
    """Mark RETIRED versions more than ``max_lag`` commits behind the default as retiring: the
    refs of their sessions no longer keep them (O(versions): sessions learn it when they next
    generate, from the version itself)."""
    if state.max_lag is None:
        return state, []
    versions, newly = state.versions, []
    for k, v in state.versions.items():
        lag = v.lag(state.default_revision)
        if v.state is VersionState.RETIRED and not v.retiring and lag is not None and lag > state.max_lag:
            versions = versions.set(k, attrs.evolve(v, retiring=True))
            newly.append(k)
    return attrs.evolve(state, versions=versions), sorted(newly)


def _reclaim_eligible(state: RegistryState, key: VersionKey | None) -> list[Effect]:
    """The one place ``ReclaimEligible`` is decided: RETIRED and kept by no session."""
    if key is None:
        return []
    if state.versions[key].reclaimable:
        return [ReclaimEligible(key)]
    return []


def query_attempt(state: RegistryState, token: AttemptToken) -> AttemptStatus:
    a = state.attempt(token)
    v = state.versions[token.version]
    return AttemptStatus(
        token, a.phase, v.state, v.commit if a.phase is Phase.COMMITTED else None,
        tuple((t.engine, t.state.value) for t in a.targets), a.publisher,
    )


# -- sessions ------------------------------------------------------------------
def _session(state: RegistryState, key: SessionKey) -> SessionRecord | None:
    _check_epoch(state, key.deployment_epoch, f"session {key}")
    return state.sessions.get(key)


def _beyond_window(state: RegistryState, key: SessionKey, now: float | None) -> bool:
    """Born before the tombstone window: a tombstone of it may have been forgotten."""
    born = key.born
    return born is not None and now is not None and state.tombstone_window is not None and (
        born < now - state.tombstone_window
    )


def _refuse_beyond_window(
    state: RegistryState, key: SessionKey, record: SessionRecord | None, now: float | None, what: str
) -> None:
    if record is None and _beyond_window(state, key, now):
        raise SessionExpired(
            f"session {key} began more than {state.tombstone_window:g}s ago and is not live here "
            f"(its tombstone may have been forgotten); {what} refused — start a new session", session=key,
        )


def _version_of(record: SessionRecord | GroupRecord) -> VersionKey:
    """The version a bound session or group is bound to (every bound one has one)."""
    assert record.version is not None
    return record.version


def _binding(state: RegistryState, record: SessionRecord) -> Binding:
    v = state.versions[_version_of(record)]
    revision = v.commit.default_revision if v.commit is not None else 0
    return Binding(record.key, v.key, v.lora_name, v.digest, revision, record.group, record.rebinds)


def _lease_until(state: RegistryState, now: float | None) -> float | None:
    return None if now is None or state.lease_ttl is None else now + state.lease_ttl


def _stale_reason(state: RegistryState, record: SessionRecord) -> str | None:
    """Why a BOUND session may not dispatch on its binding any more (None: it may)."""
    if record.group is not None:
        group = state.groups[record.group]
        if group.version != record.version:
            return f"its group {record.group!r} was rebound to {group.version}"
    version = state.versions[_version_of(record)]
    if version.retiring:
        lag = version.lag(state.default_revision)
        return f"its version {version.key} is {lag} commits behind the default (max_lag {state.max_lag})"
    return None


def _refuse_if_stale(state: RegistryState, record: SessionRecord) -> None:
    why = _stale_reason(state, record)
    if why is not None:
        hint = (" — it rebinds to the default at its next generation" if state.on_stale == "rebind"
                else "; its ref was released and it generates no more — start a new session")
        raise BindingStale(f"session {record.key}: {why}{hint}", session=record.key, version=record.version)


def _join_group(state: RegistryState, found: SessionRecord | None, key: SessionKey, group: str | None) -> tuple[RegistryState, str | None]:
    """A new record joins ``group`` (one more open member); an existing one keeps its own."""
    if found is not None:
        if group is not None and found.group != group:
            raise InvalidInput(f"session {key} is not a member of group {group!r} (it is in {found.group!r})")
        return state, found.group
    if group is None:
        return state, None
    check_id("group", group)
    return attrs.evolve(state, groups=state.groups.set(group, grp.joined(state.groups.get(group), group))), group


def open_session(state: RegistryState, key: SessionKey, now: float | None = None, group: str | None = None) -> Outcome:
    found = _session(state, key)
    _refuse_beyond_window(state, key, found, now, "open")
    record = ses.opened(found, key)
    state, gid = _join_group(state, found, key, group)
    record = ses.leased(attrs.evolve(record, group=gid), _lease_until(state, now))
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def _add_ref(state: RegistryState, key: VersionKey) -> RegistryState:
    return attrs.evolve(state, versions=state.versions.set(key, add_session_ref(state.versions[key])))


def _drop_ref(state: RegistryState, key: VersionKey | None) -> RegistryState:
    if key is None:
        return state
    return attrs.evolve(state, versions=state.versions.set(key, drop_session_ref(state.versions[key])))


def bind_first(state: RegistryState, key: SessionKey, now: float | None = None, group: str | None = None) -> Outcome:
    """Bind to the current default on first generation (the lease starts); later calls return
    the same binding and change nothing (leases are renewed in batches, by ``RenewLeases``).

    A group member binds its group's version: the group's first generation binds the group
    (one ref, held by the group), every later member the same version."""
    record = _session(state, key)
    _refuse_beyond_window(state, key, record, now, "bind")
    if record is not None and record.state is SessionState.BOUND:
        if group is not None and record.group != group:
            raise InvalidInput(f"session {key} is not a member of group {group!r} (it is in {record.group!r})")
        _refuse_if_stale(state, record)
        return Outcome(state, _binding(state, record))  # a replay: same answer, nothing changes
    if record is not None and record.state in ses.ENDING:
        ses.opened(record, key)  # raises the typed refusal (closed or expired)
    default = state.default
    if default is None:
        raise NoPublishedVersion(f"no version is published yet in epoch {state.epoch}")
    state, gid = _join_group(state, record, key, group)
    if gid is None:
        version, holds = default, True
        state = _add_ref(state, version)
    else:
        g = state.groups[gid]
        if g.state is GroupState.OPEN:
            g = grp.bound(g, default)
            state = _add_ref(state, default)
        elif state.versions[_version_of(g)].retiring:
            if state.on_stale != "rebind":
                lag = state.versions[_version_of(g)].lag(state.default_revision)
                raise BindingStale(
                    f"session {key}: its group {gid!r} is bound to {g.version}, {lag} commits behind the default "
                    f"(max_lag {state.max_lag}); a stale group retires together — start a new group",
                    session=key, version=g.version,
                )
            g, release = grp.rebound(g, default)
            state = _add_ref(_drop_ref(state, release), default)
        state = attrs.evolve(state, groups=state.groups.set(gid, g))
        version, holds = _version_of(g), False
    record = ses.leased(ses.bound(record, key, version, holds_ref=holds, group=gid), _lease_until(state, now))
    state = attrs.evolve(state, sessions=state.sessions.set(key, record))
    return Outcome(state, _binding(state, record))


def rebind(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    """``on_stale="rebind"``: a session (its whole group, for a member) whose version is retiring
    moves to the current default; a member adopts its group's newer version. Anything else
    returns the binding unchanged."""
    record = ses.require_dispatchable(_session(state, key), key)
    if state.on_stale != "rebind":
        _refuse_if_stale(state, record)
        return Outcome(state, _binding(state, record))
    default = state.default
    assert default is not None  # a bound session's version was the default once, and there is always one since
    if record.group is not None:
        g = state.groups[record.group]
        if state.versions[_version_of(g)].retiring and g.version != default:
            g, release = grp.rebound(g, default)
            state = _add_ref(_drop_ref(state, release), default)
            state = attrs.evolve(state, groups=state.groups.set(record.group, g))
        if record.version != g.version:
            record = attrs.evolve(record, version=g.version, rebinds=record.rebinds + 1)
    elif state.versions[_version_of(record)].retiring and record.version != default:
        state = _add_ref(_drop_ref(state, record.version if record.holds_ref else None), default)
        record = attrs.evolve(record, version=default, holds_ref=True, rebinds=record.rebinds + 1)
    state = attrs.evolve(state, sessions=state.sessions.set(key, ses.leased(record, _lease_until(state, now))))
    return Outcome(state, _binding(state, record))


def begin_close(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    found = _session(state, key)
    if found is None and _beyond_window(state, key, now):
        return Outcome(state, SessionState.CLOSED)  # long over: nothing to record
    record = ses.closing(found, key)
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def _ended(
    state: RegistryState, old: SessionRecord | None, release: VersionKey | None, now: float | None
) -> tuple[RegistryState, list[VersionKey]]:
    """A session became a tombstone: drop its own ref (``release``), or leave its group (the last
    member to leave drops the group's). Returns the versions whose ref was dropped."""
    dropped = []
    if release is not None:
        state = _drop_ref(state, release)
        dropped.append(release)
    if old is not None and old.group is not None and old.state not in ses.TOMBSTONES:
        g, group_release = grp.left(state.groups[old.group], now)
        state = attrs.evolve(state, groups=state.groups.set(old.group, g))
        if group_release is not None:
            state = _drop_ref(state, group_release)
            dropped.append(group_release)
    return state, dropped


def close_and_release(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    """Release the session ref exactly once and keep a CLOSED tombstone (for the window)."""
    found = _session(state, key)
    if found is None and _beyond_window(state, key, now):
        return Outcome(state, SessionState.CLOSED)
    record, release = ses.closed(found, key)
    state = attrs.evolve(state, sessions=state.sessions.set(key, record))
    state, dropped = _ended(state, found, release, now)
    return Outcome(state, record.state, [fx for k in dropped for fx in _reclaim_eligible(state, k)])


def forget_sessions(state: RegistryState, keys: Iterable[SessionKey]) -> Outcome:
    """Drop CLOSED tombstones the caller knows can get no late message any more."""
    drop: dict[SessionKey, None] = {}
    for key in keys:
        record = state.sessions.get(key)
        if record is not None and record.state is SessionState.CLOSED:
            drop[key] = None
    return Outcome(attrs.evolve(state, sessions=state.sessions.remove_many(drop)), len(drop))


def renew_leases(state: RegistryState, keys: Iterable[SessionKey], now: float | None = None) -> Outcome:
    """Renew the leases of live sessions; the reply names the sessions that are gone
    (expired or unknown here), so their worker refuses them locally too."""
    lease = _lease_until(state, now)
    renewed = []
    gone = []
    for key in keys:
        _check_epoch(state, key.deployment_epoch, f"session {key}")
        record = state.sessions.get(key)
        if record is None or record.state is SessionState.EXPIRED:
            gone.append(key)
            continue
        new = ses.leased(record, lease)
        if new is not record:
            renewed.append((key, new))
    return Outcome(attrs.evolve(state, sessions=state.sessions.update(renewed)), tuple(gone))


def expire_sessions(state: RegistryState, keys: Iterable[SessionKey], now: float | None = None) -> Outcome:
    """Expire these sessions now (their worker saw them idle): the live ones become EXPIRED."""
    due = []
    for key in keys:
        record = _session(state, key)
        if record is not None and record.state in ses.LEASED:
            due.append(key)
    return _expire(state, due, [], now)


def expire_leases(state: RegistryState, now: float | None = None) -> Outcome:
    """Sessions whose worker stopped renewing: EXPIRED tombstone, ref released once; and the
    tombstones of sessions born before the window are forgotten (closed groups too, a window
    after they closed), and a waiting publication whose caller stopped waiting is dropped.

    The session table indexes leases by deadline and tombstones by birth, so a pass reads
    only the sessions that are due: O(due · log n), not a scan of every session."""
    if now is None:
        return Outcome(state, 0)
    state = _forget_old(state, now)
    if not math.isfinite(now):  # the indexes are ordered by finite times: read every record
        return _expire_by_scan(state, now)
    sessions = state.sessions
    forget = [] if state.tombstone_window is None else sessions.tombstones_born_before(now - state.tombstone_window)
    return _expire(state, sessions.leases_due(now), forget, now)


def _forget_old(state: RegistryState, now: float) -> RegistryState:
    waiter = state.waiter
    if waiter is not None and waiter.until is not None and not waiter.until >= now:
        state = attrs.evolve(state, waiter=None)
    if state.tombstone_window is not None and state.groups:
        cutoff = now - state.tombstone_window
        old = [g for g, r in state.groups.items()
               if r.state is GroupState.CLOSED and r.closed_at is not None and r.closed_at < cutoff]
        if old:
            groups = state.groups
            for g in old:
                groups = groups.remove(g)
            state = attrs.evolve(state, groups=groups)
    return state


def _expire_by_scan(state: RegistryState, now: float) -> Outcome:
    """``expire_leases`` choosing from every record what the indexes choose (a clock reading that
    is not a finite number)."""
    due, forget = [], []
    for key, record in state.sessions.items():
        if record.state in ses.TOMBSTONES:
            if _beyond_window(state, key, now):
                forget.append(key)
        elif record.lease_until is not None and not record.lease_until >= now and record.state in ses.LEASED:
            due.append(key)  # "not >=": a NaN deadline is due at once
    return _expire(state, due, forget, now)


def _expire(state: RegistryState, due: list[SessionKey], forget: list[SessionKey], now: float | None = None) -> Outcome:
    """Expire the sessions ``due`` (each releases its ref once) and forget the tombstones ``forget``."""
    if not due and not forget:
        return Outcome(state, 0)
    released: set[VersionKey] = set()
    expired = []
    for key in due:
        old = state.sessions[key]
        record, release = ses.expired(old)
        expired.append((key, record))
        state, dropped = _ended(state, old, release, now)
        released.update(dropped)
    # the tombstones first: a session that expires in this pass is not forgotten in it
    state = attrs.evolve(
        state, sessions=state.sessions.remove_many(forget).update(expired),
        expired_sessions=state.expired_sessions + len(expired), forgotten_sessions=state.forgotten_sessions + len(forget),
    )
    return Outcome(state, len(expired), [fx for key in sorted(released) for fx in _reclaim_eligible(state, key)])


def authorize_dispatch(state: RegistryState, key: SessionKey) -> Binding:
    """The binding a new backend request must carry; refused once closing, stale or reclaiming."""
    record = ses.require_dispatchable(_session(state, key), key)
    _refuse_if_stale(state, record)
    binding = _binding(state, record)
    version = state.versions[binding.version]
    if not version.dispatchable:
        raise VersionReclaiming(f"version {version.key} is {version.state.value}; dispatch refused")
    return binding


def read_sessions_of(state: RegistryState, key: VersionKey, limit: int = 8) -> "SessionsOf":
    """Who holds refs on ``key``: a scan of the sessions (for health and error messages only)."""
    state.version(key)
    sessions = 0
    names: list[tuple[str, str, float | None]] = []
    for skey, record in state.sessions.items():
        if record.holds_ref and record.version == key:
            sessions += 1
            if len(names) < limit:
                names.append((skey.session_id, record.state.value, record.lease_until))
    groups = [(g, r.members) for g, r in sorted(state.groups.items()) if r.holds_ref and r.version == key]
    return SessionsOf(key, sessions, len(groups), tuple(names), tuple(groups[:limit]))


# -- reclaim -------------------------------------------------------------------
def claim_reclaim(state: RegistryState, key: VersionKey) -> Outcome:
    version = state.version(key)
    new, effects = rec.claim(version, rec.reclaim_id_for(version, state.reclaim_seq + 1))
    if new is version:
        return Outcome(state, version.reclaim_id, effects)
    if not new.reclaim_pending:  # every holder restarted: nothing is loaded anywhere
        new = advance(new, VersionState.RECLAIMED)
    state = attrs.evolve(state, versions=state.versions.set(key, new), reclaim_seq=state.reclaim_seq + 1)
    return Outcome(state, new.reclaim_id, effects)


def record_unloaded(state: RegistryState, key: VersionKey, reclaim_id: str, engine: str) -> Outcome:
    """One engine's UNLOADED receipt for ``reclaim_id``."""
    if engine not in state.engines:
        raise UnknownEngine(f"engine {engine} is not registered")
    version = state.version(key)
    new, effects = rec.confirm(version, reclaim_id, engine)
    return Outcome(attrs.evolve(state, versions=state.versions.set(key, new)), new.state, effects)


def retry_reclaim(state: RegistryState, key: VersionKey) -> Outcome:
    version = state.version(key)
    if version.state is not VersionState.RECLAIMING:
        return Outcome(state, version.state, [Ignored(f"{key} is {version.state.value}; nothing to retry")])
    return Outcome(state, version.state, rec.sends(version))


# -- recovery --------------------------------------------------------------------
def start_reprovision(state: RegistryState, key: VersionKey, engine: str) -> Outcome:
    """Load a needed version again on an engine that lost it; the reply is the attempt token
    (None when nothing is to do: not needed, already held, or already being loaded)."""
    version = state.version(key)
    if engine not in state.engines:
        raise UnknownEngine(f"engine {engine} is not registered")
    if (engine, key) not in state.missing():
        running = state.reprovisions.get((engine, key))
        return Outcome(state, running, [Ignored(f"{key} on {engine}: nothing to re-provision")])
    original = state.attempts[version.attempt]
    token = AttemptToken(key, state.attempt_seq + 1)
    attempt, effects = att.start(
        token, version.lora_name, version.digest, original.plan, {engine: state.engines[engine]},
        state.default_revision, reprovision=True,
    )
    state = attrs.evolve(
        state,
        attempt_seq=token.seq,
        attempts=state.attempts.set(token, attempt),
        reprovisions=state.reprovisions.set((engine, key), token),
    )
    return Outcome(state, token, effects)


def record_lost(state: RegistryState, engine: str, key: VersionKey) -> Outcome:
    """``engine`` no longer holds ``key`` although it did not restart (an operator unloaded it):
    it leaves the version's holders (sessions go to another holder; it is re-provisioned where
    still needed), and a reclaim has nothing left to unload there."""
    if engine not in state.engines:
        raise UnknownEngine(f"engine {engine} is not registered")
    version = state.version(key)
    if version.state in SERVING and engine in version.engines:
        version = attrs.evolve(version, engines=tuple(e for e in version.engines if e != engine))
    elif version.state is VersionState.RECLAIMING and engine in version.reclaim_pending:
        version = rec.confirm(version, version.reclaim_id or "", engine)[0]
    else:
        return Outcome(state, False, [Ignored(f"{key} on {engine}: not held there by the registry")])
    return Outcome(attrs.evolve(state, versions=state.versions.set(key, version)), True)


def abort_stale(state: RegistryState, token: AttemptToken, reason: str) -> Outcome:
    """Abort an active attempt whose publisher stopped (cleanup follows on every target)."""
    state.attempt(token)
    return _step_attempt(state, token, att.abort, reason)


def read_fleet(state: RegistryState, now: float | None = None) -> Fleet:
    needed = state.needed()
    cleaning, active = [], {}
    for token, a in state.attempts.items():
        if a.phase is Phase.ABORTED:
            cleaning.append(token)
        elif a.phase in att.ACTIVE:
            active[token] = att.progress(a)
    return Fleet(
        epoch=state.epoch,
        engines=dict(state.engines),
        default=state.default,
        holders={v.key: frozenset(v.engines) for v in needed},
        missing=tuple(state.missing()),
        reclaimable=tuple(state.reclaimable()),
        reclaiming=tuple(sorted(k for k, v in state.versions.items() if v.state is VersionState.RECLAIMING)),
        cleaning=tuple(sorted(cleaning)),
        active=active,
        expired_sessions=state.expired_sessions,
        lease_ttl=state.lease_ttl,
        default_revision=state.default_revision,
        retiring=frozenset(k for k, v in state.versions.items() if v.retiring and v.state in SERVING),
        max_lag=state.max_lag,
        on_stale=state.on_stale,
        capacity=state.capacity,
        slots=state.slot_holders(),
        waiting=state.waiter,
        now=now,
        name_prefix=state.name_prefix,
        # every version whose adapter engines may hold as the registry knows it (loading, serving, being
        # unloaded, or failed and not yet cleaned): anything else managed of this epoch is an orphan
        lora_names={k: v.lora_name for k, v in state.versions.items()
                    if v.state in HELD_BY_ENGINES or v.state in (VersionState.LOADING, VersionState.ABORTED)},
    )


# -- the one door ----------------------------------------------------------------
# Tables keyed by a command's type: each entry takes that type's fields (a transition) or the
# command itself (a query), which no one callable type says for every key.
_TRANSITIONS: dict[type, Callable[..., Outcome]] = {
    RegisterEngine: register_engine, Reserve: reserve, CancelWait: cancel_wait, RecordPrepared: record_prepared,
    RecordBucketDone: record_bucket_done, RecordReady: record_ready, RecordFailure: record_failure,
    RecordUnknown: record_unknown, RecordCleaned: record_cleaned, RetryCleanup: retry_cleanup, Commit: commit,
    OpenSession: open_session, BindFirst: bind_first, Rebind: rebind, BeginClose: begin_close,
    CloseAndRelease: close_and_release,
    ForgetSessions: forget_sessions, ClaimReclaim: claim_reclaim, RecordUnloaded: record_unloaded,
    RetryReclaim: retry_reclaim, RenewLeases: renew_leases, ExpireSessions: expire_sessions,
    ExpireLeases: expire_leases,
    StartReprovision: start_reprovision, AbortStale: abort_stale, RecordLost: record_lost,
}

_QUERIES: dict[type, Callable[[RegistryState, Any], object]] = {
    AuthorizeDispatch: lambda state, c: authorize_dispatch(state, c.key),
    QueryAttempt: lambda state, c: query_attempt(state, c.token),
    ReadVersion: lambda state, c: state.version(c.key),
    ListReclaimable: lambda state, c: state.reclaimable(),
    ReadState: lambda state, c: state,
    ReadFleet: lambda state, c: read_fleet(state, c.now),
    ReadSessionsOf: lambda state, c: read_sessions_of(state, c.version, c.limit),
}

COMMANDS: tuple[type, ...] = (*_TRANSITIONS, *_QUERIES)


def handle(state: RegistryState, command: Command) -> Outcome:
    """The one door: apply ``command`` to ``state``. A query returns the state unchanged."""
    query = _QUERIES.get(type(command))
    if query is not None:
        return Outcome(state, query(state, command))
    transition = _TRANSITIONS.get(type(command))
    if transition is None:
        raise InvalidInput(f"{command!r} is not a registry command")
    return transition(state, *(getattr(command, f.name) for f in attrs.fields(type(command))))


@attrs.frozen
class Result:
    """What a registry answers, in process or across an actor boundary: the reply and the
    effects the caller must run, never the state."""

    reply: Any = None  # its type depends on the command, as Outcome's
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=_effects)
