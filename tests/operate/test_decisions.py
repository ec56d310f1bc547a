"""Every decision of a publish -> bind -> retire -> reclaim run is one event, one INFO line with
stable key=value fields (or one JSON object), and no line carries a key or a token."""

from __future__ import annotations

import json
import logging

import pytest

from lorapub import Deployment
from lorapub.events import (
    KINDS,
    EngineReady,
    PublishBegun,
    PublishCommitted,
    PublishFailed,
    PublishProgress,
    PublishSuperseded,
    PublishWaiting,
    ReclaimClaimed,
    RegistryDecided,
    RequestDispatched,
    SessionBound,
    SessionStale,
    VersionReclaimed,
    VersionRetired,
    VersionUnloaded,
)
from lorapub.errors import CapacityError, PublicationSuperseded
from lorapub.runtime.decision_log import LOGGER, JsonFormatter, format_fields
from lorapub.testing import MemoryEngine, lora_snapshot

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def _engines():
    return {n: MemoryEngine(n) for n in ("e0", "e1")}


async def _cycle(dep: Deployment) -> None:
    """publish A, bind a session, publish B (A retires), close the session (A is reclaimed)."""
    await dep.publish(lora_snapshot(1), "A")
    session = dep.session("s1")
    await session.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    await session.close()
    await dep.settle(30)


async def test_a_whole_cycle_is_told_as_events_in_order():
    seen = []
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, observers=[seen.append]).start()
    await _cycle(dep)
    await dep.close()
    kinds = [type(e) for e in seen if not isinstance(e, (RegistryDecided, PublishProgress, RequestDispatched))]
    a = [e for e in seen if getattr(e, "version", None) is not None and str(e.version) == "1-A"]
    assert [type(e) for e in a if not isinstance(e, (PublishProgress, RequestDispatched))] == [
        PublishBegun, EngineReady, EngineReady, PublishCommitted, SessionBound, VersionRetired, ReclaimClaimed,
        VersionUnloaded, VersionUnloaded, VersionReclaimed,
    ], kinds
    retired = next(e for e in seen if isinstance(e, VersionRetired))
    assert str(retired.by) == "1-B"
    committed = [e for e in seen if isinstance(e, PublishCommitted)]
    assert [c.revision for c in committed] == [1, 2]
    assert set(committed[0].phases) >= {"reserve", "begin", "transfer", "end", "commit"}
    assert committed[0].bytes == lora_snapshot(1).manifest.total_bytes
    # every engine's bytes reached the total, in order
    progress = [e for e in seen if isinstance(e, PublishProgress) and str(e.version) == "1-A" and e.phase == "transfer"]
    for engine in ("e0", "e1"):
        sent = [p.bytes_sent for p in progress if p.engine == engine]
        assert sent == sorted(sent) and sent[-1] == committed[0].bytes
    # the registry's decisions are timed, by command
    decided = {e.command for e in seen if isinstance(e, RegistryDecided)}
    assert {"Reserve", "Commit", "BindFirst", "ClaimReclaim", "RecordUnloaded"} <= decided


async def test_a_replayed_unload_receipt_tells_nothing_twice():
    """A receipt whose reply was lost is sent again: the registry changes nothing, and neither an unload nor
    the version's reclaim is told a second time (the metrics would count the version reclaimed twice)."""
    from lorapub.core.commands import RecordUnloaded

    seen = []
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, observers=[seen.append]).start()
    await _cycle(dep)
    a = next(v for k, v in dep.registry.state.versions.items() if k.version_id == "A")
    before = [e for e in seen if isinstance(e, (VersionUnloaded, VersionReclaimed))]
    assert len(before) == 3
    await dep.publisher.registry.handle(RecordUnloaded(a.key, a.reclaim_id, "e0"))  # the replay, through the door
    assert [e for e in seen if isinstance(e, (VersionUnloaded, VersionReclaimed))] == before
    await dep.close()


async def test_each_decision_is_one_info_line_with_stable_keys(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None).start()
    await _cycle(dep)
    await dep.close()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
    heads = [line.split(" ", 1)[0] for line in lines]
    assert heads.count("publish.committed") == 2
    assert heads.count("publish.begun") == 2 and heads.count("publish.ready") == 4
    assert "session.bound" in heads and "version.retired" in heads and "reclaim.claimed" in heads
    assert heads.count("version.unloaded") == 2 and "version.reclaimed" in heads
    # nothing per request at INFO, and no registry timing
    assert "request.dispatched" not in heads and "registry.decision" not in heads
    committed = next(line for line in lines if line.startswith("publish.committed "))
    fields = dict(part.split("=", 1) for part in committed.split(" ")[1:])
    assert fields["version"] == "1-A" and fields["revision"] == "1" and fields["retired"] == "-"
    assert set(fields) == {"version", "revision", "retired", "seconds", "waited", "bytes", "phases"}
    json.loads(fields["phases"])
    # the lora name is logged where it is a decision's subject, the attempt token, digests and session
    # nonces never are
    assert not any("token" in line or "digest" in line for line in lines)
    bound = next(line for line in lines if line.startswith("session.bound "))
    assert "session=s1 " in bound and "/" not in bound.split("session=", 1)[1].split(" ", 1)[0]


async def test_the_json_formatter_writes_the_same_fields_as_one_object():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        dep = await Deployment(_engines(), epoch=1, reconcile_interval=None).start()
        await dep.publish(lora_snapshot(1), "A")
        await dep.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    objects = [json.loads(r) for r in records]
    committed = next(o for o in objects if o.get("event") == "publish.committed")
    assert committed["version"] == "1-A" and committed["revision"] == 1 and committed["level"] == "INFO"
    assert committed["logger"] == LOGGER and committed["ts"].endswith("+00:00")


def test_a_value_with_spaces_is_quoted_so_a_line_splits_back():
    line = format_fields({"reason": 'engine e0: said "no"', "n": 3, "none": None})
    assert line == 'reason="engine e0: said \\"no\\"" n=3 none=-'


async def test_capacity_refusal_and_supersession_are_told():
    seen = []
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, capacity=2, observers=[seen.append]).start()
    await dep.publish(lora_snapshot(1), "A")
    session = dep.session("s1")
    await session.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")  # A retires, its session keeps it: both slots are held
    with pytest.raises(CapacityError) as refused:
        await dep.publish(lora_snapshot(3), "C")
    failed = [e for e in seen if isinstance(e, PublishFailed)]
    assert [(str(e.version), e.code) for e in failed] == [("1-C", "CAPACITY_ERROR")]
    assert len(refused.value.message) > 300 and failed[0].reason == refused.value.message  # whole: the fix it names reaches the log
    import asyncio

    waiting = asyncio.ensure_future(dep.publish(lora_snapshot(4), "D", wait=30))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if any(isinstance(e, PublishWaiting) for e in seen):
            break
    newer = asyncio.ensure_future(dep.publish(lora_snapshot(5), "E", wait=30))
    with pytest.raises(PublicationSuperseded):
        await waiting
    sup = [e for e in seen if isinstance(e, PublishSuperseded)]
    assert [(str(e.version), str(e.by)) for e in sup] == [("1-D", "1-E")]
    await session.close()
    await asyncio.wait_for(newer, 10)
    await dep.close()


async def test_a_stale_session_is_told_once():
    seen = []
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, capacity=2, max_lag=0, on_stale="error",
                           observers=[seen.append]).start()
    await dep.publish(lora_snapshot(1), "A")
    session = dep.session("s1")
    await session.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    for _ in range(2):
        with pytest.raises(Exception):
            await session.generate(GEN)
    assert [str(e.version) for e in seen if isinstance(e, SessionStale)] == ["1-A"]
    await dep.close()


async def test_an_observer_that_raises_breaks_nothing_and_is_logged_once(caplog):
    def broken(event):
        raise RuntimeError("observer bug")

    dep = await Deployment(_engines(), epoch=1, reconcile_interval=None, observers=[broken]).start()
    await _cycle(dep)
    assert (await dep.state()).default is not None
    await dep.close()
    assert sum("observer bug" in (r.exc_text or "") or "failed on" in r.getMessage() for r in caplog.records) == 1


def test_every_event_kind_is_unique_and_documented():
    kinds = [k.KIND for k in KINDS]
    assert len(set(kinds)) == len(kinds)
    import pathlib

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    missing = [k for k in kinds if f"`{k}`" not in doc]
    assert not missing, missing


async def test_a_join_a_drain_and_a_removal_are_told():
    from lorapub.events import EngineDrained, EngineDraining, EngineJoining, EngineRemoved, EngineReprovisioned

    seen = []
    dep = await Deployment(_engines(), epoch=1, reconcile_interval=0.05, observers=[seen.append]).start()
    await dep.publish(lora_snapshot(1), "A")
    await dep.add_engine(MemoryEngine("e2"))
    await dep.drain_engine("e2")
    await dep.remove_engine("e2")
    await dep.close()
    told = [(type(e).__name__, e.engine) for e in seen
            if isinstance(e, (EngineJoining, EngineDraining, EngineDrained, EngineRemoved))]
    assert told == [("EngineJoining", "e2"), ("EngineDraining", "e2"), ("EngineDrained", "e2"),
                    ("EngineRemoved", "e2")]
    assert [(e.engine, str(e.version)) for e in seen if isinstance(e, EngineReprovisioned)] == [("e2", "1-A")]


# -- logs an operator can read: who expired, health as an event, text as written, time and level ----
def _json_lines(logger_name: str = "lorapub"):
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep(logging.INFO)
    handler.setFormatter(JsonFormatter())
    return records, handler


async def test_a_lease_expiry_found_by_the_reconciler_names_the_sessions():
    from lorapub.events import SessionsExpired
    from lorapub.local_registry import LocalRegistry

    now = [1000.0]
    engines = _engines()
    registry = LocalRegistry(1, {n: await e.incarnation() for n, e in engines.items()}, lease_ttl=60.0,
                             clock=lambda: now[0])
    seen = []
    dep = await Deployment(engines, epoch=1, registry=registry, reconcile_interval=None,
                           observers=[seen.append]).start()
    await dep.publish(lora_snapshot(1), "A")
    for name in ("worker-a", "worker-b"):
        await dep.session(name).generate(GEN)
    now[0] += 120  # their worker stopped renewing: the registry's lease pass finds them
    await dep.reconcile()
    expired = [e for e in seen if isinstance(e, SessionsExpired) and e.reason == "lease"]
    await dep.close()
    assert expired and expired[0].count == 2, seen
    assert sorted(expired[0].sessions) == ["worker-a", "worker-b"]


async def test_a_health_change_is_a_structured_event_under_the_json_formatter():
    from lorapub.events import HealthChanged

    records, handler = _json_lines()
    logger = logging.getLogger("lorapub")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    seen = []
    engines = _engines()
    try:
        dep = await Deployment(engines, epoch=1, reconcile_interval=None, observers=[seen.append]).start()
        await dep.reconcile()
        engines["e1"].fail_next("incarnation", "error", count=1000)  # e1 stops answering its probe
        await dep.reconcile()
        engines["e1"].clear_faults()
        await dep.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    changes = [e for e in seen if isinstance(e, HealthChanged)]
    assert changes and not changes[-1].healthy, seen
    objects = [json.loads(r) for r in records]
    assert not [o for o in objects if "health" in o.get("message", "")], objects  # no prose lines
    told = [o for o in objects if o.get("event") == "health.changed"]
    assert told and told[-1]["healthy"] is False
    assert any(b.startswith("engine_unreachable e1") for b in told[-1]["blockers"]), told


def test_text_is_written_as_it_is_not_escaped():
    record = logging.LogRecord("lorapub.decisions", logging.INFO, __file__, 1, "%s", ("version prête — ok",), None)
    assert json.loads(JsonFormatter().format(record))["message"] == "version prête — ok"
    assert "prête — ok" in JsonFormatter().format(record)
    assert format_fields({"reason": "sans réponse"}) == 'reason="sans réponse"'


def test_lorapub_leaves_logging_unconfigured_but_never_prints_bare_lines():
    import subprocess
    import sys

    # an embedder that configured nothing: lorapub's warnings are not printed bare by Python's
    # last-resort handler (a library adds only a NullHandler; the embedder configures logging)
    code = ("import logging, lorapub; logging.getLogger('lorapub.decisions').warning('x ok'); "
            "assert not logging.getLogger().handlers")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "x ok" not in out.stderr


def test_lorapubs_commands_configure_logging_with_time_and_level():
    import subprocess
    import sys

    code = ("import logging; from lorapub.cli import configure_logging; configure_logging('INFO'); "
            "logging.getLogger('lorapub.decisions').info('publish.committed version=1-A')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = out.stderr.strip()
    assert line.endswith(" INFO lorapub.decisions: publish.committed version=1-A"), line
    assert line[:4].isdigit()  # its time comes first
    code = ("import json, logging; from lorapub.cli import configure_logging; configure_logging('INFO', json_lines=True); "
            "logging.getLogger('lorapub.x').warning('a')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stderr)["level"] == "WARNING"


def test_the_lorapub_command_takes_its_logging_options():
    from lorapub.demo.cli import _parser

    args = _parser().parse_args(["--log-level", "info", "--log-json", "status", "--store", "x"])
    assert (args.log_level, args.log_json) == ("INFO", True)
