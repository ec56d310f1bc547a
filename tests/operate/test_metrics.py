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
    """name -> (type, label names), from the registry's own description of every family."""
    out = {}
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = family.type
    return out


def test_the_registry_series_documented_are_the_ones_exported():
    registry = prometheus_client.CollectorRegistry()
    Metrics(registry)
    documented = _documented("Registry series")
    exported = _exported(registry)
    assert set(documented) == set(exported), (set(documented) ^ set(exported))
    assert {n: t for n, (t, _) in documented.items()} == exported
    spec = {f"lorapub_{name}" + ("_total" if kind == "counter" else ""): labels
            for _, kind, name, labels, _, _ in SERIES}
    assert {n: labels for n, (_, labels) in documented.items()} == spec
    assert not any(label in ("session", "session_id", "request", "token") for labels in spec.values() for label in labels)


def test_the_engine_series_documented_are_the_ones_exported():
    metrics_module = pytest.importorskip("lorapub.sglang_patch.metrics")
    registry = prometheus_client.CollectorRegistry()
    metrics_module.EngineMetrics(registry)
    documented = _documented("Engine series")
    exported = _exported(registry)
    assert documented and set(documented) == set(exported), (set(documented) ^ set(exported))


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
    assert _value(registry, "lorapub_dispatch_version_lag_count") == 2
    assert _value(registry, "lorapub_dispatch_version_lag_bucket", le="0.0") == 1  # the first turn: lag 0
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
