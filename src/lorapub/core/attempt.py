"""One publication attempt of one version across its target engines.

begin -> PREPARED on every target -> buckets in fixed order (bucket i+1 once the source and every
target finished bucket i) -> end -> READY_LOCAL on every target. Any definite failure or unknown
outcome aborts it and asks every target for cleanup; it is resolved only when every target confirmed
cleanup. Messages for another attempt or an old incarnation change nothing.
"""

from __future__ import annotations

import enum
from typing import Mapping, TypedDict, Unpack

import attrs

from lorapub.core.effects import SOURCE, Effect, Ignored, SendBegin, SendCleanup, SendEnd, TransferBucket
from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import BucketPlan
from lorapub.errors import InvalidTransition

__all__ = [
    "Phase", "ACTIVE", "RESOLVED", "TargetState", "ReadyLocal", "Target", "Attempt", "Step", "Progress", "start",
    "resend_begins", "progress", "on_prepared", "on_bucket_done", "on_ready", "all_ready_current", "cleanup_owed_by",
    "mark_committed",
    "abort", "on_cleaned", "on_cleanup_unknown", "retry_cleanup", "on_engine_restarted", "on_engine_removed",
]


class Phase(enum.Enum):
    BEGINNING = "BEGINNING"
    TRANSFERRING = "TRANSFERRING"
    ENDING = "ENDING"
    READY = "READY"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"
    CLEAN = "CLEAN"


ACTIVE = frozenset({Phase.BEGINNING, Phase.TRANSFERRING, Phase.ENDING, Phase.READY})
RESOLVED = frozenset({Phase.COMMITTED, Phase.CLEAN})

#: The phase moves, as the module's docstring draws them: every active phase may abort; an aborted attempt is
#: CLEAN once every target confirmed its cleanup. Every function below moves a phase only through
#: :func:`_move`, which refuses any other.
_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.BEGINNING: frozenset({Phase.TRANSFERRING, Phase.ABORTED}),
    Phase.TRANSFERRING: frozenset({Phase.ENDING, Phase.ABORTED}),
    Phase.ENDING: frozenset({Phase.READY, Phase.ABORTED}),
    Phase.READY: frozenset({Phase.COMMITTED, Phase.ABORTED}),
    Phase.COMMITTED: frozenset(),
    Phase.ABORTED: frozenset({Phase.CLEAN}),
    Phase.CLEAN: frozenset(),
}


class _Changes(TypedDict, total=False):
    targets: "tuple[Target, ...]"
    bucket: int
    bucket_done: frozenset[str]
    abort_reason: str | None


def _move(attempt: "Attempt", to: Phase, **changes: Unpack[_Changes]) -> "Attempt":
    if to not in _ALLOWED[attempt.phase]:
        raise InvalidTransition(f"attempt {attempt.token}: {attempt.phase.value} -> {to.value} is not a phase move")
    return attrs.evolve(attempt, phase=to, **changes)


class TargetState(enum.Enum):
    BEGIN_SENT = "BEGIN_SENT"
    PREPARED = "PREPARED"
    END_SENT = "END_SENT"
    READY = "READY"
    CLEANUP_SENT = "CLEANUP_SENT"
    CLEANUP_UNKNOWN = "CLEANUP_UNKNOWN"
    CLEANED = "CLEANED"


@attrs.frozen
class ReadyLocal:
    """READY_LOCAL receipt: what an engine proves it loaded, and in which life."""

    engine: str
    token: AttemptToken
    digest: str
    incarnation: str
    lora_id: str | None = None


@attrs.frozen
class Target:
    engine: str
    incarnation: str
    state: TargetState
    ready: ReadyLocal | None = None


@attrs.frozen
class Attempt:
    token: AttemptToken
    lora_name: str
    digest: str
    plan: BucketPlan
    expected_default_revision: int
    targets: tuple[Target, ...]
    phase: Phase = Phase.BEGINNING
    bucket: int = 0
    bucket_done: frozenset[str] = frozenset()
    abort_reason: str | None = None
    publisher: str = ""
    # A re-provisioning attempt loads an already published version on one restarted engine:
    # it never commits and never moves the default.
    reprovision: bool = False

    @property
    def resolved(self) -> bool:
        return self.phase in RESOLVED

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(t.engine for t in self.targets)

    def target(self, engine: str) -> Target | None:
        for t in self.targets:
            if t.engine == engine:
                return t
        return None

    def _with_target(self, new: Target) -> "Attempt":
        return attrs.evolve(self, targets=tuple(new if t.engine == new.engine else t for t in self.targets))


Step = tuple[Attempt, list[Effect]]
#: What :func:`progress` returns: phase, bucket, the parties done with it, each target's (life, state).
Progress = tuple[Phase, int, frozenset[str], tuple[tuple[str, TargetState], ...]]


def start(
    token: AttemptToken,
    lora_name: str,
    digest: str,
    plan: BucketPlan,
    engines: Mapping[str, str],
    expected_default_revision: int,
    *,
    publisher: str = "",
    reprovision: bool = False,
) -> Step:
    if plan.digest != digest:
        raise InvalidTransition(f"bucket plan is for digest {plan.digest[:12]}, version has {digest[:12]}")
    targets = tuple(Target(e, inc, TargetState.BEGIN_SENT) for e, inc in sorted(engines.items()))
    attempt = Attempt(
        token, lora_name, digest, plan, expected_default_revision, targets, publisher=publisher, reprovision=reprovision
    )
    return attempt, resend_begins(attempt)


def resend_begins(attempt: Attempt) -> list[Effect]:
    """The begins not answered yet (a replay after a lost reserve reply sends them again;
    begin is idempotent on the engine)."""
    return [
        SendBegin(t.engine, t.incarnation, attempt.token, attempt.lora_name, attempt.digest, attempt.plan)
        for t in attempt.targets
        if t.state is TargetState.BEGIN_SENT
    ]


def progress(attempt: Attempt) -> Progress:
    """A value that changes whenever the attempt moves (the reconciler's staleness check)."""
    return (attempt.phase, attempt.bucket, attempt.bucket_done, tuple((t.incarnation, t.state) for t in attempt.targets))


def _current(attempt: Attempt, engine: str, incarnation: str | None) -> Target | Ignored:
    target = attempt.target(engine)
    if target is None:
        return Ignored(f"{attempt.token}: {engine} is not a target")
    if incarnation is not None and incarnation != target.incarnation:
        return Ignored(f"{attempt.token}: {engine} incarnation {incarnation} is not current ({target.incarnation})")
    return target


def on_prepared(attempt: Attempt, engine: str, incarnation: str) -> Step:
    target = _current(attempt, engine, incarnation)
    if isinstance(target, Ignored):
        return attempt, [target]
    if attempt.phase is not Phase.BEGINNING or target.state is not TargetState.BEGIN_SENT:
        return attempt, [Ignored(f"{attempt.token}: PREPARED from {engine} in {attempt.phase.value}/{target.state.value}")]
    attempt = attempt._with_target(attrs.evolve(target, state=TargetState.PREPARED))
    if all(t.state is TargetState.PREPARED for t in attempt.targets):
        attempt = _move(attempt, Phase.TRANSFERRING, bucket=0, bucket_done=frozenset())
        return attempt, [TransferBucket(attempt.token, 0, attempt.engines)]
    return attempt, []


def on_bucket_done(attempt: Attempt, party: str, index: int, incarnation: str | None = None) -> Step:
    """``party`` is an engine name or SOURCE. Duplicates never start a second collective."""
    if party != SOURCE:
        target = _current(attempt, party, incarnation)
        if isinstance(target, Ignored):
            return attempt, [target]
    if attempt.phase is not Phase.TRANSFERRING or index != attempt.bucket or party in attempt.bucket_done:
        return attempt, [Ignored(f"{attempt.token}: bucket {index} from {party} is late or duplicate")]
    done = attempt.bucket_done | {party}
    if done < set(attempt.engines) | {SOURCE}:
        return attrs.evolve(attempt, bucket_done=done), []
    nxt = attempt.bucket + 1
    if nxt < len(attempt.plan):
        attempt = attrs.evolve(attempt, bucket=nxt, bucket_done=frozenset())
        return attempt, [TransferBucket(attempt.token, nxt, attempt.engines)]
    attempt = _move(
        attempt,
        Phase.ENDING,
        bucket=nxt,
        bucket_done=frozenset(),
        targets=tuple(attrs.evolve(t, state=TargetState.END_SENT) for t in attempt.targets),
    )
    return attempt, [SendEnd(t.engine, attempt.token) for t in attempt.targets]


def on_ready(attempt: Attempt, receipt: ReadyLocal) -> Step:
    """A READY for another attempt or life is ignored; one for this life with another digest aborts."""
    if receipt.token != attempt.token:
        return attempt, [Ignored(f"READY for {receipt.token} reached attempt {attempt.token}")]
    target = _current(attempt, receipt.engine, receipt.incarnation)
    if isinstance(target, Ignored):
        return attempt, [target]
    if attempt.phase is not Phase.ENDING or target.state is not TargetState.END_SENT:
        return attempt, [Ignored(f"{attempt.token}: READY from {receipt.engine} in {attempt.phase.value}/{target.state.value}")]
    if receipt.digest != attempt.digest:
        return abort(attempt, f"{receipt.engine} loaded digest {receipt.digest[:12]}, expected {attempt.digest[:12]}")
    attempt = attempt._with_target(attrs.evolve(target, state=TargetState.READY, ready=receipt))
    if all(t.state is TargetState.READY for t in attempt.targets):
        attempt = _move(attempt, Phase.READY)
    return attempt, []


def all_ready_current(attempt: Attempt, engines: Mapping[str, str]) -> bool:
    """Every target READY in the incarnation the registry knows now."""
    return attempt.phase is Phase.READY and all(
        t.state is TargetState.READY and t.ready is not None and engines.get(t.engine) == t.incarnation == t.ready.incarnation
        for t in attempt.targets
    )


def cleanup_owed_by(attempt: Attempt) -> tuple[str, ...]:
    """An aborted attempt's engines that have not confirmed its cleanup (none for any other phase)."""
    if attempt.phase is not Phase.ABORTED:
        return ()
    return tuple(sorted(t.engine for t in attempt.targets if t.state is not TargetState.CLEANED))


def mark_committed(attempt: Attempt) -> Attempt:
    if attempt.phase is not Phase.READY:
        raise InvalidTransition(f"{attempt.token} cannot commit from {attempt.phase.value}")
    return _move(attempt, Phase.COMMITTED)


def abort(attempt: Attempt, reason: str) -> Step:
    """Abort an active attempt: every target is asked to clean up, whatever it reached."""
    if attempt.phase not in ACTIVE:
        return attempt, [Ignored(f"{attempt.token} is {attempt.phase.value}; abort ({reason}) changes nothing")]
    targets = tuple(attrs.evolve(t, state=TargetState.CLEANUP_SENT, ready=None) for t in attempt.targets)
    attempt = _move(attempt, Phase.ABORTED, targets=targets, abort_reason=reason)
    return attempt, [SendCleanup(t.engine, t.incarnation, attempt.token, attempt.lora_name) for t in targets]


def on_cleaned(attempt: Attempt, engine: str, incarnation: str) -> Step:
    target = _current(attempt, engine, incarnation)
    if isinstance(target, Ignored):
        return attempt, [target]
    if attempt.phase is not Phase.ABORTED or target.state is TargetState.CLEANED:
        return attempt, [Ignored(f"{attempt.token}: CLEANED from {engine} in {attempt.phase.value}/{target.state.value}")]
    attempt = attempt._with_target(attrs.evolve(target, state=TargetState.CLEANED))
    if all(t.state is TargetState.CLEANED for t in attempt.targets):
        attempt = _move(attempt, Phase.CLEAN)
    return attempt, []


def on_cleanup_unknown(attempt: Attempt, engine: str) -> Step:
    """No answer to a cleanup: the target stays held; only a confirmed retry frees it."""
    target = attempt.target(engine)
    if target is None or attempt.phase is not Phase.ABORTED or target.state is not TargetState.CLEANUP_SENT:
        return attempt, [Ignored(f"{attempt.token}: cleanup-unknown from {engine} changes nothing")]
    return attempt._with_target(attrs.evolve(target, state=TargetState.CLEANUP_UNKNOWN)), []


def retry_cleanup(attempt: Attempt) -> Step:
    if attempt.phase is not Phase.ABORTED:
        return attempt, [Ignored(f"{attempt.token} is {attempt.phase.value}; nothing to clean")]
    effects: list[Effect] = []
    targets = []
    for t in attempt.targets:
        if t.state is not TargetState.CLEANED:
            t = attrs.evolve(t, state=TargetState.CLEANUP_SENT)
            effects.append(SendCleanup(t.engine, t.incarnation, attempt.token, attempt.lora_name))
        targets.append(t)
    return attrs.evolve(attempt, targets=tuple(targets)), effects


def on_engine_restarted(attempt: Attempt, engine: str, incarnation: str) -> Step:
    """The old life's stash and READY are void; cleanup is asked of the new life."""
    target = attempt.target(engine)
    if target is None or target.incarnation == incarnation or attempt.resolved:
        return attempt, []
    if target.state is TargetState.CLEANED:
        return attempt, []  # confirmed clean in its old life; nothing of it survives
    if attempt.phase in ACTIVE:
        attempt = attempt._with_target(attrs.evolve(target, incarnation=incarnation, ready=None))
        return abort(attempt, f"{engine} restarted as {incarnation}")
    target = attrs.evolve(target, incarnation=incarnation, state=TargetState.CLEANUP_SENT)
    attempt = attempt._with_target(target)
    return attempt, [SendCleanup(engine, incarnation, attempt.token, attempt.lora_name)]



def on_engine_removed(attempt: Attempt, engine: str) -> Step:
    """The engine left the fleet: nothing more is asked of it and its part counts as cleaned (what it
    staged is no longer this deployment's). An active attempt aborts; the others are asked to clean."""
    target = attempt.target(engine)
    if target is None or attempt.resolved or target.state is TargetState.CLEANED:
        return attempt, []
    effects: list[Effect] = []
    if attempt.phase in ACTIVE:
        attempt, effects = abort(attempt, f"{engine} left the fleet")
        effects = [fx for fx in effects if not (isinstance(fx, SendCleanup) and fx.engine == engine)]
    attempt = attempt._with_target(attrs.evolve(target, state=TargetState.CLEANED, ready=None))
    if all(t.state is TargetState.CLEANED for t in attempt.targets):
        attempt = _move(attempt, Phase.CLEAN)
    return attempt, effects
