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

from typing import Any, Iterable, Mapping

import attrs
from pyrsistent import PMap, pmap

from lorapub.core import attempt as att
from lorapub.core import reclaim as rec
from lorapub.core import session as ses
from lorapub.core.attempt import Attempt, Phase, ReadyLocal
from lorapub.core.commands import (  # noqa: F401 - the command values are part of this module's face
    AuthorizeDispatch,
    BeginClose,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Command,
    Commit,
    ForgetSessions,
    ListReclaimable,
    OpenSession,
    QUERIES,
    QueryAttempt,
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
    Reserve,
    RetryCleanup,
    RetryReclaim,
)
from lorapub.core.effects import Effect, Ignored, ReadyToCommit, ReclaimEligible
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey, check_digest, lora_name_for
from lorapub.core.manifest import BucketPlan
from lorapub.core.session import Binding, SessionRecord, SessionState
from lorapub.core.version import CommitReceipt, Version, VersionState, add_session_ref, advance, drop_session_ref
from lorapub.errors import (
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


def _frozen_map(value) -> PMap:
    # attrs.evolve re-runs converters: an existing PMap must pass through, not be copied.
    return value if isinstance(value, PMap) else pmap(value)


@attrs.frozen
class RegistryState:
    epoch: int
    engines: PMap = attrs.field(converter=_frozen_map)  # engine -> current incarnation
    capacity: int = DEFAULT_CAPACITY
    versions: PMap = attrs.field(factory=pmap, converter=_frozen_map)  # VersionKey -> Version
    attempts: PMap = attrs.field(factory=pmap, converter=_frozen_map)  # AttemptToken -> Attempt
    sessions: PMap = attrs.field(factory=pmap, converter=_frozen_map)  # SessionKey -> SessionRecord
    default: VersionKey | None = None
    default_revision: int = 0
    attempt_seq: int = 0
    reclaim_seq: int = 0

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
class AttemptStatus:
    token: AttemptToken
    phase: Phase
    version_state: VersionState
    commit: CommitReceipt | None
    targets: tuple[tuple[str, str], ...]  # (engine, target state)


def new_registry(epoch: int, engines: Mapping[str, str], capacity: int = DEFAULT_CAPACITY) -> RegistryState:
    if not engines:
        raise InvalidInput("a registry needs at least one target engine")
    if capacity < 1:
        raise InvalidInput(f"capacity must be >= 1, got {capacity}")
    return RegistryState(epoch=epoch, engines=dict(engines), capacity=capacity)


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
    effects: list[Effect] = []
    for token, a in list(state.attempts.items()):
        if a.resolved or a.target(engine) is None:
            continue
        new, fx = att.on_engine_restarted(a, engine, incarnation)
        state = _put_attempt(state, new)
        effects += fx
    return Outcome(state, None, effects)


# -- publication ---------------------------------------------------------------
def reserve(state: RegistryState, key: VersionKey, digest: str, plan: BucketPlan) -> Outcome:
    """Take a logical slot for ``key`` and start its attempt (begin on every engine).

    Same key and digest again returns the existing state and sends nothing.
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
        return Outcome(
            state,
            ReserveReply(existing.attempt, existing.lora_name, existing.state, a.expected_default_revision, False),
        )
    if plan.digest != digest:
        raise InvalidInput(f"bucket plan was made for digest {plan.digest[:12]}…, not {digest[:12]}…")
    blocker = state.unresolved_attempt()
    if blocker is not None:
        raise PublicationBlocked(
            f"attempt {blocker.token} is {blocker.phase.value}; it must commit or be confirmed clean first",
            attempt=blocker.token,
        )
    if state.slots_held >= state.capacity:
        held = sorted(f"{k}={v.state.value}" for k, v in state.versions.items() if v.holds_slot)
        raise CapacityError(
            f"{state.capacity} managed version slots are held ({', '.join(held)}); reclaim one first",
            held=held,
        )
    token = AttemptToken(key, state.attempt_seq + 1)
    name = lora_name_for(key, digest)
    attempt, effects = att.start(token, name, digest, plan, state.engines, state.default_revision)
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
    state = _put_attempt(state, new)
    if new.phase is Phase.READY and a.phase is not Phase.READY:
        effects = [*effects, ReadyToCommit(token, new.expected_default_revision)]
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


def _binding(state: RegistryState, record: SessionRecord) -> Binding:
    assert record.version is not None
    v = state.versions[record.version]
    return Binding(record.key, v.key, v.lora_name, v.digest)


def open_session(state: RegistryState, key: SessionKey) -> Outcome:
    record = ses.opened(_session(state, key), key)
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def bind_first(state: RegistryState, key: SessionKey) -> Outcome:
    """Bind to the current default on first generation; later calls return the same binding."""
    record = _session(state, key)
    if record is not None and record.state is SessionState.BOUND:
        return Outcome(state, _binding(state, record))
    if record is not None and record.state in ses.ENDING:
        raise SessionClosed(f"session {key} is {record.state.value}; bind refused")
    if state.default is None:
        raise NoPublishedVersion(f"no version is published yet in epoch {state.epoch}")
    version = add_session_ref(state.versions[state.default])
    record = ses.bound(record, key, version.key)
    state = attrs.evolve(
        state,
        versions=state.versions.set(version.key, version),
        sessions=state.sessions.set(key, record),
    )
    return Outcome(state, _binding(state, record))


def begin_close(state: RegistryState, key: SessionKey) -> Outcome:
    record = ses.closing(_session(state, key), key)
    return Outcome(attrs.evolve(state, sessions=state.sessions.set(key, record)), record.state)


def close_and_release(state: RegistryState, key: SessionKey) -> Outcome:
    """Release the session ref exactly once and keep a CLOSED tombstone."""
    record, release = ses.closed(_session(state, key), key)
    state = attrs.evolve(state, sessions=state.sessions.set(key, record))
    if release is None:
        return Outcome(state, record.state)
    state = attrs.evolve(state, versions=state.versions.set(release, drop_session_ref(state.versions[release])))
    return Outcome(state, record.state, _reclaim_eligible(state, release))


def forget_sessions(state: RegistryState, keys: Iterable[SessionKey]) -> Outcome:
    """Drop CLOSED tombstones the caller knows can get no late message any more."""
    sessions = state.sessions
    dropped = 0
    for key in keys:
        record = sessions.get(key)
        if record is not None and record.state is SessionState.CLOSED:
            sessions = sessions.remove(key)
            dropped += 1
    return Outcome(attrs.evolve(state, sessions=sessions), dropped)


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


# -- the one door ----------------------------------------------------------------
_TRANSITIONS = {
    RegisterEngine: register_engine, Reserve: reserve, RecordPrepared: record_prepared,
    RecordBucketDone: record_bucket_done, RecordReady: record_ready, RecordFailure: record_failure,
    RecordUnknown: record_unknown, RecordCleaned: record_cleaned, RetryCleanup: retry_cleanup, Commit: commit,
    OpenSession: open_session, BindFirst: bind_first, BeginClose: begin_close, CloseAndRelease: close_and_release,
    ForgetSessions: forget_sessions, ClaimReclaim: claim_reclaim, RecordUnloaded: record_unloaded,
    RetryReclaim: retry_reclaim,
}

_QUERIES = {
    AuthorizeDispatch: lambda state, c: authorize_dispatch(state, c.key),
    QueryAttempt: lambda state, c: query_attempt(state, c.token),
    ReadVersion: lambda state, c: state.version(c.key),
    ListReclaimable: lambda state, c: state.reclaimable(),
    ReadState: lambda state, c: state,
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
