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
from typing import Any, Iterable, Mapping

import attrs
from pyrsistent import PMap, pmap

from lorapub.core import attempt as att
from lorapub.core import reclaim as rec
from lorapub.core import session as ses
from lorapub.core.attempt import Attempt, Phase, ReadyLocal, TargetState
from lorapub.core.commands import (  # noqa: F401 - the command values are part of this module's face
    AbortStale,
    AuthorizeDispatch,
    BeginClose,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    ExpireLeases,
    Command,
    Commit,
    ForgetSessions,
    ListReclaimable,
    OpenSession,
    QUERIES,
    QueryAttempt,
    ReadFleet,
    ReadState,
    ReadVersion,
    RecordBucketDone,
    RecordCleaned,
    RecordFailure,
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
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey, check_digest, lora_name_for
from lorapub.core.manifest import BucketPlan
from lorapub.core.session import Binding, SessionRecord, SessionState
from lorapub.core.session_table import SessionTable
from lorapub.core.version import (
    SERVING,
    CommitReceipt,
    Version,
    VersionState,
    add_session_ref,
    advance,
    drop_session_ref,
)
from lorapub.errors import (
    SessionExpired,
    CapacityError,
    EpochMismatch,
    InvalidInput,
    NoPublishedVersion,
    NotReady,
    PublicationBlocked,
    SessionClosed,
    StaleAttempt,
    UnknownEngine,
    UnknownVersion,
    VersionConflict,
    VersionReclaiming,
)

DEFAULT_CAPACITY = 2
#: Seconds a session's ref outlives the last renewal from its worker (None: no leases).
DEFAULT_LEASE_TTL = 120.0
#: Seconds a closed or expired session's tombstone is kept after the session began (None: for
#: the epoch). Messages for a session born before the window are refused without one.
DEFAULT_TOMBSTONE_WINDOW = 3600.0


def _frozen_map(value) -> PMap:
    # attrs.evolve re-runs converters: an existing PMap must pass through, not be copied.
    return value if isinstance(value, PMap) else pmap(value)


def _session_table(value) -> SessionTable:
    # as _frozen_map: an existing table passes through; a mapping of records becomes one
    return value if isinstance(value, SessionTable) else SessionTable(value)


@attrs.frozen
class RegistryState:
    epoch: int
    engines: PMap = attrs.field(converter=_frozen_map)  # engine -> current incarnation
    capacity: int = DEFAULT_CAPACITY
    versions: PMap = attrs.field(factory=pmap, converter=_frozen_map)  # VersionKey -> Version
    attempts: PMap = attrs.field(factory=pmap, converter=_frozen_map)  # AttemptToken -> Attempt
    # SessionKey -> SessionRecord, held as atoms the garbage collector does not track, with
    # the lease and tombstone indexes ExpireLeases reads (see lorapub.core.session_table)
    sessions: SessionTable = attrs.field(factory=SessionTable, converter=_session_table)
    default: VersionKey | None = None
    default_revision: int = 0
    attempt_seq: int = 0
    reclaim_seq: int = 0
    lease_ttl: float | None = DEFAULT_LEASE_TTL
    # (engine, VersionKey) -> the re-provisioning attempt loading it there again
    reprovisions: PMap = attrs.field(factory=pmap, converter=_frozen_map)
    expired_sessions: int = 0
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW
    forgotten_sessions: int = 0

    # -- reads ---------------------------------------------------------------
    @property
    def slots_held(self) -> int:
        return sum(1 for v in self.versions.values() if v.holds_slot)

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
        return sorted(
            k for k, v in self.versions.items() if v.state is VersionState.RETIRED and v.session_refs == 0
        )

    def needed(self) -> list[Version]:
        """Versions sessions can still use: the default and RETIRED versions with refs."""
        return [
            v for k, v in sorted(self.versions.items())
            if v.state is VersionState.PUBLISHED or (v.state is VersionState.RETIRED and v.session_refs > 0)
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
    reply: Any = None
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen
class ReserveReply:
    token: AttemptToken
    lora_name: str
    state: VersionState
    expected_default_revision: int
    created: bool


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
    active: Mapping[AttemptToken, tuple]  # live attempts -> their progress value
    expired_sessions: int
    lease_ttl: float | None

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


def new_registry(
    epoch: int,
    engines: Mapping[str, str],
    capacity: int = DEFAULT_CAPACITY,
    lease_ttl: float | None = DEFAULT_LEASE_TTL,
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW,
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
    return RegistryState(
        epoch=epoch, engines=dict(engines), capacity=capacity, lease_ttl=lease_ttl, tombstone_window=tombstone_window,
    )


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


def reserve(state: RegistryState, key: VersionKey, digest: str, plan: BucketPlan, publisher: str = "") -> Outcome:
    """Take a logical slot for ``key`` and start its attempt (begin on every engine).

    Same key and digest again sends nothing and joins the existing attempt, except that the
    same ``publisher``'s replay of a reserve whose reply was lost resumes it, and a version
    whose attempt failed clean starts a fresh attempt.
    """
    _check_epoch(state, key.deployment_epoch, f"version {key}")
    check_digest(digest)
    existing = state.versions.get(key)
    if existing is not None:
        if existing.digest != digest:
            raise VersionConflict(
                f"version {key} already has digest {existing.digest[:12]}…, not {digest[:12]}…",
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
    blocker = state.unresolved_attempt()
    if blocker is not None:
        raise PublicationBlocked(_blocked_advice(blocker), attempt=blocker.token)
    if state.slots_held >= state.capacity:
        held = sorted(f"{k}={v.state.value}" for k, v in state.versions.items() if v.holds_slot)
        raise CapacityError(
            f"{state.capacity} managed version slots are held ({', '.join(held)}); reclaim one first",
            held=held,
        )
    token = AttemptToken(key, state.attempt_seq + 1)
    name = lora_name_for(key, digest)
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


def _step_attempt(state: RegistryState, token: AttemptToken, fn, *args) -> Outcome:
    a = state.attempts.get(token)
    if a is None:
        return Outcome(state, None, [Ignored(f"attempt {token} is unknown here")])
    new, effects = fn(a, *args)
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
        if version.state in SERVING and att.all_ready_current(new, state.engines):
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
    return Outcome(state, receipt, _reclaim_eligible(state, retired))


def _reclaim_eligible(state: RegistryState, key: VersionKey | None) -> list[Effect]:
    """The one place ``ReclaimEligible`` is decided: RETIRED with zero session refs."""
    if key is None:
        return []
    version = state.versions[key]
    if version.state is VersionState.RETIRED and version.session_refs == 0:
        return [ReclaimEligible(key)]
    return []


def query_attempt(state: RegistryState, token: AttemptToken) -> AttemptStatus:
    a = state.attempt(token)
    v = state.versions[token.version]
    return AttemptStatus(
        token, a.phase, v.state, v.commit if a.phase is Phase.COMMITTED else None,
        tuple((t.engine, t.state.value) for t in a.targets),
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


def _refuse_beyond_window(state: RegistryState, key: SessionKey, record, now: float | None, what: str) -> None:
    if record is None and _beyond_window(state, key, now):
        raise SessionExpired(
            f"session {key} began more than {state.tombstone_window:g}s ago and is not live here "
            f"(its tombstone may have been forgotten); {what} refused — start a new session", session=key,
        )


def _binding(state: RegistryState, record: SessionRecord) -> Binding:
    assert record.version is not None
    v = state.versions[record.version]
    return Binding(record.key, v.key, v.lora_name, v.digest)


def _lease_until(state: RegistryState, now: float | None) -> float | None:
    return None if now is None or state.lease_ttl is None else now + state.lease_ttl


def open_session(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    found = _session(state, key)
    _refuse_beyond_window(state, key, found, now, "open")
    record = ses.leased(ses.opened(found, key), _lease_until(state, now))
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def bind_first(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    """Bind to the current default on first generation (the lease starts); later calls return
    the same binding and change nothing (leases are renewed in batches, by ``RenewLeases``)."""
    record = _session(state, key)
    _refuse_beyond_window(state, key, record, now, "bind")
    lease = _lease_until(state, now)
    if record is not None and record.state is SessionState.BOUND:
        return Outcome(state, _binding(state, record))  # a replay: same answer, nothing changes
    if record is not None and record.state in ses.ENDING:
        ses.opened(record, key)  # raises the typed refusal (closed or expired)
    if state.default is None:
        raise NoPublishedVersion(f"no version is published yet in epoch {state.epoch}")
    version = add_session_ref(state.versions[state.default])
    record = ses.leased(ses.bound(record, key, version.key), lease)
    state = attrs.evolve(
        state,
        versions=state.versions.set(version.key, version),
        sessions=state.sessions.set(key, record),
    )
    return Outcome(state, _binding(state, record))


def begin_close(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    found = _session(state, key)
    if found is None and _beyond_window(state, key, now):
        return Outcome(state, SessionState.CLOSED)  # long over: nothing to record
    record = ses.closing(found, key)
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def close_and_release(state: RegistryState, key: SessionKey, now: float | None = None) -> Outcome:
    """Release the session ref exactly once and keep a CLOSED tombstone (for the window)."""
    found = _session(state, key)
    if found is None and _beyond_window(state, key, now):
        return Outcome(state, SessionState.CLOSED)
    record, release = ses.closed(found, key)
    state = attrs.evolve(state, sessions=state.sessions.set(key, record))
    if release is None:
        return Outcome(state, record.state)
    state = attrs.evolve(state, versions=state.versions.set(release, drop_session_ref(state.versions[release])))
    return Outcome(state, record.state, _reclaim_eligible(state, release))


def forget_sessions(state: RegistryState, keys: Iterable[SessionKey]) -> Outcome:
    """Drop CLOSED tombstones the caller knows can get no late message any more."""
    drop = {}
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


def expire_leases(state: RegistryState, now: float | None = None) -> Outcome:
    """Sessions whose worker stopped renewing: EXPIRED tombstone, ref released once; and the
    tombstones of sessions born before the window are forgotten.

    The session table indexes leases by deadline and tombstones by birth, so a pass reads
    only the sessions that are due: O(due · log n), not a scan of every session."""
    if now is None:
        return Outcome(state, 0)
    if not math.isfinite(now):  # the indexes are ordered by finite times: read every record
        return _expire_by_scan(state, now)
    sessions = state.sessions
    forget = [] if state.tombstone_window is None else sessions.tombstones_born_before(now - state.tombstone_window)
    return _expire(state, sessions.leases_due(now), forget)


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
    return _expire(state, due, forget)


def _expire(state: RegistryState, due: list[SessionKey], forget: list[SessionKey]) -> Outcome:
    """Expire the leases ``due`` (each releases its ref once) and forget the tombstones ``forget``."""
    if not due and not forget:
        return Outcome(state, 0)
    versions = state.versions
    released: set[VersionKey] = set()
    expired = []
    for key in due:
        record, release = ses.expired(state.sessions[key])
        expired.append((key, record))
        if release is not None:
            versions = versions.set(release, drop_session_ref(versions[release]))
            released.add(release)
    # the tombstones first: a session that expires in this pass is not forgotten in it
    state = attrs.evolve(
        state, versions=versions, sessions=state.sessions.remove_many(forget).update(expired),
        expired_sessions=state.expired_sessions + len(expired), forgotten_sessions=state.forgotten_sessions + len(forget),
    )
    return Outcome(state, len(expired), [fx for key in sorted(released) for fx in _reclaim_eligible(state, key)])


def authorize_dispatch(state: RegistryState, key: SessionKey) -> Binding:
    """The binding a new backend request must carry; refused once closing or reclaiming."""
    record = ses.require_dispatchable(_session(state, key), key)
    binding = _binding(state, record)
    version = state.versions[binding.version]
    if not version.dispatchable:
        raise VersionReclaiming(f"version {version.key} is {version.state.value}; dispatch refused")
    return binding


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


def abort_stale(state: RegistryState, token: AttemptToken, reason: str) -> Outcome:
    """Abort an active attempt whose publisher stopped (cleanup follows on every target)."""
    state.attempt(token)
    return _step_attempt(state, token, att.abort, reason)


def read_fleet(state: RegistryState) -> Fleet:
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
    )


# -- the one door ----------------------------------------------------------------
_TRANSITIONS = {
    RegisterEngine: register_engine, Reserve: reserve, RecordPrepared: record_prepared,
    RecordBucketDone: record_bucket_done, RecordReady: record_ready, RecordFailure: record_failure,
    RecordUnknown: record_unknown, RecordCleaned: record_cleaned, RetryCleanup: retry_cleanup, Commit: commit,
    OpenSession: open_session, BindFirst: bind_first, BeginClose: begin_close, CloseAndRelease: close_and_release,
    ForgetSessions: forget_sessions, ClaimReclaim: claim_reclaim, RecordUnloaded: record_unloaded,
    RetryReclaim: retry_reclaim, RenewLeases: renew_leases, ExpireLeases: expire_leases,
    StartReprovision: start_reprovision, AbortStale: abort_stale,
}

_QUERIES = {
    AuthorizeDispatch: lambda state, c: authorize_dispatch(state, c.key),
    QueryAttempt: lambda state, c: query_attempt(state, c.token),
    ReadVersion: lambda state, c: state.version(c.key),
    ListReclaimable: lambda state, c: state.reclaimable(),
    ReadState: lambda state, c: state,
    ReadFleet: lambda state, c: read_fleet(state),
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

    reply: Any = None
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=tuple)
