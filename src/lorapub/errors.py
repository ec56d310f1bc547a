"""Typed errors: every rejection a user can see carries a stable ``code``.

The codes are part of the public contract (framework adapters switch on them),
the messages are for humans and name the objects involved.
"""

from __future__ import annotations

__all__ = [
    "LorapubError", "VersionConflict", "CapacityError", "EngineCapacityError", "PublicationSuperseded",
    "BindingStale", "GroupClosed", "NoPublishedVersion", "VersionMissing", "VersionReclaiming", "PublicationFailed",
    "PublicationBlocked", "NotReady", "StaleAttempt", "SessionClosed", "NotReclaimable", "UnknownVersion",
    "UnknownEngine", "EpochMismatch", "InvalidInput", "EngineError", "OutcomeUnknown", "InvalidTransition",
    "SessionExpired", "EngineUnavailable", "StoreError", "StoreCorrupted", "EngineClosed", "AlreadyStarted",
    "EngineNotDrained", "DrainTimeout", "DeploymentClosed",
    "ProvenanceMismatch",
    "NumericMismatch", "VersionSuspect",
]


class LorapubError(Exception):
    """Base of every error lorapub raises on purpose."""

    code = "LORAPUB_ERROR"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message
        self.details = details


class VersionConflict(LorapubError):
    """Same version key, different content digest (or a stale default revision)."""

    code = "VERSION_CONFLICT"


class CapacityError(LorapubError):
    """Every managed version slot is held; nothing was sent to any engine."""

    code = "CAPACITY_ERROR"


class EngineCapacityError(LorapubError):
    """An engine cannot hold the deployment's ``capacity`` managed versions (its SGLang limits
    are too small); the message names the engine, its limits and the flags that fix it."""

    code = "ENGINE_CAPACITY"


class PublicationSuperseded(LorapubError):
    """A newer publication took the place of this one while it waited for a slot; this version
    was never committed (and never will be). ``details['by']`` names the newer version."""

    code = "SUPERSEDED"


class BindingStale(LorapubError):
    """The session's version fell more than ``max_lag`` commits behind the default: its ref was
    released and it generates no more (start a new session, or use ``on_stale="rebind"``)."""

    code = "BINDING_STALE"


class GroupClosed(LorapubError):
    """A session joined a group whose every member had already closed: a group never spans two
    versions, so a closed group takes no new member (open members before any of them closes)."""

    code = "GROUP_CLOSED"


class NoPublishedVersion(LorapubError):
    """No version has been committed yet in this deployment epoch."""

    code = "NO_PUBLISHED_VERSION"


class VersionMissing(LorapubError):
    """An engine does not hold the exact version a session is bound to."""

    code = "VERSION_MISSING"


class VersionReclaiming(LorapubError):
    """The version is being reclaimed or was reclaimed: new dispatches are refused."""

    code = "VERSION_RECLAIMING"


class PublicationFailed(LorapubError):
    """The candidate failed and was cleaned on every engine; the default did not move."""

    code = "PUBLICATION_FAILED"


class PublicationBlocked(LorapubError):
    """An earlier attempt is unresolved (in flight, cleaning, or of unknown outcome)."""

    code = "PUBLICATION_BLOCKED"


class NotReady(LorapubError):
    """Commit asked for before every target reported a current READY."""

    code = "NOT_READY"


class StaleAttempt(LorapubError):
    """The attempt token is not the current attempt of that version."""

    code = "STALE_ATTEMPT"


class SessionClosed(LorapubError):
    """The session is closing or closed; it cannot open, bind or dispatch again."""

    code = "SESSION_CLOSED"


class NotReclaimable(LorapubError):
    """Reclaim asked for a version that is not RETIRED with zero session refs."""

    code = "NOT_RECLAIMABLE"


class UnknownVersion(LorapubError):
    """The version key names no version this registry ever reserved."""

    code = "UNKNOWN_VERSION"


class UnknownEngine(LorapubError):
    """The engine name is not one of the deployment's engines."""

    code = "UNKNOWN_ENGINE"


class EpochMismatch(LorapubError):
    """A key from another deployment epoch reached this registry."""

    code = "EPOCH_MISMATCH"


class InvalidInput(LorapubError, ValueError):
    """A bad argument (type, range, form) or a call out of order; nothing was sent and nothing changed.
    Also a ``ValueError``, so a framework's config loader that catches ``ValueError`` reports it as the
    bad setting it is."""

    code = "INVALID_INPUT"


class EngineError(LorapubError):
    """The engine answered, and the answer was a definite failure."""

    code = "ENGINE_ERROR"


class OutcomeUnknown(LorapubError):
    """No answer (timeout, dropped connection): the operation may or may not have happened.

    lorapub never resends a generation on this error and never treats any resource as
    released; a caller that sends the turn again (where running it twice is harmless to its
    rollout) is served by the session's same version.
    """

    code = "OUTCOME_UNKNOWN"


class InvalidTransition(LorapubError):
    """A state machine was asked for a move its table does not allow (a lorapub bug)."""

    code = "INVALID_TRANSITION"


class SessionExpired(LorapubError):
    """The session's lease ran out (its worker stopped renewing it); its ref was released."""

    code = "SESSION_EXPIRED"


class EngineUnavailable(LorapubError):
    """No healthy engine holds the version this request needs (restarting or re-provisioning)."""

    code = "ENGINE_UNAVAILABLE"


class StoreError(LorapubError):
    """The registry's durable store cannot be read or written; the file is named."""

    code = "STORE_ERROR"


class StoreCorrupted(StoreError):
    """The durable store's contents fail their integrity check; nothing was resumed from it."""

    code = "STORE_CORRUPTED"


class EngineClosed(EngineError):
    """An engine adapter was used after ``close()``: a definite failure, nothing was sent (sending
    would open a connection pool that nothing closes)."""

    code = "ENGINE_CLOSED"


class AlreadyStarted(LorapubError):
    """``start()`` on an object that is already running (live sessions would be dropped)."""

    code = "ALREADY_STARTED"


class DeploymentClosed(LorapubError):
    """The deployment was closed: a publish call that waited for a slot or ran committed nothing
    (an attempt it began is aborted and cleaned), and its sessions refuse new turns (no lease is
    renewed any more). A closed deployment starts nothing more: publish and open sessions on a new one."""

    code = "DEPLOYMENT_CLOSED"


class EngineNotDrained(LorapubError):
    """``remove_engine`` of a member that still takes traffic: drain it first
    (``await deployment.drain_engine(name)``), or it must be unreachable."""

    code = "ENGINE_NOT_DRAINED"


class DrainTimeout(LorapubError):
    """``drain_engine`` ran out of time with sessions or requests still on the engine; it stays
    draining (no new binding goes there). ``details['sessions']`` names the sessions still there."""

    code = "DRAIN_TIMEOUT"


class ProvenanceMismatch(LorapubError):
    """A turn's engine stamp does not attest the session's binding: another name or digest, another
    engine life, or no stamp where the engine declares it stamps (a silent base-model fallback). The
    turn is not a success. ``details``: ``expected`` (the binding) and ``stamp`` (what the engine said).
    See docs/provenance.md, "Stamp"."""

    code = "PROVENANCE_MISMATCH"


class NumericMismatch(PublicationFailed):
    """An engine did not reproduce the snapshot's probe (the reference logprobs) under the exact
    version name: its READY was never recorded, the attempt failed and the default did not move.
    ``details``: engine, version, sequence, position (the worst token), expected, observed,
    mean_abs and the tolerances."""

    code = "NUMERIC_MISMATCH"


class VersionSuspect(LorapubError):
    """A new session was kept off the default because its canary drifted (``avoid_suspect``);
    sessions already bound to it keep it. The next committed version clears it."""

    code = "VERSION_SUSPECT"
