"""The series docs/metrics.md lists are the ones the code exports, and they move with what happens."""

from __future__ import annotations

import pathlib
import re

import pytest

from lorapub import Deployment
from lorapub.testing import MemoryEngine, lora_snapshot

prometheus_client = pytest.importorskip("prometheus_client")
from lorapub.adapters.prometheus import SERIES, Metrics  # noqa: E402

DOC = pathlib.Path(__file__).parents[2] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(?P<name>[a-z_]+)` \| (?P<type>gauge|counter|histogram) \| (?P<labels>[^|]+) \| (?P<meaning>[^|]+) \|$")
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def _documented(section: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    text = DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            labels = tuple(re.findall(r"`([a-z_]+)`", m["labels"]))
            rows[m["name"]] = (m["type"], labels)
    return rows


def _exported(registry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name as queried -> (type, label names), from the registry's own description of every family."""
    out = {}
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for sample in family.samples for k in sample.labels if k != "le"}
        labels |= set(getattr(family, "_labelnames", ()))  # a family made without samples keeps its names here
        out[name] = (family.type, tuple(sorted(labels)))
    return out


def _sorted(rows: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {name: (kind, tuple(sorted(labels))) for name, (kind, labels) in rows.items()}


def _publisher_registry():
    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry)
    for e in metrics.__dict__.values():  # every labelled series with one child, so its samples show its labels
        names = getattr(e, "_labelnames", ())
        if names:
            e.labels(*["x"] * len(names))
    return registry


def test_the_registry_series_documented_are_the_ones_exported():
    documented = _documented("Registry series")
    exported = _exported(_publisher_registry())
    assert _sorted(documented) == exported, set(documented.items()) ^ set(exported.items())
    spec = {f"lorapub_{name}" + ("_total" if kind == "counter" else ""): tuple(sorted(labels))
            for _, kind, name, labels, _, _ in SERIES}
    assert {n: labels for n, (_, labels) in exported.items()} == spec
    assert not any(label in ("session", "session_id", "request", "token") for labels in spec.values() for label in labels)


def test_every_series_is_an_attribute_annotated_with_its_kind():
    """Metrics declares one typed attribute per SERIES entry (what mypy --strict checks its uses against)."""
    annotated = {attr: kind.lower() for attr, kind in Metrics.__annotations__.items()}
    assert annotated == {attr: kind for attr, kind, *_ in SERIES}


def test_the_engine_series_documented_are_the_ones_exported():
    metrics_module = pytest.importorskip("lorapub.sglang_patch.metrics")
    registry = prometheus_client.CollectorRegistry()
    metrics_module.EngineMetrics(registry)
    documented = _documented("Engine series")
    exported = _exported(registry)
    assert documented and _sorted(documented) == exported, set(documented.items()) ^ set(exported.items())


def test_the_status_doc_names_only_series_that_are_exported():
    metrics_module = pytest.importorskip("lorapub.sglang_patch.metrics")
    engine = prometheus_client.CollectorRegistry()
    metrics_module.EngineMetrics(engine)
    exported = set(_exported(_publisher_registry())) | set(_exported(engine))
    for doc in ("operating.md", "metrics.md", "testing.md", "sglang-patch.md"):
        named = set(re.findall(r"`(lorapub_[a-z_]+)`", (DOC.parent / doc).read_text()))
        bases = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in exported else n for n in named}
        assert bases <= exported, (doc, sorted(bases - exported))


def test_both_sides_label_a_transport_with_one_vocabulary():
    from lorapub.adapters.transports import HTTPBytes, SameHostIPC
    from lorapub.runtime.admission import transport_name
    from lorapub.sglang_patch.metrics import TRANSPORTS

    assert transport_name(HTTPBytes()) == "http"
    assert transport_name(SameHostIPC()) == "shm"
    text = DOC.read_text()
    for value in TRANSPORTS:  # the engine side's values, documented for both
        assert text.count(f"`{value}`") >= 2, value


async def test_the_publisher_counts_http_bytes_as_the_engine_does(tmp_path):
    from lorapub.adapters.sglang_wire import SGLangWireEngine
    from lorapub.adapters.transports import HTTPBytes
    from lorapub.testing import SGLangDouble

    double = SGLangDouble("e0")
    double.stash_root = str(tmp_path)
    await double.start()
    registry = prometheus_client.CollectorRegistry()
    try:
        dep = await Deployment({"e0": SGLangWireEngine("e0", double.url)}, epoch=1, transport=HTTPBytes(),
                               reconcile_interval=None, observers=[Metrics(registry)]).start()
        await dep.publish(lora_snapshot(1), "A")
        await dep.close()
    finally:
        await double.stop()
    assert _value(registry, "lorapub_bytes_sent_total", transport="http") == lora_snapshot(1).manifest.total_bytes


def test_metrics_export_on_their_own_registry_without_process_or_created_series():
    prometheus_client.enable_created_metrics()  # prometheus_client's own default, whatever ran before
    kept = Metrics(created=True)  # leaves prometheus_client's setting as it is
    kept.publications.labels("committed").inc()
    assert "lorapub_publications_created" in kept.exposition()[0].decode()
    metrics = Metrics()  # no registry given: one of its own, never the global default
    assert metrics.registry is not prometheus_client.REGISTRY
    metrics.publications.labels("committed").inc()
    text = metrics.exposition()[0].decode()
    assert "lorapub_publications_total" in text
    assert "_created" not in text  # prometheus_client's created series are off
    assert "process_" not in text and "python_" not in text  # no default collectors dragged in
    given = prometheus_client.CollectorRegistry()
    assert Metrics(given).registry is given  # the embedder's registry, when it passes one


def test_the_lag_histogram_has_a_unit():
    from prometheus_client.openmetrics.exposition import generate_latest

    registry = prometheus_client.CollectorRegistry()
    Metrics(registry).dispatch_lag.observe(1)
    text = generate_latest(registry).decode()
    assert "# UNIT lorapub_dispatch_lag_versions versions" in text


def _value(registry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_the_series_move_with_a_publish_bind_retire_reclaim_cycle():
    registry = prometheus_client.CollectorRegistry()
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, reconcile_interval=None, observers=[Metrics(registry)]).start()
    await dep.publish(lora_snapshot(1), "A")
    session = dep.session("s1")
    await session.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    await session.generate(GEN)  # still on A: lag 1
    await dep.reconcile(wait=0)
    assert _value(registry, "lorapub_publications_total", outcome="committed") == 2
    assert _value(registry, "lorapub_versions", state="RETIRED") == 1
    assert _value(registry, "lorapub_versions", state="PUBLISHED") == 1
    assert _value(registry, "lorapub_slots_used") == 2 and _value(registry, "lorapub_slots_free") == 0
    assert _value(registry, "lorapub_version_session_refs", version="1-A") == 1
    assert _value(registry, "lorapub_sessions_open") == 1
    assert _value(registry, "lorapub_dispatch_lag_versions_count") == 2
    assert _value(registry, "lorapub_dispatch_lag_versions_bucket", le="0.0") == 1  # the first turn: lag 0
    total = lora_snapshot(1).manifest.total_bytes + lora_snapshot(2).manifest.total_bytes
    assert _value(registry, "lorapub_bytes_sent_total", transport="inline") == 2 * total  # both engines
    assert _value(registry, "lorapub_publication_phase_seconds_count", phase="transfer") == 2
    assert _value(registry, "lorapub_engines", life="up") == 2
    assert _value(registry, "lorapub_registry_decision_seconds_count", command="Commit") == 2
    await session.close()
    await dep.settle(30)
    await dep.reconcile(wait=0)
    assert _value(registry, "lorapub_reclaim_seconds_count") == 1
    assert _value(registry, "lorapub_version_session_refs", version="1-A") == 0  # left the series
    assert registry.get_sample_value("lorapub_version_session_refs", {"version": "1-A"}) is None
    assert _value(registry, "lorapub_slots_used") == 1
    await dep.close()


def test_metrics_without_prometheus_client_says_what_to_install(monkeypatch):
    import lorapub.adapters.prometheus as module
    from lorapub.errors import InvalidInput

    monkeypatch.setattr(module, "_prom", None)
    with pytest.raises(InvalidInput, match=r"lorapub\[metrics\]"):
        module.Metrics()


def test_a_second_metrics_on_one_registry_is_a_typed_refusal_that_leaves_the_first_intact():
    from prometheus_client import CollectorRegistry

    from lorapub.adapters.prometheus import Metrics
    from lorapub.errors import InvalidInput

    registry = CollectorRegistry()
    first = Metrics(registry)
    with pytest.raises(InvalidInput, match="same Metrics instance") as err:
        Metrics(registry)
    assert err.value.code == "INVALID_INPUT"
    assert b"lorapub_slots_free" in first.exposition()[0]
    assert Metrics(registry, namespace="other").registry is registry  # another namespace is allowed
