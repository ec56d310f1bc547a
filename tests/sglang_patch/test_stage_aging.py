"""Engine-side staging ages out what nobody drives (lorapub.sglang_patch.staging).

A publisher that vanished mid-transfer leaves an attempt no begin, bucket, end or cleanup will touch
again. After ``idle_timeout`` (``LORAPUB_STAGE_IDLE_S``) the engine frees and tombstones it as a
cleanup would: its bytes no longer count against ``max_stash_bytes``, a late message for it is refused
and recreates nothing. Never while an operation on it runs, and never by unloading an adapter: an
attempt whose ``end`` loaded the adapter still registered under its name is kept.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os

import attrs
import pytest

from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.sglang_patch import staging as es
from lorapub.wire.codec import plan_to_json, token_from_json, token_to_json

pytest.importorskip("torch")

from tests.wire.test_staging_landing import LIFE, Hooks, chunks_of, params, raw, snapshot  # noqa: E402
from lorapub.demo.workload import until as _poll
from tests.helpers.waiting import until


def begin_body(snap, version: str, seq: int = 1) -> tuple[AttemptToken, object, dict]:
    key = VersionKey(1, version)
    token = AttemptToken(key, seq)
    plan = snap.plan(1024)
    body = {"token": token_to_json(token), "incarnation": LIFE, "lora_name": lora_name_for(key, snap.digest),
            "digest": snap.digest, "plan": plan_to_json(plan), "transport": {"kind": "http"}, "load": "dir"}
    return token, plan, body


async def send(staging, snap, token, bucket, body_chunks=None):
    blob = raw(snap, bucket)
    return await staging.receive(params(token, bucket.index), body_chunks or chunks_of(blob), len(blob))


def undriven_for(staging, token, seconds: float) -> None:
    """As if nothing had driven ``token`` for ``seconds`` (no timer of the staging has run meanwhile)."""
    state = staging.state
    attempt = state.attempts[token]
    attempt = attrs.evolve(attempt, last_driven=attempt.last_driven - seconds)
    staging._state = attrs.evolve(state, attempts=state.attempts.set(token, attempt))


async def test_a_vanished_publishers_stash_is_aged_out_before_a_begin_checks_capacity(tmp_path):
    hooks = Hooks()
    a, b = snapshot(1), snapshot(2)
    ta, plan_a, body_a = begin_body(a, "A")
    tb, plan_b, body_b = begin_body(b, "B")
    budget = sum(x.nbytes for x in plan_a.buckets) + 1
    staging = es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"), max_stash_bytes=budget,
                               idle_timeout=60)
    assert (await staging.begin(body_a))[0] == 200
    for bucket in plan_a.buckets[:2]:  # the publisher sends two buckets, then vanishes
        assert (await send(staging, a, ta, bucket))[0] == 200
    folder = staging.folder_of(ta)
    assert staging.report()["bytes"] > 0 and os.path.isdir(folder)
    status, answer = await staging.begin(body_b)  # A still counts: it was driven just now
    assert status == 409 and answer["error"]["code"] == "STAGE_CAPACITY", answer

    undriven_for(staging, ta, 61)
    status, answer = await staging.begin(body_b)  # the sweep runs first: A's stash no longer blocks B
    assert status == 200, answer
    report = staging.report()
    assert list(report["attempts"]) == [str(tb)] and report["aged_out"] == 1
    assert not os.path.exists(folder)
    # A was tombstoned as a cleanup would: every late message is refused and recreates nothing
    status, answer = await send(staging, a, ta, plan_a.buckets[2])
    assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE", answer
    status, answer = await staging.end({"token": body_a["token"], "incarnation": LIFE})
    assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE", answer
    status, answer = await staging.begin(body_a)
    assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE", answer
    assert list(staging.report()["attempts"]) == [str(tb)] and not os.path.exists(folder)
    assert await staging.cleanup({"token": body_a["token"]}) == (200, {"incarnation": LIFE, "loaded": None})
    assert hooks.loaded == {}
    staging.close()


async def test_the_staging_timer_ages_an_attempt_out_with_no_route_called_and_close_stops_it(tmp_path):
    snap = snapshot(3)
    token, plan, body = begin_body(snap, "A")
    # 1 s: a busy machine's pause between the begin and the bucket never ages the attempt out first
    staging = es.EngineStaging(Hooks(), incarnation=LIFE, stash_root=str(tmp_path / "disk"), idle_timeout=1.0)
    assert (await staging.begin(body))[0] == 200
    assert (await send(staging, snap, token, plan.buckets[0]))[0] == 200
    # nothing calls the staging meanwhile; with nothing staged, no timer until a route is called again
    await until(lambda: staging.state.attempts == {} and not staging.aging_armed, what="the attempt aged out")
    assert token in staging.state.tombstones and not os.path.exists(staging.folder_of(token))

    other = snapshot(4)
    token_b, plan_b, body_b = begin_body(other, "B")
    assert (await staging.begin(body_b))[0] == 200
    assert staging.aging_armed
    staging.close()
    assert not staging.aging_armed
    await asyncio.sleep(1.2)  # past the idle timeout
    assert await staging.sweep() == []  # a closed staging sweeps nothing


#: How long the slow operations below run: long beside the 0.6 s idle timeout (itself long beside a busy
#: machine's pause between two buckets) and the 0.9 s the test waits, so the operation still runs when it looks.
SLOW_OP = 4.0
IDLE = 0.6


class SlowLoad(Hooks):
    async def load_dir(self, lora_name, path):
        await asyncio.sleep(SLOW_OP)
        return await super().load_dir(lora_name, path)


@pytest.mark.parametrize("op", ["bucket", "end"])
async def test_an_attempt_is_never_aged_out_while_an_operation_on_it_runs(tmp_path, op):
    snap = snapshot(5)
    token, plan, body = begin_body(snap, "A")
    staging = es.EngineStaging(SlowLoad(), incarnation=LIFE, stash_root=str(tmp_path / "disk"), idle_timeout=IDLE)
    assert (await staging.begin(body))[0] == 200
    last = plan.buckets[-1]
    for bucket in plan.buckets[:-1]:
        assert (await send(staging, snap, token, bucket))[0] == 200
    if op == "bucket":  # the last bucket's body arrives slowly: its receive holds the attempt's lock
        blob = raw(snap, last)

        async def slow_body():
            yield blob[:10]
            await asyncio.sleep(SLOW_OP)
            yield blob[10:]

        running = asyncio.ensure_future(send(staging, snap, token, last, slow_body()))
    else:
        assert (await send(staging, snap, token, last))[0] == 200
        running = asyncio.ensure_future(staging.end({"token": body["token"], "incarnation": LIFE}))
    await asyncio.sleep(IDLE * 1.5)  # past the idle timeout, the operation still running
    assert staging.report()["attempts"][str(token)]["driving"]
    assert await staging.sweep() == []
    status, answer = await running
    assert status == 200, answer
    assert token not in staging.state.tombstones and str(token) in staging.report()["attempts"]
    if op == "bucket":  # driven until its bucket was stored: still alive, and the end loads it
        status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
        assert status == 200, answer
    staging.close()


async def test_a_loaded_attempt_keeps_its_adapter_and_is_aged_out_only_once_it_is_gone(tmp_path):
    hooks = Hooks()
    snap = snapshot(6)
    token, plan, body = begin_body(snap, "A")
    staging = es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"), idle_timeout=60)
    assert (await staging.begin(body))[0] == 200
    for bucket in plan.buckets:
        assert (await send(staging, snap, token, bucket))[0] == 200
    status, receipt = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200, receipt
    undriven_for(staging, token, 3600)
    assert await staging.sweep() == []  # its adapter is loaded: the registry reclaims or cleans it up
    entry = staging.report()["attempts"][str(token)]
    assert entry["phase"] == "loaded" and entry["bytes"] == 0 and entry["idle_s"] >= 3600
    status, duplicate = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200 and duplicate == dict(receipt, duplicate=True)  # and a duplicate end drove it
    assert staging.report()["attempts"][str(token)]["idle_s"] < 60

    hooks.loaded.pop(body["lora_name"])  # unloaded (a reclaim whose release never came)
    undriven_for(staging, token, 3600)
    assert await staging.sweep() == [str(token)]
    assert staging.report()["attempts"] == {} and not os.path.exists(staging.folder_of(token))
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE"
    staging.close()


async def test_the_report_lists_every_staged_attempt_for_an_orphan_sweep(tmp_path):
    snap, other = snapshot(7), snapshot(8)
    ta, plan_a, body_a = begin_body(snap, "A")
    tb, plan_b, body_b = begin_body(other, "B", seq=3)
    staging = es.EngineStaging(Hooks(), incarnation=LIFE, stash_root=str(tmp_path / "disk"), idle_timeout=60)
    assert (await staging.begin(body_a))[0] == 200
    assert (await send(staging, snap, ta, plan_a.buckets[1]))[0] == 200
    assert (await staging.begin(body_b))[0] == 200
    for bucket in plan_b.buckets:
        assert (await send(staging, other, tb, bucket))[0] == 200
    assert (await staging.end({"token": body_b["token"], "incarnation": LIFE}))[0] == 200
    undriven_for(staging, ta, 30)
    report = staging.report()
    a, b = report["attempts"][str(ta)], report["attempts"][str(tb)]
    assert token_from_json(a["token"]) == ta and token_from_json(b["token"]) == tb
    assert (a["lora_name"], a["phase"], a["buckets"], a["planned"]) == (body_a["lora_name"], "receiving", [1],
                                                                        len(plan_a.buckets))
    assert a["bytes"] == plan_a.buckets[1].nbytes == report["bytes"] and 30 <= a["idle_s"] < 60 and not a["driving"]
    assert (b["lora_name"], b["phase"], b["bytes"], b["loaded"]) == (body_b["lora_name"], "loaded", 0, True)
    assert b["idle_s"] < 30 and report["idle_timeout_s"] == 60 and report["aged_out"] == 0
    staging.close()


@pytest.mark.parametrize("value,expected", [(None, 600.0), ("30", 30.0), ("0.5", 0.5), ("inf", math.inf),
                                            ("0", 600.0), ("-5", 600.0), ("soon", 600.0), ("nan", 600.0)])
def test_the_idle_timeout_setting_is_read_once_and_a_bad_value_is_logged_and_ignored(tmp_path, monkeypatch, caplog,
                                                                                       value, expected):
    if value is None:
        monkeypatch.delenv(es.IDLE_ENV, raising=False)
    else:
        monkeypatch.setenv(es.IDLE_ENV, value)
    with caplog.at_level(logging.WARNING, logger=es.logger.name):
        staging = es.EngineStaging(Hooks(), incarnation=LIFE, stash_root=str(tmp_path / "disk"))
    assert staging.idle_timeout == expected
    assert (es.IDLE_ENV in caplog.text) == (value is not None and expected == 600.0)
    monkeypatch.setenv(es.IDLE_ENV, "1")
    assert staging.idle_timeout == expected  # read once, at the start of the life
    staging.close()
    given = es.EngineStaging(Hooks(), incarnation="life-2", stash_root=str(tmp_path / "disk"), idle_timeout=5)
    assert given.idle_timeout == 5.0
    given.close()
    for bad in (0, -1, "600", True):
        with pytest.raises(ValueError, match="idle_timeout"):
            es.EngineStaging(Hooks(), incarnation="life-3", stash_root=str(tmp_path / "disk"), idle_timeout=bad)


async def test_the_double_ages_out_as_the_patched_server_does_and_its_state_route_shows_it(tmp_path):
    from lorapub.adapters.sglang_wire import RawBucket, SGLangWireEngine
    from lorapub.core.effects import SendBegin
    from lorapub.errors import EngineError
    from lorapub.testing import SGLangDouble
    from lorapub.testing.fixtures import lora_snapshot

    double = SGLangDouble("e0")
    # long enough that a busy machine's pause between two calls never ages the attempt before the test lets go
    double.stash_root, double.stage_idle_s = str(tmp_path / "disk"), 2.0
    await double.start()
    engine = SGLangWireEngine("e0", double.url, probe_timeout=10)
    try:
        snap = lora_snapshot(3)
        plan = snap.plan(4 << 10)
        key = VersionKey(1, "v1")
        token = AttemptToken(key, 1)
        inc = await engine.incarnation()
        await engine.begin(SendBegin("e0", inc, token, lora_name_for(key, snap.digest), snap.digest, plan))
        await engine.receive_bucket(token, 0, RawBucket(snap, plan.buckets[0]))
        staged = (await engine.state())["staging"]
        entry = staged["attempts"][str(token)]
        assert (entry["phase"], entry["buckets"], entry["bytes"]) == ("receiving", [0], plan.buckets[0].nbytes)
        assert staged["idle_timeout_s"] == 2.0
        staged = {}

        async def aged_out() -> bool:  # the publisher is gone: nothing drives the attempt
            staged.update((await engine.state())["staging"])
            return staged["attempts"] == {}

        await _poll(aged_out, timeout=30)
        assert staged["attempts"] == {} and staged["bytes"] == 0 and staged["aged_out"] == 1
        with pytest.raises(EngineError, match="STAGE_TOMBSTONE|cleaned up"):
            await engine.receive_bucket(token, 1, RawBucket(snap, plan.buckets[1]))
        assert (await engine.state())["staging"]["attempts"] == {}
    finally:
        await engine.close()
        await double.stop()
