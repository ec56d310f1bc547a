"""What lorapub decided, as typed events: every decision the runtime takes is one event value that
observers receive (the decision log, Prometheus series, a test). Each has a stable ``KIND`` and
flat ``fields()`` (no keys or tokens, no per-request events at INFO).
See docs/operating.md, "Decision events".
"""

from __future__ import annotations

import logging
from typing import Callable, ClassVar, Mapping

import attrs

from lorapub.core.identity import VersionKey

__all__ = [
    "Event", "Observer", "KINDS",
    "PublishBegun", "PublishWaiting", "EngineReady", "PublishCommitted", "PublishFailed", "PublishSuperseded",
    "PublishProgress", "SessionBound", "SessionRebound", "SessionStale", "SessionsExpired", "VersionRetired",
    "ReclaimClaimed", "VersionUnloaded", "VersionReclaimed", "OrphanFound", "OrphanFreed", "EngineRestarted",
    "EngineReprovisioned", "EngineJoining", "EngineDraining", "EngineDrained", "EngineRemoved", "HealthChanged",
    "ReconcilePassed", "RegistryDecided", "RequestDispatched",
    "ProvenanceMismatched",
    "PublishNumericMismatch", "VersionSuspected",
]


@attrs.frozen
class Event:
    """One decision. ``KIND`` names it for logs and metrics (stable); ``LEVEL`` is the log level
    its line is written at (DEBUG: per-request or per-pass events, never at INFO)."""

    KIND: ClassVar[str] = "event"
    LEVEL: ClassVar[int] = logging.INFO

    def fields(self) -> dict[str, object]:
        """The event's fields, flat (versions as their ``epoch-id`` text), in declaration order."""
        out: dict[str, object] = {}
        for f in attrs.fields(type(self)):
            if not f.metadata.get("log", True):
                continue
            value = getattr(self, f.name)
            if isinstance(value, VersionKey):
                value = str(value)
            elif isinstance(value, float):
                value = round(value, 4)
            elif isinstance(value, Mapping):
                value = {str(k): (round(v, 4) if isinstance(v, float) else v) for k, v in value.items()}
            elif isinstance(value, tuple):
                value = [str(v) for v in value]
            out[f.name] = value
        return out


#: What receives events: any callable taking one. One that raises is logged and never breaks lorapub.
Observer = Callable[[Event], None]


# -- publication ------------------------------------------------------------------------------

@attrs.frozen
class PublishBegun(Event):
    KIND = "publish.begun"
    version: VersionKey
    lora_name: str
    bytes: int
    buckets: int
    engines: tuple[str, ...]


@attrs.frozen
class PublishWaiting(Event):
    """A publication found every slot held (or another attempt running) and waits."""

    KIND = "publish.waiting"
    version: VersionKey
    reason: str


@attrs.frozen
class EngineReady(Event):
    KIND = "publish.ready"
    version: VersionKey
    engine: str


@attrs.frozen
class PublishCommitted(Event):
    KIND = "publish.committed"
    version: VersionKey
    revision: int
    retired: VersionKey | None
    seconds: float
    waited: float
    bytes: int
    phases: Mapping[str, float]  # reserve, transfer, end, commit -> seconds


@attrs.frozen
class PublishFailed(Event):
    KIND = "publish.failed"
    LEVEL = logging.WARNING
    version: VersionKey
    code: str  # the typed error's code (CAPACITY_ERROR, PUBLICATION_FAILED, ...)
    reason: str
    seconds: float


@attrs.frozen
class PublishSuperseded(Event):
    KIND = "publish.superseded"
    version: VersionKey
    by: VersionKey | None
    waited: float


@attrs.frozen
class PublishProgress(Event):
    """Bytes sent so far to one engine, and the phase (what ``publish(progress=…)`` receives)."""

    KIND = "publish.progress"
    LEVEL = logging.DEBUG
    version: VersionKey
    engine: str
    phase: str
    bytes_sent: int
    bytes_total: int
    transport: str


@attrs.frozen
class PublishNumericMismatch(Event):
    """An engine did not reproduce the snapshot's probe: its READY was refused (the worst token)."""

    KIND = "publish.numeric_mismatch"
    LEVEL = logging.WARNING
    version: VersionKey
    engine: str
    sequence: int
    position: int
    expected: float
    observed: float
    mean_abs: float


@attrs.frozen
class VersionSuspected(Event):
    """The canary found a resident version's probe drifted on an engine: the version is suspect."""

    KIND = "version.suspect"
    LEVEL = logging.WARNING
    version: VersionKey
    engine: str
    reason: str


# -- sessions ---------------------------------------------------------------------------------

@attrs.frozen
class SessionBound(Event):
    KIND = "session.bound"
    session: str
    version: VersionKey
    group: str | None
    lag: int


@attrs.frozen
class SessionRebound(Event):
    KIND = "session.rebound"
    session: str
    version: VersionKey
    rebinds: int


@attrs.frozen
class SessionStale(Event):
    KIND = "session.stale"
    session: str
    version: VersionKey | None


@attrs.frozen
class SessionsExpired(Event):
    KIND = "session.expired"
    LEVEL = logging.WARNING
    count: int
    reason: str  # idle (no generation for idle_ttl) or lease (not renewed in time)
    sessions: tuple[str, ...]  # the first few


@attrs.frozen
class RequestDispatched(Event):
    """One generation admitted (never logged at INFO: the lag histogram's source)."""

    KIND = "request.dispatched"
    LEVEL = logging.DEBUG
    version: VersionKey
    lag: int


@attrs.frozen
class ProvenanceMismatched(Event):
    """A turn's engine stamp did not attest the session's binding (docs/provenance.md, "Stamp"): the
    turn raised ``ProvenanceMismatch``. ``stamp`` is what the engine said (None: no stamp)."""

    KIND = "provenance.mismatch"
    LEVEL = logging.WARNING
    session: str
    version: VersionKey
    engine: str
    reason: str
    stamp: "dict[str, object] | None" = None


# -- versions and reclaims --------------------------------------------------------------------

@attrs.frozen
class VersionRetired(Event):
    KIND = "version.retired"
    version: VersionKey
    by: VersionKey


@attrs.frozen
class ReclaimClaimed(Event):
    KIND = "reclaim.claimed"
    version: VersionKey
    reclaim_id: str


@attrs.frozen
class VersionUnloaded(Event):
    KIND = "version.unloaded"
    version: VersionKey
    engine: str


@attrs.frozen
class VersionReclaimed(Event):
    KIND = "version.reclaimed"
    version: VersionKey
    seconds: float  # from the claim to the last engine's unload (as this process saw it)


@attrs.frozen
class OrphanFound(Event):
    KIND = "orphan.found"
    LEVEL = logging.WARNING
    engine: str
    adapter: str
    action: str


@attrs.frozen
class OrphanFreed(Event):
    KIND = "orphan.freed"
    engine: str
    adapter: str


# -- engines and the reconciler ---------------------------------------------------------------

@attrs.frozen
class EngineRestarted(Event):
    KIND = "engine.restarted"
    LEVEL = logging.WARNING
    engine: str
    previous: str | None
    incarnation: str


@attrs.frozen
class EngineReprovisioned(Event):
    KIND = "engine.reprovisioned"
    engine: str
    version: VersionKey


@attrs.frozen
class EngineJoining(Event):
    """An engine added to a running fleet: it takes traffic once it holds every version in use."""

    KIND = "engine.joining"
    engine: str
    incarnation: str
    membership: str


@attrs.frozen
class EngineDraining(Event):
    KIND = "engine.draining"
    engine: str


@attrs.frozen
class EngineDrained(Event):
    KIND = "engine.drained"
    engine: str
    seconds: float
    sessions_moved: int


@attrs.frozen
class EngineRemoved(Event):
    KIND = "engine.removed"
    engine: str
    reachable: bool


@attrs.frozen
class HealthChanged(Event):
    """A reconcile pass found other blockers than the pass before: what blocks the deployment now
    (each ``"<kind> <subject>: <detail>"``; none when healthy) and what is worth knowing."""

    KIND = "health.changed"
    healthy: bool
    blockers: tuple[str, ...]
    notes: tuple[str, ...] = ()


@attrs.frozen
class ReconcilePassed(Event):
    KIND = "reconcile.pass"
    LEVEL = logging.DEBUG
    seconds: float
    ok: bool
    blockers: int
    # what the pass found (lorapub.health.Health, with the registry's fleet view) and the
    # sessions open in this process: the gauges' source, never logged
    health: object = attrs.field(default=None, metadata={"log": False})
    sessions_here: int = attrs.field(default=0, metadata={"log": False})
    groups_here: int = attrs.field(default=0, metadata={"log": False})


@attrs.frozen
class RegistryDecided(Event):
    """One registry command answered (its latency; never logged at INFO)."""

    KIND = "registry.decision"
    LEVEL = logging.DEBUG
    command: str
    seconds: float
    outcome: str  # "ok" or the typed error's code


#: Every event kind, for the docs' table and the tests that check it.
KINDS: tuple[type[Event], ...] = (
    PublishBegun, PublishWaiting, EngineReady, PublishCommitted, PublishFailed, PublishSuperseded, PublishProgress,
    PublishNumericMismatch, VersionSuspected,
    SessionBound, SessionRebound, SessionStale, SessionsExpired, RequestDispatched, VersionRetired, ReclaimClaimed,
    VersionUnloaded, VersionReclaimed, OrphanFound, OrphanFreed, EngineRestarted, EngineReprovisioned,
    EngineJoining, EngineDraining, EngineDrained, EngineRemoved, HealthChanged, ReconcilePassed, RegistryDecided,
    ProvenanceMismatched,
)
