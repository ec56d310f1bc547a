"""lorapub's engine series (``lorapub.sglang_patch.metrics``): they move with what the staging and the
preparer do, on each release's own LoRA code; they reach SGLang's own ``/metrics`` (the release's own
``add_prometheus_middleware``, multiprocess folder included); without ``--enable-metrics`` or without
``prometheus_client`` nothing is registered and nothing breaks.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
import types

import pytest

from lorapub.sglang_patch import metrics as em
from lorapub.sglang_patch import targets
from lorapub.testing.fixtures import lora_snapshot
from tests import sglang_real
from tests.sglang_patch import harness
from tests.sglang_patch.test_auth_levels import asgi_get, sglang_auth_importable  # noqa: F401 - a fixture
from tests.sglang_patch.test_engine_staging import LIFE, begin_body, bf16_snapshot, chunks_of, new_staging, params, \
    raw_bucket
from tests.sglang_patch.test_lifecycle_gaps import RELEASES, patched_root, root_of

prometheus_client = pytest.importorskip("prometheus_client")
CollectorRegistry = prometheus_client.CollectorRegistry
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "metrics.md")


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels or None)


def phases(registry):
    return {p: value(registry, "lorapub_engine_attempts", phase=p) for p in ("receiving", "loading", "loaded", "failed")}


# -- every series, as documented ------------------------------------------------------------------
def documented_series():
    text = open(DOCS).read().split("## Engine series", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            labels = () if cells[2] == "—" else tuple(sorted(c.strip(" `") for c in cells[2].split(",")))
            rows.append((cells[0].strip("`"), cells[1], labels))
    return sorted(rows)


def test_every_series_is_registered_when_made_and_is_the_documented_one():
    series = em.engine_series(em.EngineMetrics(CollectorRegistry()).registry)
    assert series == documented_series()
    assert len(series) == 14 and all(name.startswith("lorapub_engine_") for name, _, _ in series)
    for name, _, labels in series:  # bounded labels: never a session, request or attempt
        assert not {"session", "session_id", "rid", "token", "attempt"} & set(labels), name


# -- the staging, on the release's own LoRA code -----------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
async def test_the_staging_series_follow_an_attempt_from_begin_to_cleanup(release, tmp_path):
    tm = harness.build_runtime_patched(root_of(release))()
    staging = new_staging(tm, tmp_path)
    registry = CollectorRegistry()
    em.EngineMetrics(registry).watch(staging)
    assert value(registry, "lorapub_engine_staged_bytes") == 0 and value(registry, "lorapub_engine_managed_adapters") == 0
    snapshot = bf16_snapshot(3)
    token, plan, body = begin_body(snapshot, "A", "tensors")
    sizes = [b.nbytes for b in plan.buckets]
    assert len(sizes) > 1
    assert (await staging.begin(body))[0] == 200
    assert (await staging.begin(body))[1]["duplicate"]  # a duplicate begin is not a second attempt
    assert value(registry, "lorapub_engine_attempts_begun_total") == 1
    assert phases(registry) == {"receiving": 1, "loading": 0, "loaded": 0, "failed": 0}
    assert value(registry, "lorapub_engine_staged_reserved_bytes") == sum(sizes)
    blob = raw_bucket(snapshot, plan.buckets[0])
    assert (await staging.receive(params(token, 0), chunks_of(blob), len(blob)))[0] == 200
    assert value(registry, "lorapub_engine_staged_bytes") == sizes[0]
    assert value(registry, "lorapub_engine_staged_reserved_bytes") == sum(sizes) - sizes[0]
    assert value(registry, "lorapub_engine_received_bytes_total", transport="http") == sizes[0]
    await staging.receive(params(token, 0), chunks_of(blob), len(blob))  # a duplicate stores nothing
    assert value(registry, "lorapub_engine_received_bytes_total", transport="http") == sizes[0]
    for b in plan.buckets[1:]:
        blob = raw_bucket(snapshot, b)
        assert (await staging.receive(params(token, b.index), chunks_of(blob), len(blob)))[0] == 200
    assert value(registry, "lorapub_engine_staged_bytes") == sum(sizes) == staging.report()["bytes"]
    assert value(registry, "lorapub_engine_received_bytes_total", transport="http") == sum(sizes)
    assert value(registry, "lorapub_engine_received_bytes_total", transport="shm") == 0
    status, receipt = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200, receipt
    name = body["lora_name"]
    assert value(registry, "lorapub_engine_stage_loads_total", outcome="loaded") == 1
    assert value(registry, "lorapub_engine_stage_load_seconds_count") == 1
    assert value(registry, "lorapub_engine_stage_load_seconds_sum") == pytest.approx(receipt["timings"]["load"], abs=1e-6)
    assert value(registry, "lorapub_engine_staged_bytes") == 0  # the engine holds the adapter now
    assert phases(registry) == {"receiving": 0, "loading": 0, "loaded": 1, "failed": 0}
    assert value(registry, "lorapub_engine_managed_adapters") == 1
    assert value(registry, "lorapub_engine_adapter_refs", adapter=name) == 0
    # a request in flight on the adapter holds SGLang's own ref: the gauge reads it at scrape time
    hold = asyncio.Event()
    request = asyncio.create_task(tm.generate("r1", name, hold=hold))
    for _ in range(50):
        await asyncio.sleep(0)
        if value(registry, "lorapub_engine_adapter_refs", adapter=name) == 1:
            break
    assert value(registry, "lorapub_engine_adapter_refs", adapter=name) == 1 == tm.refs(name)
    hold.set()
    await request
    await tm.settle()
    assert value(registry, "lorapub_engine_adapter_refs", adapter=name) == 0
    status, cleaned = await staging.cleanup({"token": body["token"]})
    assert status == 200 and cleaned["loaded"] is not None
    assert value(registry, "lorapub_engine_attempts_ended_total", outcome="cleaned_up") == 1
    assert phases(registry) == {"receiving": 0, "loading": 0, "loaded": 0, "failed": 0}
    reclaim = harness.Request(headers={"X-Lorapub-Reclaim-Id": "c-1"})
    assert (await tm.unload_lora_adapter(harness.UnloadLoRAAdapterReqInput(lora_name=name), reclaim)).success
    assert value(registry, "lorapub_engine_managed_adapters") == 0
    assert value(registry, "lorapub_engine_adapter_refs", adapter=name) is None  # a gone adapter leaves no series
    staging.close()
    assert value(registry, "lorapub_engine_attempts_ended_total", outcome="closed") == 0  # nothing was left


async def test_a_failed_load_and_an_aged_out_attempt_are_counted(tmp_path, monkeypatch):
    from lorapub.sglang_patch.staging import engine

    tm = harness.build_runtime_patched(root_of(RELEASES[0]))()
    staging = new_staging(tm, tmp_path)
    registry = CollectorRegistry()
    em.EngineMetrics(registry).watch(staging)
    snapshot = lora_snapshot(5, layers=1, hidden=16, rank=2)
    token, plan, body = begin_body(snapshot, "B", "dir", cap=1 << 20)
    assert (await staging.begin(body))[0] == 200
    blob = bytearray(raw_bucket(snapshot, plan.buckets[0]))
    blob[3] ^= 1  # stored, then refused by its check at end: the load fails, the attempt with it
    assert (await staging.receive(params(token, 0), chunks_of(bytes(blob)), len(blob)))[0] == 200
    assert (await staging.end({"token": body["token"], "incarnation": LIFE}))[0] == 400
    assert value(registry, "lorapub_engine_stage_loads_total", outcome="failed") == 1
    assert value(registry, "lorapub_engine_stage_loads_total", outcome="loaded") == 0
    assert phases(registry)["failed"] == 1 and value(registry, "lorapub_engine_staged_bytes") == len(blob)
    later = engine._now() + staging.idle_timeout + 1
    monkeypatch.setattr(engine, "_now", lambda: later)  # nobody drove it for longer than its idle timeout
    assert await staging.sweep() == [str(token)]
    assert value(registry, "lorapub_engine_attempts_ended_total", outcome="aged_out") == 1
    assert phases(registry)["failed"] == 0 and value(registry, "lorapub_engine_staged_bytes") == 0
    staging.close()


def test_without_metrics_the_staging_counts_nothing_and_registers_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(em, "_PROCESS", None)
    tm = harness.build_runtime_patched(root_of(RELEASES[0]))()
    staging = new_staging(tm, tmp_path)
    assert staging.metrics is None
    snapshot = lora_snapshot(6, layers=1, hidden=16, rank=2)
    _, _, body = begin_body(snapshot, "C", "dir")
    assert asyncio.run(staging.begin(body))[0] == 200
    staging.close()
    assert em._PROCESS is None  # nothing made until SGLang mounts /metrics (it does only with --enable-metrics)
    assert not [f for f in prometheus_client.REGISTRY.collect() if f.name.startswith(em.PREFIX)]
    off = types.SimpleNamespace(metrics_reporter=types.SimpleNamespace(enable_metrics=False))
    assert em.for_scheduler(off) is None and em.for_scheduler(types.SimpleNamespace()) is None
    assert em._PROCESS is None
    on = types.SimpleNamespace(metrics_reporter=types.SimpleNamespace(enable_metrics=True))
    assert em.for_scheduler(on) is em.for_process() is not None


def test_without_prometheus_client_the_patch_serves_on(tmp_path, monkeypatch):
    monkeypatch.setattr(em, "_PROCESS", None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    assert em.for_process() is None
    on = types.SimpleNamespace(metrics_reporter=types.SimpleNamespace(enable_metrics=True))
    assert em.for_scheduler(on) is None
    calls = []
    staging = new_staging(harness.build_runtime_patched(root_of(RELEASES[0]))(), tmp_path)
    em.serve_engine_series(calls.append, staging)("app")
    assert calls == ["app"] and staging.metrics is None  # SGLang's own middleware ran; nothing else
    staging.close()


def test_importing_the_patch_leaves_prometheus_client_to_sglang():
    """SGLang sets PROMETHEUS_MULTIPROC_DIR before its first import of prometheus_client (the mode is
    chosen then): the patch must not import it first."""
    code = ("import sys; import lorapub.sglang_patch, lorapub.sglang_patch.metrics, lorapub.sglang_patch.prepared_load;"
            " sys.exit('prometheus_client' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], env=dict(os.environ)).returncode == 0


# -- the prepared load, on the scheduler's side ---------------------------------------------------------
def test_prepared_loads_are_counted_and_timed_by_outcome():
    from tests.sglang_patch import test_prepared_load as tp

    scheduler_cls, manager_cls = tp.Scheduler, tp.Manager
    scheduler_cls = type("Scheduler", (tp.Scheduler,), {})
    manager_cls = type("Manager", (tp.Manager,), {})
    from lorapub.sglang_patch import prepared_load

    prepared_load.install(scheduler_cls, manager_cls, type("Pool", (tp.Pool,), {}))
    scheduler, manager, preparer = tp.preparing((scheduler_cls, manager_cls))
    registry = CollectorRegistry()
    preparer.metrics = em.EngineMetrics(registry)

    def read_config(ref):
        if ref.lora_id == "nocfg":
            raise OSError("no config")  # the hand-over fails: so does the load (no load on the scheduler thread)
        return tp.Config(ref.lora_path)

    preparer.read_config = read_config
    manager.fail_read.add("/p/bad")  # the helper's preparation fails
    scheduler.process_input_requests([tp.Req("ok"), tp.Req("nocfg"), tp.Req("bad", "/p/bad")])
    tp.run_until(scheduler, 3)
    assert [out["success"] for _, out in scheduler.sent] == [True, False, False]
    assert em.PREPARED_OUTCOMES == ("prepared", "failed")
    assert value(registry, "lorapub_engine_prepared_loads_total", outcome="prepared") == 1
    assert value(registry, "lorapub_engine_prepared_loads_total", outcome="failed") == 2
    assert value(registry, "lorapub_engine_prepared_load_seconds_count") == 3
    assert value(registry, "lorapub_engine_prepared_install_seconds_count") == 3
    total = value(registry, "lorapub_engine_prepared_load_seconds_sum")
    assert 0 < value(registry, "lorapub_engine_prepared_install_seconds_sum") <= total


# -- SGLang's own /metrics ----------------------------------------------------------------------------
def sglang_add_prometheus_middleware(release):
    """The release's own ``add_prometheus_middleware`` (``srt/utils/common.py``), verbatim."""
    from starlette.routing import Mount

    namespace = {"re": re, "Mount": Mount}
    exec(sglang_real.extract(root_of(release), "srt/utils/common.py", "add_prometheus_middleware"), namespace)
    return namespace["add_prometheus_middleware"]


SCHEDULER = """
import types
from lorapub.sglang_patch import metrics
scheduler = types.SimpleNamespace(metrics_reporter=types.SimpleNamespace(enable_metrics=True))
metrics.for_scheduler(scheduler).prepared("prepared", 0.25, 0.003)
"""


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")
async def test_sglangs_own_metrics_route_carries_the_engine_series(release, sglang_auth_importable, tmp_path,
                                                                    monkeypatch):
    """The runtime form rebinds SGLang's ``add_prometheus_middleware``; the ``/metrics`` it mounts then
    serves the staging's gauges (this process) and a scheduler process's prepared loads (multiprocess folder)."""
    fastapi = pytest.importorskip("fastapi")
    from lorapub.sglang_patch import routes

    stock = sglang_add_prometheus_middleware(release)
    tm = harness.build_runtime_patched(root_of(release))()
    sglang_auth_importable(release)
    folder = tmp_path / "prometheus"
    folder.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))  # what SGLang sets with --enable-metrics
    monkeypatch.setenv("LORAPUB_ENGINE_STASH", str(tmp_path / "engine-disk"))
    monkeypatch.setattr(routes, "STAGING", None)
    monkeypatch.setattr(em, "_PROCESS", None)
    http_server = types.ModuleType("sglang.srt.entrypoints.http_server")
    http_server.app = fastapi.FastAPI()
    http_server._global_state = types.SimpleNamespace(tokenizer_manager=tm)
    http_server.add_prometheus_middleware = stock
    entrypoints = types.ModuleType("sglang.srt.entrypoints")
    entrypoints.http_server = http_server
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints", entrypoints)
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.http_server", http_server)
    staging = routes.add_staging_routes(None, release)
    assert http_server.add_prometheus_middleware.__wrapped__ is stock
    assert staging.metrics is None  # nothing until SGLang mounts /metrics
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    assert subprocess.run([sys.executable, "-c", SCHEDULER], env=env).returncode == 0
    http_server.add_prometheus_middleware(http_server.app)  # what SGLang's lifespan does with --enable-metrics
    assert staging.metrics is em._PROCESS is not None
    snapshot = lora_snapshot(7, layers=1, hidden=16, rank=2)
    token, plan, body = begin_body(snapshot, "M", "dir", incarnation=routes.INCARNATION, cap=1 << 20)
    assert (await staging.begin(body))[0] == 200
    blob = raw_bucket(snapshot, plan.buckets[0])
    assert (await staging.receive(params(token, 0, incarnation=routes.INCARNATION), chunks_of(blob), len(blob)))[0] == 200
    text = await scrape(http_server.app)
    assert f"lorapub_engine_staged_bytes {float(len(blob))}" in text
    assert 'lorapub_engine_attempts{phase="receiving"} 1.0' in text
    assert 'lorapub_engine_prepared_loads_total{outcome="prepared"} 1.0' in text  # from the scheduler process
    assert "lorapub_engine_prepared_install_seconds_count 1.0" in text
    types_ = re.findall(r"^# TYPE (lorapub_engine_\w+) ", text, re.M)
    assert len(types_) == len(set(types_)) == 14, types_  # every series once: none twice, none missing
    staging.close()


async def scrape(app) -> str:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/metrics", "raw_path": b"/metrics", "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 200
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()


@pytest.mark.parametrize("release", RELEASES)
def test_the_diff_form_rebinds_the_name_sglangs_lifespan_calls(release, tmp_path):
    path = os.path.join(patched_root(release), targets.HTTP_FILE)
    tree = ast.parse(open(path).read())
    rebound = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        getattr(t, "id", None) == "add_prometheus_middleware" for t in n.targets)]
    assert len(rebound) == 1 and rebound[0].value.func.id == "_lorapub_serve_engine_series"
    lifespan = next(n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "lifespan")
    assert any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "add_prometheus_middleware"
               for c in ast.walk(lifespan))
