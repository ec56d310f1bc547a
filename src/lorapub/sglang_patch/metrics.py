"""lorapub's engine series on SGLang's own ``/metrics`` (``--enable-metrics``): what the staging holds and
its managed adapters, read at scrape time; bytes received, attempts begun and ended, staged and prepared
loads, counted where they happen (the scheduler's through SGLang's multiprocess folder). ``prometheus_client``
is optional and imported only once SGLang serves ``/metrics``: without it, or without the flag, nothing is
registered. Labels are bounded: phases, outcomes, transports, managed adapter names; never a session.
See docs/metrics.md, "Engine series".
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator

from lorapub.core.staging import machine
from lorapub.core.staging import messages as m
from lorapub.sglang_patch.staging.engine import managed_prefix_of

__all__ = [
    "ENDED", "INSTALL_BUCKETS", "LOAD_BUCKETS", "PREFIX", "PREPARED_OUTCOMES", "TRANSPORTS", "EngineMetrics",
    "engine_series", "for_process", "for_scheduler", "serve_engine_series",
]

logger = logging.getLogger("lorapub.sglang_patch.metrics")

PREFIX = "lorapub_engine_"
#: Bytes arrive over these transports (the ``transport`` label).
TRANSPORTS = ("http", "shm", "torch")
#: How an attempt leaves the staging, by the command that freed it (the ``outcome`` label).
ENDED = {m.Discard: "cleaned_up", m.Forget: "released", m.Sweep: "aged_out", m.Abandon: "abandoned",
         m.Close: "closed"}
#: A prepared load: installed as prepared; SGLang's own load after the preparation failed; SGLang's load failed.
PREPARED_OUTCOMES = ("prepared", "failed")
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: The scheduler thread's share of a prepared load: a few milliseconds when it works.
INSTALL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 5.0)

# The gauges read from the live staging and engine at scrape time: name, help, label names.
_GAUGES = (
    ("staged_bytes", "Bytes the staged attempts of this engine hold (buckets received, not yet loaded).", ()),
    ("staged_reserved_bytes", "Bytes attempts still receiving may yet take (the byte budget counts them).", ()),
    ("staged_budget_bytes", "The staging's byte budget (LORAPUB_MAX_STASH_BYTES); absent when unbounded.", ()),
    ("attempts", "Staged attempts in this engine by phase.", ("phase",)),
    ("managed_adapters", "Adapters under lorapub's managed prefix registered in this engine.", ()),
    ("adapter_refs", "Requests in flight on each managed adapter (SGLang's own LoRA ref count).", ("adapter",)),
)


class _Live:
    """The gauges, read from a staging (and its engine's adapters) each time they are collected."""

    def __init__(self) -> None:
        self.staging: Any = None

    def describe(self) -> Iterator[Any]:
        return self._families(None)

    def collect(self) -> Iterator[Any]:
        return self._families(self.staging)

    def _families(self, staging: Any) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families = {name: GaugeMetricFamily(PREFIX + name, text, labels=list(labels)) for name, text, labels in _GAUGES}
        if staging is not None:
            state = staging.state
            families["staged_bytes"].add_metric([], state.held_bytes)
            families["staged_reserved_bytes"].add_metric([], state.reserved_bytes)
            if state.max_bytes is not None:
                families["staged_budget_bytes"].add_metric([], state.max_bytes)
            phases = {phase.value: 0 for phase in machine.Phase}
            for attempt in state.attempts.values():
                phases[attempt.phase.value] += 1
            for phase, n in phases.items():
                families["attempts"].add_metric([phase], n)
            self._adapters(staging, families)
        yield from families.values()

    @staticmethod
    def _adapters(staging: Any, families: dict[str, Any]) -> None:
        try:
            adapters = staging.hooks.adapters()
            prefix = managed_prefix_of(staging.hooks)
        except Exception as e:  # noqa: BLE001 - no engine yet (the server starts): no samples this scrape
            logger.debug("lorapub: engine adapters unreadable for /metrics: %s", e)
            return
        managed = {name: entry for name, entry in adapters.items() if prefix and name.startswith(prefix)}
        families["managed_adapters"].add_metric([], len(managed))
        for name, entry in sorted(managed.items()):
            if entry.get("refs") is not None:
                families["adapter_refs"].add_metric([name], entry["refs"])


class EngineMetrics:
    """Every engine series, registered on ``registry`` (default: one of its own, never prometheus_client's
    global one) when made.

    :meth:`watch` points the gauges at a staging (and counts what it does); :meth:`prepared` counts one
    prepared load. ``prometheus_client`` must be importable."""

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client as pc

        self.registry = pc.CollectorRegistry() if registry is None else registry
        self.live = _Live()
        self.registry.register(self.live)

        def counter(name: str, text: str, labels: tuple[str, ...] = (), values: tuple[str, ...] = ()) -> Any:
            made = pc.Counter(PREFIX + name, text, labels, registry=self.registry)
            for value in values:  # every bounded label value present from the start, at 0
                made.labels(value)
            return made

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Any:
            return pc.Histogram(PREFIX + name, text, buckets=buckets, registry=self.registry)

        self.attempts_begun = counter("attempts_begun_total", "Staged attempts begun in this engine.")
        self.attempts_ended = counter("attempts_ended_total", "Staged attempts freed, by how they ended.",
                                      ("outcome",), tuple(ENDED.values()))
        self.received_bytes = counter("received_bytes_total", "Bucket bytes stored by the staging, by transport.",
                                      ("transport",), TRANSPORTS)
        self.stage_loads = counter("stage_loads_total", "Loads of staged adapters by an end, by outcome.",
                                   ("outcome",), ("loaded", "failed"))
        self.stage_load_seconds = histogram("stage_load_seconds", "Seconds an end's load of a staged adapter took "
                                            "(its buckets verified to the adapter registered).", LOAD_BUCKETS)
        self.prepared_loads = counter("prepared_loads_total", "Adapter loads through the scheduler's preparer, "
                                      "by outcome.", ("outcome",), PREPARED_OUTCOMES)
        self.prepared_load_seconds = histogram("prepared_load_seconds", "Seconds from a load reaching the "
                                               "scheduler to its reply (preparation and install).", LOAD_BUCKETS)
        self.prepared_install_seconds = histogram("prepared_install_seconds", "Seconds the scheduler thread "
                                                  "spent installing a prepared load (decoding stops).",
                                                  INSTALL_BUCKETS)
        self._warned = False

    def watch(self, staging: Any) -> "EngineMetrics":
        """Read the gauges from ``staging`` and count what it does from now on."""
        self.live.staging = staging
        staging.metrics = self
        return self

    def observe(self, before: machine.StagingState, command: Any, out: machine.Outcome) -> None:
        """One command the staging's machine handled (``before``: the state it was sent in). Never raises."""
        try:
            self._observe(before, command, out)
        except Exception as e:  # noqa: BLE001 - a series must never fail a publish
            if not self._warned:
                self._warned = True
                logger.warning("lorapub: engine series missed %s: %r", type(command).__name__, e)

    def _observe(self, before: machine.StagingState, command: Any, out: machine.Outcome) -> None:
        kind, reply = type(command), out.reply
        if kind is m.Begin and isinstance(reply, m.Accepted) and not reply.duplicate:
            self.attempts_begun.inc()
        elif kind is m.Stored and isinstance(reply, m.Accepted):
            transport = out.state.attempts[command.token].transport
            self.received_bytes.labels(transport).inc(command.nbytes)
        elif kind is m.Loaded and command.token in before.attempts:
            self.stage_loads.labels("loaded").inc()
            self.stage_load_seconds.observe(max(0.0, command.receipt.load_s))
        elif kind is m.LoadFailed and command.token in before.attempts:
            self.stage_loads.labels("failed").inc()
        outcome = ENDED.get(kind)
        if outcome is not None:
            gone = sum(1 for token in before.attempts if token not in out.state.attempts)
            if gone:
                self.attempts_ended.labels(outcome).inc(gone)

    def prepared(self, outcome: str, seconds: float, install_seconds: float) -> None:
        """One load the scheduler's preparer answered (``outcome``: one of :data:`PREPARED_OUTCOMES`)."""
        self.prepared_loads.labels(outcome).inc()
        self.prepared_load_seconds.observe(max(0.0, seconds))
        self.prepared_install_seconds.observe(max(0.0, install_seconds))


def engine_series(registry: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name as queried, type, label names) of every ``lorapub_engine_`` series ``registry`` collects,
    sorted; a counter is named with its ``_total``. ``engine_series(EngineMetrics(CollectorRegistry()).registry)``
    lists them all."""
    found = set()
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        labels |= set(getattr(family, "_labelnames", ()))  # a family made without samples keeps its names here
        found.add((name, family.type, tuple(sorted(labels))))
    return sorted(found)


_PROCESS: EngineMetrics | None = None
_PROCESS_LOCK = threading.Lock()


def for_process() -> EngineMetrics | None:
    """This process's engine series, made once on a registry of their own (SGLang's ``/metrics`` reads the
    counters from its multiprocess folder); None without ``prometheus_client``."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            try:
                import prometheus_client

                _PROCESS = EngineMetrics(prometheus_client.CollectorRegistry())
            except ImportError:
                return None
            except Exception as e:  # noqa: BLE001 - the engine serves on without its series
                logger.warning("lorapub: the engine series could not be made: %r", e)
                return None
        return _PROCESS


def for_scheduler(scheduler: Any) -> EngineMetrics | None:
    """The series a scheduler process counts prepared loads in, when SGLang runs with ``--enable-metrics``
    (its metrics reporter says so in both releases); None otherwise."""
    reporter = getattr(scheduler, "metrics_reporter", None)
    if not getattr(reporter, "enable_metrics", False):
        return None
    return for_process()


def serve_engine_series(stock: Callable[[Any], None], staging: Any) -> Callable[[Any], None]:
    """SGLang's ``add_prometheus_middleware`` (called only with ``--enable-metrics``, once the multiprocess
    folder is set), followed by lorapub's: the ``/metrics`` it mounts also serves the gauges of ``staging``,
    and the staging counts what it does. Both forms of the patch rebind SGLang's name to this."""
    if getattr(stock, "__lorapub_engine_series__", False):
        return stock

    def add_prometheus_middleware(app: Any) -> None:
        stock(app)
        try:
            _serve(app, staging)
        except Exception as e:  # noqa: BLE001 - SGLang's own /metrics stays as it is
            logger.warning("lorapub: the engine series are not on /metrics: %r", e)

    setattr(add_prometheus_middleware, "__wrapped__", stock)
    setattr(add_prometheus_middleware, "__lorapub_engine_series__", True)
    add_prometheus_middleware.__doc__ = stock.__doc__
    return add_prometheus_middleware


def _serve(app: Any, staging: Any) -> EngineMetrics | None:
    metrics = for_process()
    if metrics is None:
        logger.warning("lorapub: prometheus_client is not importable; /metrics carries no lorapub series")
        return None
    from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess

    mount = next(r for r in reversed(app.routes) if getattr(r, "path", None) == "/metrics")
    metrics.watch(staging)
    # What SGLang mounts (every process's series from the multiprocess folder) and the staging's gauges,
    # read from this process at scrape time.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # prometheus_client: unannotated
    registry.register(metrics.live)
    mount.app = mount._base_app = make_asgi_app(registry=registry)
    return metrics
