"""Engines and publication: reserve a slot, drive an attempt to READY on every engine, commit."""

from __future__ import annotations

from typing import Callable, Concatenate, ParamSpec

import attrs

from lorapub.core.commands import (
    CancelWait, Commit, MarkSuspect, QueryAttempt, RecordBucketDone, RecordCleaned, RecordFailure, RecordPrepared,
    RecordReady, RecordUnknown, RegisterEngine, Reserve, RetryCleanup,
)
from lorapub.core import attempt as att
from lorapub.core import reclaim as rec
from lorapub.core.attempt import Attempt, Phase, ReadyLocal, TargetState
from lorapub.core.effects import Effect, Ignored, ReadyToCommit, ReclaimEligible
from lorapub.core.facts import Readied, Retired
from lorapub.core.identity import AttemptToken, VersionKey, check_digest, lora_name_for
from lorapub.core.manifest import BucketPlan
from lorapub.core.version import SERVING, CommitReceipt, Version, VersionState, advance
from lorapub.errors import (
    CapacityError,
    InvalidInput,
    NotReady,
    PublicationBlocked,
    PublicationSuperseded,
    StaleAttempt,
    VersionConflict,
    VersionReclaiming,
)

from .state import AttemptStatus, Outcome, RegistryState, ReserveReply, Waiter, Waiting, check_epoch

__all__ = ['cancel_wait', 'commit', 'drop_holdings', 'query_attempt', 'reclaim_eligible', 'record_bucket_done', 'record_cleaned',
    'record_failure', 'record_prepared', 'record_ready', 'record_unknown', 'register_engine', 'reserve',
    'retry_cleanup', 'step_attempt', 'mark_suspect']


_P = ParamSpec("_P")


# -- engines -----------------------------------------------------------------
def drop_holdings(state: RegistryState, engine: str) -> RegistryState:
    """``engine`` holds none of the versions any more (a new life, or it left the fleet): it leaves
    every serving version's holders, and a reclaim has nothing left to unload there."""
    versions = state.versions
    for key, v in state.versions.items():
        if v.state in SERVING and engine in v.engines:
            versions = versions.set(key, attrs.evolve(v, engines=tuple(e for e in v.engines if e != engine)))
        elif v.state is VersionState.RECLAIMING and engine in v.reclaim_pending:
            versions = versions.set(key, rec.confirm(v, v.reclaim_id or "", engine)[0])
    return attrs.evolve(state, versions=versions)


def register_engine(state: RegistryState, c: RegisterEngine) -> Outcome:
    """Record that a member restarted: attempts bound to its old life abort. An engine that is not a
    member changes nothing (it joins by ``AddEngine``; a removed one is not re-added by a late probe)."""
    engine, incarnation = c.engine, c.incarnation
    old = state.engines.get(engine)
    if old is None:
        return Outcome(state, None, [Ignored(f"engine {engine} is not a member; AddEngine adds it")])
    if old == incarnation:
        return Outcome(state)
    state = attrs.evolve(state, engines=state.engines.set(engine, incarnation))
    # The new life holds no adapter: it leaves every version's holders (re-provisioned later
    # where sessions still need it), and a reclaim has nothing left to unload there.
    state = drop_holdings(state, engine)
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
        waiting = att.cleanup_owed_by(blocker)
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


def _capacity_refusal(state: RegistryState) -> CapacityError:
    """Every slot is held: say by what, and what frees one. Its details tell sessions that keep slots
    from engines that have not confirmed an unload or a cleanup (Relax's trainer reads them)."""
    holders = state.slot_holders()
    held = f"{state.capacity} managed version slots are held: " + "; ".join(h.describe() for h in holders) + ". "
    engines = sorted({e for h in holders for e in h.waits_on_engines})
    by_sessions = sum(1 for h in holders if h.kept_by_sessions)
    if engines and not by_sessions:
        advice = (
            f"No session keeps them: they wait for {', '.join(engines)} to confirm. A reachable engine "
            "confirms once the requests still running there end (publish(..., wait=seconds) waits for it); "
            "one that stays unreachable keeps the slot until it answers again or Deployment.remove_engine(name) "
            "removes it (health names it engine_unreachable)."
        )
    else:
        advice = (
            "publish(..., wait=seconds) waits for a slot (a newer publication supersedes a waiting one); "
            "Deployment(max_lag=k) bounds how long sessions keep old versions; Deployment(capacity=N) holds more"
        )
    return CapacityError(held + advice, held=[h.describe() for h in holders], held_by_sessions=by_sessions,
                         waiting_on_engines=engines)


def reserve(state: RegistryState, c: Reserve) -> Outcome:
    """Take a logical slot for ``key`` and start its attempt (begin on every engine).

    Same key and digest again sends nothing and joins the existing attempt, except that the
    same ``publisher``'s replay of a reserve whose reply was lost resumes it, and a version
    whose attempt failed clean starts a fresh attempt. With ``wait``, a call that finds no
    slot (or another attempt running) becomes the waiting publication and is answered
    :class:`Waiting`; the newest call always wins: it supersedes the waiting one.
    """
    key, digest, plan, publisher, wait, now = c.key, c.digest, c.plan, c.publisher, c.wait, c.now
    check_epoch(state, key.deployment_epoch, f"version {key}")
    check_digest(digest)
    by = state.superseded.get(key)
    if by is not None:
        raise PublicationSuperseded(
            f"version {key} was superseded by {by} while it waited (for a slot or for the attempt before it); it is "
            "never committed — "
            "publish the newest snapshot under a new version id", version=key, by=by,
        )
    existing = state.versions.get(key)
    if existing is not None:
        if existing.digest != digest:
            raise VersionConflict(
                f"version {key} already has digest {existing.digest[:12]}…, not {digest[:12]}…: a version id names "
                "one snapshot — publish this snapshot under a new version id (a retry must send the same snapshot)",
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
            raise PublicationBlocked(_blocked_advice(blocker), attempt=blocker.token,
                                     waiting_on_engines=list(att.cleanup_owed_by(blocker)))
        raise _capacity_refusal(state)
    # A slot is free: this call takes it. A different publication still waiting is older: superseded.
    state = _supersede_waiter(state, key)
    token = AttemptToken(key, state.attempt_seq + 1)
    name = lora_name_for(key, digest, state.name_prefix)
    # every member but the draining ones: a joining member is loaded with it too (it joins with it)
    attempt, effects = att.start(
        token, name, digest, plan, state.publication_targets(), state.default_revision, publisher=publisher
    )
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


def cancel_wait(state: RegistryState, c: CancelWait) -> Outcome:
    """The caller of the waiting publication ``key`` stopped waiting."""
    key = c.key
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


def step_attempt(
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


def mark_suspect(state: RegistryState, c: MarkSuspect) -> Outcome:
    """A resident version the canary saw drift is suspect from now on (its first reason kept);
    the reply says whether this call marked it. Nothing else changes: bound sessions keep it."""
    key, engine, reason = c.key, c.engine, c.reason
    version = state.version(key)
    if version.state not in SERVING or version.suspect is not None:
        return Outcome(state, False)
    marked = attrs.evolve(version, suspect=f"{engine}: {reason}"[:500])
    return Outcome(attrs.evolve(state, versions=state.versions.set(key, marked)), True)


def record_prepared(state: RegistryState, c: RecordPrepared) -> Outcome:
    token, engine, incarnation = c.token, c.engine, c.incarnation
    return step_attempt(state, token, att.on_prepared, engine, incarnation)


def record_bucket_done(state: RegistryState, c: RecordBucketDone) -> Outcome:
    token, party, index, incarnation = c.token, c.party, c.index, c.incarnation
    return step_attempt(state, token, att.on_bucket_done, party, index, incarnation)


def record_ready(state: RegistryState, c: RecordReady) -> Outcome:
    receipt = c.receipt
    attempt = state.attempts.get(receipt.token)
    out = step_attempt(state, receipt.token, att.on_ready, receipt)
    if any(isinstance(fx, Ignored) for fx in out.effects):  # late, unknown or of a past life: applied nowhere
        return out
    if attempt is not None and receipt.digest != attempt.digest:  # another digest: refused, the attempt aborts
        return out
    return attrs.evolve(out, facts=(Readied(receipt.token.version, receipt.engine),))


def record_failure(state: RegistryState, c: RecordFailure) -> Outcome:
    """A definite failure of one target (or of the source): the attempt aborts."""
    token, engine, reason = c.token, c.engine, c.reason
    return step_attempt(state, token, att.abort, f"{engine}: {reason}")


def record_unknown(state: RegistryState, c: RecordUnknown) -> Outcome:
    """No answer from ``engine`` for ``operation``: an active attempt aborts (it can never
    commit), an unanswered cleanup keeps its slot and blocks publication."""
    token, engine, operation = c.token, c.engine, c.operation
    a = state.attempts.get(token)
    if a is not None and a.phase is Phase.ABORTED:
        return step_attempt(state, token, att.on_cleanup_unknown, engine)
    return step_attempt(state, token, att.abort, f"{engine}: outcome of {operation} unknown")


def record_cleaned(state: RegistryState, c: RecordCleaned) -> Outcome:
    token, engine, incarnation = c.token, c.engine, c.incarnation
    return step_attempt(state, token, att.on_cleaned, engine, incarnation)


def retry_cleanup(state: RegistryState, c: RetryCleanup) -> Outcome:
    token = c.token
    return step_attempt(state, token, att.retry_cleanup)


def commit(state: RegistryState, c: Commit) -> Outcome:
    """Make ``key`` the default. A replay of a commit that happened returns its receipt."""
    key, token, expected_default_revision = c.key, c.token, c.expected_default_revision
    version = state.version(key)
    a = state.attempt(token)
    if token.version != key:
        raise StaleAttempt(f"attempt {token} does not belong to version {key}")
    if a.phase is Phase.COMMITTED:  # a replay says again what the commit said
        assert version.commit is not None
        return Outcome(state, version.commit, reclaim_eligible(state, version.commit.retired))
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
    return Outcome(state, receipt, [fx for k in eligible for fx in reclaim_eligible(state, k)],
                   [Retired(retired, key)] if retired is not None else [])


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


def reclaim_eligible(state: RegistryState, key: VersionKey | None) -> list[Effect]:
    """The one place ``ReclaimEligible`` is decided: RETIRED and kept by no session."""
    if key is None:
        return []
    if state.versions[key].reclaimable:
        return [ReclaimEligible(key)]
    return []


def query_attempt(state: RegistryState, c: QueryAttempt) -> Outcome:
    token = c.token
    a = state.attempt(token)
    v = state.versions[token.version]
    return Outcome(state, AttemptStatus(
        token, a.phase, v.state, v.commit if a.phase is Phase.COMMITTED else None,
        tuple((t.engine, t.state.value) for t in a.targets), a.publisher,
    ))
