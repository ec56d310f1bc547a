"""Prometheus series for a deployment: :class:`Metrics` is an observer of :mod:`lorapub.events`
(counters and histograms move as decisions happen; gauges are set from each reconcile pass).
Needs ``prometheus-client`` (``pip install 'lorapub[metrics]'``). Labels are bounded.
See docs/metrics.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorapub.errors import InvalidInput
from lorapub.events import (
    Event,
    EngineRestarted,
    OrphanFound,
    OrphanFreed,
    PublishCommitted,
    PublishFailed,
    PublishProgress,
    PublishSuperseded,
    ReconcilePassed,
    RegistryDecided,
    RequestDispatched,
    SessionRebound,
    SessionsExpired,
    SessionStale,
    VersionReclaimed,
)

try:
    import prometheus_client as _prom
except ImportError:  # the optional extra is not installed
    _prom = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.metrics import MetricWrapperBase

__all__ = ["Metrics", "SERIES"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
_LAG = (0, 1, 2, 3, 4, 6, 8, 16, 32)
_STATES = ("LOADING", "PUBLISHED", "RETIRED", "RECLAIMING", "ABORTED")

#: Every series: (attribute, type, name under the namespace, labels, meaning, histogram buckets).
#: docs/metrics.md lists the same (a test holds them together); a counter is exported as ``<name>_total``.
#: A name ending in a unit (``_seconds``, ``_bytes``, ``_versions``) declares it (OpenMetrics ``# UNIT``).
SERIES: tuple[tuple[str, str, str, tuple[str, ...], str, tuple[float, ...] | None], ...] = (
    ("versions", "gauge", "versions", ("state",), "Versions holding a slot, by state", None),
    ("slots_used", "gauge", "slots_used", (), "Managed slots held", None),
    ("slots_free", "gauge", "slots_free", (), "Managed slots free", None),
    ("session_refs", "gauge", "version_session_refs", ("version",),
     "Session refs on each version holding a slot (at most capacity versions at a time)", None),
    ("sessions_open", "gauge", "sessions_open", (), "Open sessions of this process", None),
    ("groups_open", "gauge", "groups_open", (), "Session groups with an open member in this process", None),
    ("dispatch_lag", "histogram", "dispatch_lag_versions", (),
     "Versions (commits) behind the default of each dispatched request", _LAG),
    ("publications", "counter", "publications", ("outcome",),
     "Publications ended, by outcome (committed, superseded, or the lowercased error code)", None),
    ("publication_seconds", "histogram", "publication_seconds", (), "Publish call to commit", _SECONDS),
    ("phase_seconds", "histogram", "publication_phase_seconds", ("phase",),
     "Publication phases: reserve, begin, transfer, end, commit", _SECONDS),
    ("bytes_sent", "counter", "bytes_sent", ("transport",),
     "Bucket bytes confirmed by engines, by transport: http, shm, torch (inline: in-process engines)", None),
    ("reclaim_seconds", "histogram", "reclaim_seconds", (), "Reclaim claimed to the last engine's unload", _SECONDS),
    ("reclaims_waiting", "gauge", "reclaims_waiting", (), "Versions retired and unused, or being unloaded", None),
    ("engines", "gauge", "engines", ("life",), "Engines by life: up, unreachable, reprovisioning", None),
    ("restarts", "counter", "engine_restarts", (), "Engine restarts detected", None),
    ("orphans_found", "counter", "orphans_found", (), "Orphan adapters or staged attempts found", None),
    ("orphans_freed", "counter", "orphans_freed", (), "Orphans unloaded or cleaned", None),
    ("reconcile_seconds", "histogram", "reconcile_pass_seconds", (), "Reconcile pass duration", _SECONDS),
    ("reconcile_failures", "counter", "reconcile_failures", (), "Reconcile passes that failed", None),
    ("decision_seconds", "histogram", "registry_decision_seconds", ("command",),
     "Registry decision latency, by command (one of the registry's command types)", _FAST),
    ("sessions_ended", "counter", "sessions_ended", ("reason",),
     "Sessions that lost their binding: expired_idle, expired_lease, stale", None),
    ("rebinds", "counter", "session_rebinds", (), "Sessions moved to the default at a turn boundary", None),
)


_UNITS = ("seconds", "bytes", "versions")


def _unit(name: str) -> str:
    return next((u for u in _UNITS if name.endswith("_" + u)), "")


class Metrics:
    """Observer that keeps lorapub's registry-side series: ``Deployment(observers=[Metrics()])``.

    ``registry``: the ``prometheus_client`` registry to register with. Default: one of its own, so
    lorapub brings no series of the process (``process_*``, ``python_*``) and adds none to the global
    one; to serve them on an existing ``/metrics``, pass that registry
    (``Metrics(prometheus_client.REGISTRY)``). A deployment's status endpoint serves it at ``/metrics``.

    ``created``: prometheus_client also exports a ``_created`` series beside every counter and
    histogram, unless switched off for the process; False (default) switches it off the
    prometheus_client way (``disable_created_metrics()``, as ``PROMETHEUS_DISABLE_CREATED_SERIES=True``
    does), True leaves that setting as it is."""

    # One attribute per entry of SERIES (set in __init__), of the type its kind names.
    versions: Gauge
    slots_used: Gauge
    slots_free: Gauge
    session_refs: Gauge
    sessions_open: Gauge
    groups_open: Gauge
    dispatch_lag: Histogram
    publications: Counter
    publication_seconds: Histogram
    phase_seconds: Histogram
    bytes_sent: Counter
    reclaim_seconds: Histogram
    reclaims_waiting: Gauge
    engines: Gauge
    restarts: Counter
    orphans_found: Counter
    orphans_freed: Counter
    reconcile_seconds: Histogram
    reconcile_failures: Counter
    decision_seconds: Histogram
    sessions_ended: Counter
    rebinds: Counter

    def __init__(self, registry: CollectorRegistry | None = None, *, namespace: str = "lorapub",
                 created: bool = False) -> None:
        if _prom is None:
            raise InvalidInput("lorapub.adapters.prometheus.Metrics needs prometheus-client: "
                               "pip install 'lorapub[metrics]'")
        if not created:
            # unannotated in prometheus_client 0.26
            _prom.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else _prom.CollectorRegistry()
        self.namespace = namespace
        kinds: dict[str, type[MetricWrapperBase]] = {
            "gauge": _prom.Gauge, "counter": _prom.Counter, "histogram": _prom.Histogram}
        made: list[MetricWrapperBase] = []
        for attr, kind, name, labels, meaning, buckets in SERIES:
            extra: dict[str, Any] = {"buckets": buckets} if buckets else {}
            if _unit(name):
                extra["unit"] = _unit(name)
            try:
                made.append(kinds[kind](name, meaning, list(labels), namespace=namespace, registry=self.registry,
                                        **extra))
            except ValueError as e:  # prometheus_client's "Duplicated timeseries": a second Metrics() here
                for collector in made:  # leave the registry as it was
                    self.registry.unregister(collector)
                raise InvalidInput(
                    f"lorapub's series are already registered in this prometheus registry ({e}): give every "
                    "deployment of the process the same Metrics instance, or leave registry= out (a registry of "
                    "its own), or give it another namespace=") from None
            setattr(self, attr, made[-1])
        self._sent: dict[tuple[str, str], int] = {}  # (version, engine) -> bytes counted so far

    def exposition(self) -> tuple[bytes, str]:
        """The text a ``/metrics`` route serves, and its content type."""
        return _prom.generate_latest(self.registry), _prom.CONTENT_TYPE_LATEST

    def __call__(self, event: Event) -> None:
        handler = getattr(self, f"_on_{type(event).__name__}", None)
        if handler is not None:
            handler(event)

    def _on_RegistryDecided(self, e: RegistryDecided) -> None:
        self.decision_seconds.labels(e.command).observe(e.seconds)

    def _on_RequestDispatched(self, e: RequestDispatched) -> None:
        self.dispatch_lag.observe(e.lag)

    def _on_PublishProgress(self, e: PublishProgress) -> None:
        key = (str(e.version), e.engine)
        delta = e.bytes_sent - self._sent.get(key, 0)
        if delta > 0:
            self.bytes_sent.labels(e.transport).inc(delta)
            self._sent[key] = e.bytes_sent

    def _forget(self, version: object) -> None:
        for key in [k for k in self._sent if k[0] == str(version)]:
            del self._sent[key]

    def _on_PublishCommitted(self, e: PublishCommitted) -> None:
        self.publications.labels("committed").inc()
        self.publication_seconds.observe(e.seconds)
        for phase, seconds in e.phases.items():
            self.phase_seconds.labels(phase).observe(seconds)
        self._forget(e.version)

    def _on_PublishFailed(self, e: PublishFailed) -> None:
        self.publications.labels(e.code.lower()).inc()
        self._forget(e.version)

    def _on_PublishSuperseded(self, e: PublishSuperseded) -> None:
        self.publications.labels("superseded").inc()

    def _on_VersionReclaimed(self, e: VersionReclaimed) -> None:
        self.reclaim_seconds.observe(e.seconds)

    def _on_EngineRestarted(self, e: EngineRestarted) -> None:
        self.restarts.inc()

    def _on_OrphanFound(self, e: OrphanFound) -> None:
        self.orphans_found.inc()

    def _on_OrphanFreed(self, e: OrphanFreed) -> None:
        self.orphans_freed.inc()

    def _on_SessionsExpired(self, e: SessionsExpired) -> None:
        self.sessions_ended.labels(f"expired_{e.reason}").inc(e.count)

    def _on_SessionStale(self, e: SessionStale) -> None:
        self.sessions_ended.labels("stale").inc()

    def _on_SessionRebound(self, e: SessionRebound) -> None:
        self.rebinds.inc()

    def _on_ReconcilePassed(self, e: ReconcilePassed) -> None:
        self.reconcile_seconds.observe(e.seconds)
        if not e.ok:
            self.reconcile_failures.inc()
        self.sessions_open.set(e.sessions_here)
        self.groups_open.set(e.groups_here)
        fleet = getattr(e.health, "fleet", None)
        if fleet is None:
            return
        counts = dict.fromkeys(_STATES, 0)
        self.session_refs.clear()  # versions that left their slot leave the series
        for slot in fleet.slots:
            counts[slot.state.value] = counts.get(slot.state.value, 0) + 1
            self.session_refs.labels(str(slot.version)).set(slot.session_refs)
        for state, n in counts.items():
            self.versions.labels(state).set(n)
        self.slots_used.set(len(fleet.slots))
        self.slots_free.set(max(0, fleet.capacity - len(fleet.slots)))
        self.reclaims_waiting.set(len(fleet.reclaimable) + len(fleet.reclaiming))
        blockers = getattr(e.health, "blockers", ())
        unreachable = {b.subject for b in blockers if b.kind == "engine_unreachable"}
        missing = {engine for engine, _ in fleet.missing} - unreachable
        self.engines.labels("unreachable").set(len(unreachable))
        self.engines.labels("reprovisioning").set(len(missing))
        self.engines.labels("up").set(len(set(fleet.engines) - unreachable - missing))
