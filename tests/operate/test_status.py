"""Status: what a running deployment holds and what blocks each reclaim, by name; served read-only
on localhost, read by ``lorapub status`` from the endpoint or from a store copy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import pytest

from lorapub import Deployment
from lorapub.errors import InvalidInput
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.status import Status
from lorapub.adapters.stores import SQLiteStore
from lorapub.testing import MemoryEngine, lora_snapshot
from tests.helpers.waiting import until

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
TOKEN = "a-status-token-of-enough-length"


def _engines():
    return {n: MemoryEngine(n) for n in ("e0", "e1")}


async def _held(dep: Deployment):
    """A publishes, s1 binds A and stays open, B publishes: A is RETIRED, kept by s1."""
    await dep.publish(lora_snapshot(1), "A")
    session = dep.session("s1")
    await session.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    await dep.reconcile(wait=0)
    return session


async def test_status_names_the_session_that_keeps_a_retired_version():
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None).start()
    session = await _held(dep)
    status = await dep.status()
    by = {v.version: v for v in status.versions}
    assert status.default == "1-B" and status.slots_used == 2 and status.capacity == 2
    assert by["1-B"].default and by["1-B"].lag == 0 and by["1-B"].blocked_by == ()
    a = by["1-A"]
    assert a.state == "RETIRED" and a.lag == 1 and a.session_refs == 1
    assert len(a.blocked_by) == 1 and a.blocked_by[0].startswith("session s1 (") and ", idle " in a.blocked_by[0]
    engines = {e.name: e for e in status.engines}
    assert engines["e0"].holds == ("1-A", "1-B") and engines["e0"].should_hold == ("1-A", "1-B")
    assert engines["e0"].answered is True and engines["e0"].last_error is None
    assert status.sessions_here == 1
    # the JSON form reads back to the same value
    assert Status.from_json(json.loads(json.dumps(status.to_json()))) == status
    await session.close()
    await dep.settle(30)
    status = await dep.status()
    assert [v.version for v in status.versions] == ["1-B"] and status.sessions_here == 0
    await dep.close()


async def test_a_running_request_and_an_unreachable_engine_are_named():
    engines = _engines()
    dep = await Deployment(engines, epoch=1, reconcile_interval=None).start()
    session = await _held(dep)
    long = asyncio.ensure_future(session.generate({**GEN, "sampling_params": {"max_new_tokens": 3000}}))
    await until(lambda: any(sum(e.refs.values()) for e in engines.values()), what="the long request running")
    engines["e1"].fail_next("incarnation", "request", count=10)  # e1 answers nothing for a while
    status = await dep.status()
    a = next(v for v in status.versions if v.version == "1-A")
    where = session.engine.name
    assert a.loaded_on.get(where) == 1, a
    e1 = next(e for e in status.engines if e.name == "e1")
    assert e1.answered is False and "OutcomeUnknown" in e1.last_error and e1.holds == ()
    assert e1.should_hold == ("1-A", "1-B")
    engines["e1"].clear_faults()
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)
    await session.close()
    await dep.close()


async def test_the_endpoint_serves_status_and_metrics_on_localhost_only_with_its_token():
    from prometheus_client import CollectorRegistry

    from lorapub.adapters.prometheus import Metrics

    metrics = Metrics(CollectorRegistry())
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, observers=[metrics],
                           status=("127.0.0.1", 0), status_token=TOKEN).start()
    session = await _held(dep)
    url = dep.status_server.url
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/status") as r:
            assert r.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(url + "/status", headers=auth) as r:
            assert r.status == 200
            body = await r.json()
        async with http.get(url + "/metrics", headers=auth) as r:
            assert r.status == 200
            text = await r.text()
    assert body["default"] == "1-B" and body["versions"][0]["version"] == "1-A"
    assert 'lorapub_publications_total{outcome="committed"} 2.0' in text
    assert 'lorapub_version_session_refs{version="1-A"} 1.0' in text
    assert "lorapub_slots_free 0.0" in text and 'lorapub_versions{state="RETIRED"} 1.0' in text
    # the command reads the same endpoint
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "lorapub", "status", "--url", url, "--json"],
        capture_output=True, text=True, env={**os.environ, "LORAPUB_STATUS_TOKEN": TOKEN}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["versions"][0]["blocked_by"][0].startswith("session s1 (")
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "lorapub", "status", "--url", url], capture_output=True, text=True,
        env={**os.environ, "LORAPUB_STATUS_TOKEN": TOKEN, "COLUMNS": "200"}, timeout=60)
    assert out.returncode == 0 and "session s1 (" in out.stdout and "1-A" in out.stdout, out.stdout + out.stderr
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "lorapub", "status", "--url", url],
                                  capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                       if k != "LORAPUB_STATUS_TOKEN"}, timeout=60)
    assert out.returncode == 2 and "token" in out.stderr
    await session.close()
    await dep.close()
    assert dep.status_server._runner is None


async def test_a_port_already_taken_is_refused_and_the_adapters_serve_the_next_deployment():
    from lorapub.adapters.sglang_wire import SGLangWireEngine
    from lorapub.testing import SGLangDouble

    double = await SGLangDouble("e0").start()
    engine = SGLangWireEngine("e0", double.url)
    taken = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = taken.sockets[0].getsockname()[1]
    try:
        with pytest.raises(InvalidInput, match="pick another port"):
            await Deployment({"e0": engine}, epoch=1, reconcile_interval=None, status=("127.0.0.1", port)).start()
        assert engine.client.current_http is None or engine.client.current_http.closed  # nothing left open
        dep = await Deployment({"e0": engine}, epoch=2, reconcile_interval=None, status=("127.0.0.1", 0)).start()
        await dep.publish(lora_snapshot(1), "A")  # the same adapter, as the message invites
        await dep.close()
    finally:
        taken.close()
        await engine.close()
        await double.stop()


def test_an_endpoint_beyond_localhost_needs_a_token_and_a_bad_address_is_refused():
    with pytest.raises(InvalidInput, match="beyond localhost"):
        Deployment(_engines(), epoch=1, status=("0.0.0.0", 9464))
    with pytest.raises(InvalidInput, match=r"\(host, port\)"):
        Deployment(_engines(), epoch=1, status=9464)
    Deployment(_engines(), epoch=1, status=("0.0.0.0", 9464), status_token=TOKEN)  # accepted


async def test_the_command_reads_a_store_from_a_copy_and_leaves_it_as_it_was(tmp_path):
    path = str(tmp_path / "registry.db")
    engines = _engines()
    incarnations = {n: await e.incarnation() for n, e in engines.items()}
    registry = LocalRegistry(1, incarnations, store=SQLiteStore(path))
    dep = await Deployment(engines, epoch=1, registry=registry, reconcile_interval=None).start()
    session = await _held(dep)
    await dep.close()  # s1 never closed: A stays kept by it in the store
    registry.store.close()
    before = {f: open(os.path.join(tmp_path, f), "rb").read() for f in os.listdir(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "lorapub", "status", "--store", path, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["source"] == f"store {path}" and status["healthy"] is None
    a = next(v for v in status["versions"] if v["version"] == "1-A")
    assert a["state"] == "RETIRED" and a["blocked_by"][0].startswith("session s1 (")
    after = {f: open(os.path.join(tmp_path, f), "rb").read() for f in os.listdir(tmp_path)}
    assert after == before
    out = subprocess.run([sys.executable, "-m", "lorapub", "status", "--store", str(tmp_path / "none.db")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no registry store" in out.stderr
    del session


def test_a_live_store_that_commits_between_the_copies_of_its_files_reads_whole(tmp_path, monkeypatch):
    import shutil

    from lorapub.cli import status as cli
    from lorapub.core.commands import BindFirst
    from tests.unit.test_stores import EP, E, publish_through, sk

    path = str(tmp_path / "registry.db")
    registry = LocalRegistry(EP, E, store=SQLiteStore(path, mark_sync_every=0))
    publish_through(registry, "A")
    copy, commits = shutil.copyfile, iter(range(1000))

    def copy_then_commit(src, dst):  # the live registry commits a decision after every file copied
        copy(src, dst)
        registry.apply(BindFirst(sk(next(commits))))

    monkeypatch.setattr(cli.shutil, "copyfile", copy_then_commit)
    monkeypatch.setattr(cli, "COPY_ATTEMPTS", 1)  # the order alone must make the copy whole
    status = cli.read_store(path)
    assert status.default == f"{EP}-A"
    registry.close()


def test_a_damaged_store_is_named_by_its_own_path_not_the_copys(tmp_path):
    from lorapub.cli.status import StatusError, read_store

    path = tmp_path / "registry.db"
    registry = LocalRegistry(1, {"e0": "i0"}, store=SQLiteStore(str(path)))
    registry.store.close()
    data = bytearray(path.read_bytes())
    data[100:4096] = bytes(len(data[100:4096]))  # the schema page zeroed past the header
    path.write_bytes(bytes(data))
    with pytest.raises(StatusError) as err:
        read_store(str(path))
    assert str(path) in str(err.value) and "lorapub-status-" not in str(err.value)


@pytest.mark.parametrize("said", ["400 [red]bad adapter[/red]", 'answered 500: {"detail": "[/lorapub/stage/end] failed"}'])
def test_what_an_engine_says_is_shown_as_it_is_never_as_markup(said):
    from rich.console import Console

    from lorapub.cli.status import render
    from lorapub.runtime.status import EngineStatus

    status = Status(epoch=1, at=0.0, source="deployment", default=None, default_revision=0, capacity=2, slots_used=0,
                    max_lag=None, healthy=False, blockers=(), versions=(),  # said only in the engines table
                    engines=(EngineStatus("e0", "i", None, False, (), (), 0, said),), attempts=(), waiting=None,
                    sessions_here=0, groups_here=0)
    console = Console(width=400, record=True)
    console.print(render(status))
    assert said in console.export_text()


async def test_a_registry_that_does_not_answer_is_a_typed_503_with_health_and_the_command_says_so():
    from lorapub.core.commands import ReadFleet
    from lorapub.testing import FaultyRegistry

    engines = _engines()
    registry = FaultyRegistry(LocalRegistry(1, {n: await e.incarnation() for n, e in engines.items()}, 2))
    dep = await Deployment(engines, epoch=1, registry=registry, reconcile_interval=None,
                           status=("127.0.0.1", 0)).start()
    await dep.publish(lora_snapshot(1), "A")
    await dep.reconcile()
    registry.fail_next(ReadFleet, "request", count=1000)
    try:
        url = dep.status_server.url
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/status") as r:
                assert r.status == 503
                body = await r.json()
        assert body["code"] and body["error"].startswith(body["code"]) and body["health"] == "healthy"
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "lorapub", "status", "--url", url],
                                      capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"answered 503: {body['code']}" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    finally:
        registry.clear_faults()
        await dep.close()


async def test_a_wrong_token_is_told_as_refused_not_as_missing():
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, status=("127.0.0.1", 0),
                           status_token=TOKEN).start()
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "lorapub", "status", "--url",
                                                   dep.status_server.url, "--token", "not-" + TOKEN],
                                  capture_output=True, text=True, timeout=60)
    await dep.close()
    assert out.returncode == 2 and "refused the token given" in out.stderr, out.stderr


class _ListsNothing:
    """An engine adapter without ``inventory()`` (optional in the port): it says its life, not its holdings."""

    def __init__(self, inner: MemoryEngine) -> None:
        self._inner, self.name = inner, inner.name

    def __getattr__(self, attr: str):
        if attr == "inventory":
            raise AttributeError(attr)
        return getattr(self._inner, attr)


async def test_an_engine_that_lists_nothing_is_shown_as_not_reported_not_as_holding_nothing():
    from rich.console import Console

    from lorapub.cli.status import render

    dep = await Deployment({"e0": _ListsNothing(MemoryEngine("e0"))}, epoch=1, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    status = await dep.status()
    [engine] = status.engines
    assert engine.answered and not engine.reports_holdings and engine.should_hold == ("1-A",)
    assert engine.seen is not None  # its life is still read
    assert Status.from_json(json.loads(json.dumps(status.to_json(), default=str))).engines[0].reports_holdings is False
    console = Console(width=300, record=True)
    console.print(render(status))
    assert "not reported" in console.export_text()
    await dep.close()


def test_a_status_from_a_newer_server_reads_with_its_new_fields_left_out():
    from lorapub.runtime.status import EngineStatus

    status = Status(epoch=1, at=0.0, source="deployment", default=None, default_revision=0, capacity=2, slots_used=0,
                    max_lag=None, healthy=True, blockers=(), versions=(),
                    engines=(EngineStatus("e0", "i", "i", True, (), (), 0, None),), attempts=(), waiting=None,
                    sessions_here=0, groups_here=0)
    body = json.loads(json.dumps(status.to_json(), default=str))
    body["engines"][0]["a_field_of_the_future"] = 1
    body["a_top_level_one"] = 2
    assert Status.from_json(body) == status
