"""lorapub's Relax hooks, driven through stand-ins of Relax's own code (``relax_harness.py``, checked
against the table of what was read in Relax, ``relax_surface.py``) against lorapub's real Deployment
and two SGLang contract doubles (``lorapub.testing.SGLangDouble``, SGLang's own LoRARegistry inside).

The trainer side (``DeviceDirectBackend`` with lorapub's weight path, publishing from a thread of its
own) and the shard side (``AgenticSessionShard``, on the test loop) share one registry, as Relax's
trainer and session shards share lorapub's Ray registry actor.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import json
import logging
import pathlib
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest

import lorapub
from lorapub import (Deadlines, Deployment, DeploymentClosed, EngineError, InvalidInput, NoPublishedVersion, Snapshot,
                     VersionKey, VersionMissing)
from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine
from lorapub.core.commands import ReadState
from lorapub.integrations import relax as relax_lorapub
from lorapub.integrations.relax import (
    CONFIG_FLAG,
    DEFAULT_NAME_PREFIX,
    ENABLE_FLAG,
    LorapubConfig,
    LorapubGenerationBackend,
    LorapubPublisher,
    OptionClash,
    RelaxChatError,
    add_arguments,
    check_name_prefix,
    engine_name,
    validate_args,
)
from lorapub.local_registry import LocalRegistry
from lorapub.testing import SGLangDouble, lora_snapshot, peft_lora_state_dict

from tests.integrations import relax_harness as harness
from tests.integrations.relax_harness import (
    LORA_ADAPTER_NAME,
    AgenticSessionShard,
    DeviceDirectBackend,
    Model,
    SGLangBackendAdapter,
    SessionSpec,
)
from tests.integrations.relax_surface import RELAX_SURFACE, row

FAST = Deadlines(begin=5, bucket=5, end=20, cleanup=5, commit=2, reclaim=10)  # end: the first load imports torch
EPOCH = 7
#: The LoRA slots of a Relax run's SGLang at the default capacity (3): sglang_overrides()
RELAX_SLOTS = 5


# ------------------------------------------------------------------------------------------------
# The table: the stand-ins are what was read in Relax
# ------------------------------------------------------------------------------------------------

STAND_INS: dict[str, Any] = {
    "AgenticChatRequestError": harness.AgenticChatRequestError,
    "AgenticSessionShard": AgenticSessionShard,
    "BackendGenerateResult": harness.BackendGenerateResult,
    "SGLangBackendAdapter": SGLangBackendAdapter,
    "DeviceDirectBackend": DeviceDirectBackend,
    "LoraAdapterSync": harness.LoraAdapterSync,
}


def parameters(fn: Any) -> str:
    """A signature as the table writes it: names, ``*`` before keyword-only ones, defaults."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


def _stand_in(cls: str, method: str) -> Any:
    owner = harness if cls == "-" else STAND_INS[cls]
    return inspect.getattr_static(owner, method) if cls != "-" else getattr(owner, method)


@pytest.mark.parametrize("cls, method, params, path, line, commit, kind", RELAX_SURFACE,
                         ids=[f"{r[0]}.{r[1]}" for r in RELAX_SURFACE])
def test_each_stand_in_has_the_signature_read_in_relax(cls, method, params, path, line, commit, kind):
    where = f"{path}:{line} @ {commit[:12]}"
    if kind == "const":
        assert repr(getattr(harness, method)) == params, f"{method} at {where}"
        return
    fn = _stand_in(cls, method)
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    assert parameters(fn) == params, f"{cls}.{method} at {where}"
    assert inspect.iscoroutinefunction(fn) == (kind == "async"), f"{cls}.{method} at {where} is {kind}"


def test_lorapubs_stand_ins_for_relax_keep_relaxs_signatures():
    # the wrapper replaces SGLangBackendAdapter.generate at `self._generation_backend.generate(...)`
    assert parameters(LorapubGenerationBackend.generate) == row("SGLangBackendAdapter", "generate")[2]
    assert inspect.iscoroutinefunction(LorapubGenerationBackend.generate)
    assert parameters(RelaxChatError.__init__) == row("AgenticChatRequestError", "__init__")[2]
    assert parameters(relax_lorapub.GenerateResult) == row("BackendGenerateResult", "__init__")[2].removeprefix("self, ")
    # the weight path keeps update_weights_for_rollout's parameters (plus a keyword for the rollout id)
    assert parameters(relax_lorapub.LorapubWeightPath.update_weights_for_rollout) == (
        row("DeviceDirectBackend", "update_weights_for_rollout")[2] + ", *, rollout_id=None"
    )
    assert relax_lorapub.RELAX_ADAPTER_NAME == LORA_ADAPTER_NAME
    pinned = relax_lorapub.RELAX_COMMITS
    assert {r[3] for r in RELAX_SURFACE} <= set(pinned)
    assert all(pinned[r[3]] == r[5] for r in RELAX_SURFACE)  # one commit per file, the same everywhere


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


class SharedRegistry:
    """Stands in for lorapub's Ray registry actor: one writer, shared by the trainer's publication
    thread and the shard loop, one command at a time. Counts commands by name."""

    def __init__(self, inner: LocalRegistry) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.commands: Counter[str] = Counter()

    async def handle(self, command):
        with self.lock:
            self.commands[type(command).__name__] += 1
            return self.inner.apply(command)

    def digest_of(self, version_id: str) -> str:
        with self.lock:
            return self.inner.apply(ReadState()).reply.versions[VersionKey(EPOCH, version_id)].digest


def relax_args(tmp_path, *, enabled: bool, urls=(), settings: dict | None = None) -> argparse.Namespace:
    parser = add_arguments(argparse.ArgumentParser())
    argv: list[str] = []
    if enabled:
        path = tmp_path / "lorapub.json"
        path.write_text(json.dumps({"epoch": EPOCH, "transport": "http", "registry": "", **(settings or {})}))
        argv = [ENABLE_FLAG, CONFIG_FLAG, str(path)]
    args = parser.parse_args(argv)
    # Relax's own LoRA arguments (LoraAdapterSync.config_dict reads them)
    args.lora_rank, args.lora_alpha, args.lora_dropout = 8, 16, 0.0
    args.lora_target_modules = ["q_proj", "v_proj"]
    args.lora_adapter_mode, args.lora_merge_mode = True, False
    args.worker_urls = list(urls)  # the stand-in router's /workers
    validate_args(args)
    return args


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@dataclass
class Relax:
    doubles: list[SGLangDouble]
    shard: AgenticSessionShard
    device: DeviceDirectBackend
    model: Model
    registry: SharedRegistry | None
    args: argparse.Namespace

    @property
    def lorapub(self) -> relax_lorapub.RelaxLorapub:
        return self.shard._lorapub

    @property
    def path(self) -> relax_lorapub.LorapubWeightPath | None:
        return self.device._lorapub_path

    async def update_weights(self, rollout_id: int | None = None, *, rollout_only: bool = True) -> None:
        if self.path is None:  # Relax's own method: it takes no rollout id
            await asyncio.to_thread(self.device.update_weights_for_rollout, rollout_only, False)
        else:
            await asyncio.to_thread(self.device.update_weights_for_rollout, rollout_only, False, rollout_id=rollout_id)

    async def step(self, rollout_id: int, **kw) -> None:
        """One optimizer step, then the weight update of rollout ``rollout_id``."""
        self.model.step = rollout_id
        await self.update_weights(rollout_id, **kw)

    async def settle(self) -> None:
        await self.lorapub.deployment.settle()
        await asyncio.to_thread(self.path.publisher.settle)

    def managed(self) -> set[str]:
        return {n for d in self.doubles for n in d.registered() if n != LORA_ADAPTER_NAME}

    def lifecycle_events(self, marks: list[int]) -> list[str]:
        return [kind for d, m in zip(self.doubles, marks) for kind, _ in d.events[m:]
                if kind in ("pause", "flush", "continue")]


async def make_relax(tmp_path, *, enabled: bool, settings: dict | None = None, registry_options: dict | None = None,
                     background: bool = False, request_capacity: int | None = None) -> Relax:
    prefix = (settings or {}).get("name_prefix", DEFAULT_NAME_PREFIX)  # the engines protect the integration's names
    doubles = [await SGLangDouble("e0", max_loaded_loras=RELAX_SLOTS, managed_prefix=prefix).start(), await SGLangDouble("e1", max_loaded_loras=RELAX_SLOTS, managed_prefix=prefix).start()]
    urls = [d.url for d in doubles]
    args = relax_args(tmp_path, enabled=enabled, urls=urls, settings=settings)
    shared = None
    if enabled:
        incarnations = {engine_name(d.url): d.incarnation for d in doubles}
        shared = SharedRegistry(LocalRegistry(EPOCH, incarnations, name_prefix=prefix, **(registry_options or {})))
        options = {"registry": shared, "deadlines": FAST, "bucket_cap_bytes": 8 << 10}
        harness.INJECT["shard"] = options
        harness.INJECT["trainer"] = {
            "publisher": lambda: LorapubPublisher(args, worker_urls=urls, **options), "background": background,
        }
    try:
        shard = AgenticSessionShard(args, request_capacity, None, None)
        model = Model(peft_lora_state_dict)
        device = DeviceDirectBackend(args, "nccl", None, [model], model_name="tiny-qwen3", quantization_config=None)
    finally:
        harness.INJECT["shard"], harness.INJECT["trainer"] = {}, {}
    device.init_process_group_for_rollout({i: {"ip": "127.0.0.1", "port": _port(u)} for i, u in enumerate(urls)})
    await shard.resume_generation(0)  # the runtime opens the train gate
    return Relax(doubles, shard, device, model, shared, args)


async def teardown(relax: Relax) -> None:
    try:
        await relax.shard.shutdown()
        if relax.path is not None:
            await asyncio.to_thread(relax.path.close)
    finally:
        for d in relax.doubles:
            await d.stop()


@pytest.fixture
async def relax_on(tmp_path):
    relax = await make_relax(tmp_path, enabled=True)
    yield relax
    await teardown(relax)


def specs(*session_ids: str) -> tuple[SessionSpec, ...]:
    return tuple(SessionSpec(metadata={}, input_payload=None, sampling_params=None, session_id=s) for s in session_ids)


async def ask(shard: AgenticSessionShard, session_id: str, tokens, n: int = 4) -> dict:
    """What an agent's OpenAI call reaches: ``chat`` (content = token ids, the template left out)."""
    return await shard.chat(session_id=session_id, messages=[{"role": "user", "content": list(tokens)}], tools=[],
                            chat_template_kwargs={}, max_completion_tokens=n, stop=None, seed=None)


async def start_group(relax: Relax, group_id: str, *session_ids: str, rollout_id: int = 1, n: int = 4,
                      lease: bool = True) -> dict[str, asyncio.Task]:
    """``RuntimeDomain.prepare_group`` + ``lease_group``: every member's first turn is asked (the
    first-request barrier), then the group is leased and its requests dispatched."""
    await relax.shard.start_group("train", group_id, specs(*session_ids))
    turns = {sid: asyncio.create_task(ask(relax.shard, sid, [1, 2, 3], n)) for sid in session_ids}
    for _ in range(1000):
        if relax.shard._groups[group_id].first_request_barrier_crossed:
            break
        await asyncio.sleep(0.002)
    if lease:
        await relax.shard.lease_group(group_id, rollout_id)
    return turns


def served(relax: Relax, session_id: str) -> dict:
    """The lorapub provenance of the session's last response (its export metadata)."""
    return relax.shard._session_records[session_id].forest.leaf_patch["lorapub"]


# ------------------------------------------------------------------------------------------------
# The shard side
# ------------------------------------------------------------------------------------------------


async def test_a_group_binds_as_one_across_a_publication(tmp_path):
    # capacity 1 of the fleet-global SGLang permit: the second member's first request waits for the first's
    relax = await make_relax(tmp_path, enabled=True, request_capacity=1)
    try:
        await relax.step(1)  # the first sync: Relax's base sync, then the adapter as version step1
        generate, hold = relax.lorapub.generate, asyncio.Event()

        async def held(session_id, payload):  # s1's first request binds, then waits holding the permit
            if session_id == "s1" and not hold.is_set():
                await relax.lorapub.member("s1").bind()
                await hold.wait()
            return await generate(session_id, payload)

        relax.lorapub.generate = held
        turns = await start_group(relax, "g1", "s1", "s2")
        for _ in range(1000):
            if relax.lorapub.member("s1").binding is not None:
                break
            await asyncio.sleep(0.002)
        await relax.step(2)  # step2 becomes the default while s2's first request waits for the permit
        assert relax.lorapub.member("s2").binding is None
        hold.set()
        results = await asyncio.gather(*turns.values())
        assert all("error" not in r for r in results), results

        assert served(relax, "s1")["version_id"] == "step1"
        assert served(relax, "s2")["version_id"] == "step1"  # the group's version, not the new default
        assert served(relax, "s2")["rebinds"] == 0
        await relax.lorapub.deployment.reconcile()  # the shard's view of the fleet: step2 is the default
        await ask(relax.shard, "s2", [6])
        assert served(relax, "s2")["version_id"] == "step1" and served(relax, "s2")["lag"] == 1
        again = await ask(relax.shard, "s1", [5, 5])
        assert "error" not in again and served(relax, "s1")["version_id"] == "step1"

        await asyncio.gather(*(await start_group(relax, "g2", "s3")).values())
        assert served(relax, "s3")["version_id"] == "step2"  # a new group binds the new default
        name = served(relax, "s1")["lora_name"]
        assert name.endswith("-step1-" + relax.registry.digest_of("step1")[:12])

        for sid in ("s1", "s2"):
            await relax.shard.finish_agent(sid)
        exports = await relax.shard.take_session_results("g1", ("s1", "s2"))
        assert [e["metadata"]["lorapub"]["version_id"] for e in exports] == ["step1", "step1"]
        # the engine's stamp, checked against the binding, is in the exported sample (docs/provenance.md)
        stamps = [e["metadata"]["lorapub"]["stamp"] for e in exports]
        assert all(st is not None and st["lora_name"] == name for st in stamps)
        assert {st["digest"] for st in stamps} == {relax.registry.digest_of("step1")}
    finally:
        await teardown(relax)


async def test_pause_and_resume_keep_the_binding(relax_on):
    await relax_on.step(1)
    turns = await start_group(relax_on, "g", "long", "short", n=4)
    await turns.pop("short")
    await asyncio.gather(*turns.values())
    record = relax_on.shard._session_records["long"]
    pending = asyncio.create_task(ask(relax_on.shard, "long", [9, 9], n=400))  # a long turn
    for _ in range(2000):
        if any(d.running_rids for d in relax_on.doubles):
            break
        await asyncio.sleep(0.002)
    ir = next(iter(record.live_irs))
    assert ir.backend_started and ir.abort_count == 0

    await relax_on.shard.pause_generation()  # aborts the running request; its IR waits behind the gate
    assert ir.abort_count == 1 and ir.pending_status == "aborted" and ir in record.queued_irs
    assert any(("abort_request", f"{ir.request_id}:0") in d.events for d in relax_on.doubles)
    assert len(ir.pending_token_delta) < 400  # what it made before the abort is kept on the IR

    await relax_on.step(2)  # the weights move on while paused
    await relax_on.shard.resume_generation(2)
    answer = await pending
    assert "error" not in answer and len(answer["message"]["content"]) == 400
    provenance = served(relax_on, "long")
    assert provenance["version_id"] == "step1" and provenance["rebinds"] == 0  # resumed on its version
    assert relax_on.lorapub.member("long").requests == 3  # first turn, the aborted attempt, the resumed one
    assert record.rollout_id == 2


async def test_finish_and_drop_release_refs_and_the_old_version_is_reclaimed(relax_on):
    await relax_on.step(1)
    await asyncio.gather(*(await start_group(relax_on, "g1", "a1", "a2")).values())
    await relax_on.step(2)
    await asyncio.gather(*(await start_group(relax_on, "g2", "b1", "b2")).values())
    old = served(relax_on, "a1")["lora_name"]
    new = served(relax_on, "b1")["lora_name"]

    await relax_on.shard.finish_agent("a1")
    await relax_on.settle()
    assert old in relax_on.managed()  # a2 still holds the group's version

    await relax_on.shard.drop_group("g2")  # a failed group: both members released
    assert relax_on.lorapub.member("b1") is None and relax_on.lorapub.member("b2") is None
    assert relax_on.registry.commands["CloseAndRelease"] == 3

    await relax_on.shard.finish_agent("a2")  # the group's last member: the group lets step1 go
    await relax_on.shard.release_group("g1")
    await relax_on.settle()
    assert relax_on.managed() == {new}
    assert all(d.physical_unloads.count(old) == 1 for d in relax_on.doubles)
    assert relax_on.registry.commands["CloseAndRelease"] == 4  # each member exactly once


async def test_drop_releases_a_member_whose_finish_did_not(relax_on):
    await relax_on.step(1)
    await asyncio.gather(*(await start_group(relax_on, "g", "x1", "x2")).values())
    release = relax_on.lorapub.release
    skipped: list[str] = []

    async def lost(session_id):  # a finish that never reached its release (it failed earlier)
        skipped.append(session_id)

    relax_on.lorapub.release = lost
    try:
        await relax_on.shard.drop_group("g")
    finally:
        relax_on.lorapub.release = release
    assert sorted(skipped) == ["x1", "x2"]
    assert relax_on.lorapub.member("x1") is None and relax_on.registry.commands["CloseAndRelease"] == 2


async def test_shutdown_closes_lorapub_then_relaxs_backend(relax_on):
    await relax_on.step(1)
    await asyncio.gather(*(await start_group(relax_on, "g", "s1", "s2")).values())
    backend = relax_on.shard._generation_backend
    assert isinstance(backend, LorapubGenerationBackend)
    deployment = relax_on.lorapub.deployment

    await relax_on.shard.shutdown()
    assert relax_on.registry.commands["CloseAndRelease"] == 2
    assert deployment.closed and not relax_on.lorapub.open_sessions
    assert backend.inner.shut_down  # Relax's own shutdown ran after lorapub's
    with pytest.raises(lorapub.SessionClosed):
        await relax_on.lorapub.start()


async def test_chat_answers_lorapub_refusals_as_typed_relax_errors(tmp_path):
    relax = await make_relax(tmp_path, enabled=True, registry_options={"max_lag": 0, "on_stale": "error"},
                             settings={"first_version_wait": 0.3})
    try:
        shard = relax.shard
        # NO_PUBLISHED_VERSION: nothing is published within first_version_wait
        early = await asyncio.gather(*(await start_group(relax, "g", "s1", "s2")).values())
        assert [r["_http_status"] for r in early] == [503, 503]
        assert {r["error"]["code"] for r in early} == {"NO_PUBLISHED_VERSION"}
        assert early[0]["error"]["type"] == "lorapub_error"
        assert "g" in shard._groups and len(shard._groups["g"].sessions) == 2  # the group is not dropped

        await relax.step(1)
        assert "error" not in await ask(shard, "s1", [4, 4])  # the same group binds once a version exists

        # VERSION_MISSING: an engine refused the exact bound version
        generate = relax.lorapub.generate

        async def missing(session_id, payload):
            relax.lorapub.generate = generate
            raise VersionMissing("e0 does not hold the bound version")

        relax.lorapub.generate = missing
        refused = await ask(shard, "s2", [4, 4])
        assert (refused["_http_status"], refused["error"]["code"]) == (503, "VERSION_MISSING")
        assert "error" not in await ask(shard, "s2", [4, 4, 1])  # the agent's retry, same binding

        # an error that is not lorapub's stays Relax's 500 (unchanged)
        async def broken(session_id, payload):
            relax.lorapub.generate = generate
            raise RuntimeError("boom")

        relax.lorapub.generate = broken
        internal = await ask(shard, "s2", [4])
        assert (internal["_http_status"], internal["error"]["code"]) == (500, "internal_error")

        # a context-length refusal keeps Relax's own branch (BackendContextLengthExceededError)
        long = await ask(shard, "s2", list(range(5000)))
        assert long["error"]["code"] == "context_length_exceeded"

        # BINDING_STALE: max_lag=0, so step1 retires when step2 commits
        await relax.step(2)
        await relax.lorapub.deployment.reconcile()  # the shard's view of the fleet
        stale = await ask(shard, "s1", [4, 4, 2])
        assert (stale["_http_status"], stale["error"]["code"]) == (410, "BINDING_STALE")
        assert "s1" in shard._session_records and "g" in shard._groups  # the session ends the Relax way
    finally:
        await teardown(relax)


async def test_without_a_lorapub_session_a_request_is_refused_typed_not_sent(relax_on):
    await relax_on.step(1)
    backend = relax_on.shard._generation_backend
    with pytest.raises(harness.AgenticChatRequestError) as refused:
        await backend.generate(input_ids=[1], sampling_params={"max_new_tokens": 1}, session_id="nobody",
                               request_id="r:0")
    assert (refused.value.code, refused.value.status_code) == ("SESSION_CLOSED", 404)
    assert isinstance(refused.value.__cause__, lorapub.SessionClosed)
    assert backend.inner.generate_calls == 0
    assert relax_lorapub.error_result(NoPublishedVersion("none yet"))["error"]["code"] == "NO_PUBLISHED_VERSION"
    closed = relax_lorapub.error_result(lorapub.DeploymentClosed("closed at shutdown"))
    assert (closed["_http_status"], closed["error"]["code"]) == (410, "DEPLOYMENT_CLOSED")  # never Relax's 500


# ------------------------------------------------------------------------------------------------
# The trainer side
# ------------------------------------------------------------------------------------------------


async def test_the_weight_path_publishes_the_exact_tensors_with_no_pause_or_flush(relax_on):
    device, path = relax_on.device, relax_on.path
    assert path is not None and device.update_weights_for_rollout == path.update_weights_for_rollout
    await relax_on.step(1)  # the first update is Relax's own: the base, once, under pause
    assert device.base_syncs == 1 and relax_on.lifecycle_events([0, 0]).count("pause") == 2
    engines = list(path.publisher.lorapub.deployment.engines.values())
    assert engines and all(type(e) is SGLangWireEngine and type(e.transport) is HTTPBytes for e in engines)

    marks = [len(d.events) for d in relax_on.doubles]
    await relax_on.step(2)
    await relax_on.step(3, rollout_only=False)  # actor_fwd/reference too: Relax's path, nothing paused
    assert relax_on.lifecycle_events(marks) == []  # no pause, no flush, no continue reached an engine
    assert device.base_syncs == 1 and device.actor_fwd_syncs == 1 and device.weight_version == 3

    config = device._lora_sync.config_dict()
    outcomes = path.outcomes
    assert [(o.version_id, o.status) for o in outcomes] == [("step1", "published"), ("step2", "published"),
                                                          ("step3", "published")]
    for step, outcome in enumerate(outcomes, start=1):
        expected = Snapshot(peft_lora_state_dict(step), config).digest  # the bytes Relax would have pushed
        assert outcome.digest == expected == relax_on.registry.digest_of(f"step{step}")
    report = outcomes[-1].report
    assert all(report.lora_name in d.registered() for d in relax_on.doubles)

    await relax_on.update_weights(4)  # the adapter did not change: nothing to publish
    assert len(path.outcomes) == 3 and device.weight_version == 4


async def test_a_superseded_publication_is_logged_and_does_not_fail_the_step(tmp_path, caplog):
    relax = await make_relax(tmp_path, enabled=True, settings={"publish_wait": 30}, background=True)
    try:
        path = relax.path
        await relax.step(1)
        await asyncio.to_thread(path.wait, 30)
        await asyncio.gather(*(await start_group(relax, "g", "s1")).values())  # holds step1
        await relax.step(2)
        await asyncio.to_thread(path.wait, 30)
        caplog.set_level(logging.INFO, logger="lorapub.integrations.relax")
        await relax.step(3)  # both slots are held: step3 waits for one (the step returns at once)
        for _ in range(2000):
            if relax.registry.commands["Reserve"] >= 3:
                break
            await asyncio.sleep(0.005)
        await relax.step(4)  # step4 takes step3's place in the wait
        for _ in range(2000):
            if path.outcomes[2].status != "pending":
                break
            await asyncio.sleep(0.005)
        assert path.outcomes[2].status == "superseded"
        assert any("superseded" in r.getMessage() and "step3" in r.getMessage() for r in caplog.records)

        await relax.shard.finish_agent("s1")  # step1 is let go: step4 gets its slot
        outcomes = await asyncio.to_thread(path.wait, 30)
        assert [(o.version_id, o.status) for o in outcomes] == [
            ("step1", "published"), ("step2", "published"), ("step3", "superseded"), ("step4", "published")]
        relax.model.step = 5
        await relax.update_weights(5)  # no failure is reported at the next update
        await asyncio.to_thread(path.wait, 30)
    finally:
        await teardown(relax)


async def test_with_lorapub_off_relaxs_own_paths_run_unchanged(tmp_path):
    relax = await make_relax(tmp_path, enabled=False)
    try:
        shard, device = relax.shard, relax.device
        assert type(shard._generation_backend) is SGLangBackendAdapter  # not wrapped
        assert relax.path is None
        assert device.update_weights_for_rollout.__func__ is DeviceDirectBackend.update_weights_for_rollout

        await relax.step(1)
        for d in relax.doubles:
            kinds = [kind for kind, _ in d.events]
            assert kinds.index("pause") < kinds.index("flush") < kinds.index("load") < kinds.index("continue")
            assert d.registered() == [LORA_ADAPTER_NAME]
        results = await asyncio.gather(*(await start_group(relax, "g", "s1", "s2")).values())
        assert all("error" not in r for r in results)
        assert shard._generation_backend.generate_calls == 2  # Relax's own request path
        assert "lorapub" not in shard._session_records["s1"].forest.leaf_patch

        marks = [len(d.events) for d in relax.doubles]
        await relax.step(2)
        assert relax.lifecycle_events(marks) == ["pause", "flush", "continue"] * 2  # the old overwrite, as before
        await relax.shard.finish_agent("s1")
        assert not relax.lorapub.enabled and relax.lorapub.deployment is None
    finally:
        await teardown(relax)


# ------------------------------------------------------------------------------------------------
# Names and options: no collision with Relax's
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("existing, clash", [
    ("--enable-lorapub", "already defined"),
    ("--lorapub", "prefix-conflicting"),  # a prefix of --lorapub-config
    ("--lorapub-config-path", "prefix-conflicting"),
    ("--enable-lorapub-all", "prefix-conflicting"),
])
def test_an_option_clash_is_refused_with_a_message_naming_it(existing, clash):
    parser = argparse.ArgumentParser()
    parser.add_argument(existing)
    with pytest.raises(OptionClash, match=clash) as refused:
        add_arguments(parser)
    assert existing in str(refused.value) and "lorapub registers nothing" in str(refused.value)
    assert ENABLE_FLAG not in parser._option_string_actions or existing == ENABLE_FLAG


def test_an_attribute_clash_is_refused_too():
    parser = argparse.ArgumentParser()
    parser.add_argument("--use-lorapub", dest="enable_lorapub", action="store_true")
    with pytest.raises(OptionClash, match=r"writes args\.enable_lorapub, which --use-lorapub already writes"):
        add_arguments(parser)


def test_relax_pr_377s_options_do_not_clash_but_both_switches_on_are_refused(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-versioned-lora-publication", action="store_true")
    parser.add_argument("--lora-publication-config")
    add_arguments(parser)  # different names: both can be declared
    args = parser.parse_args([ENABLE_FLAG, "--enable-versioned-lora-publication"])
    args.lora_rank, args.lora_adapter_mode = 8, True
    with pytest.raises(InvalidInput, match=r"--enable-versioned-lora-publication \(Relax PR #377's first design"):
        validate_args(args)


@pytest.mark.parametrize("prefix, family", [
    ("relax_policy_lora@", "relax_policy_lora"),  # PR #377's first design, inside Relax's fixed name
    ("relax_policy_lora_v2@", "relax_policy_lora"),  # lorapub's names would read as Relax's adapter
    ("relax_policy@", "relax_policy@"),  # PR #377's redesign
])
def test_a_name_prefix_clashing_with_relaxs_names_is_refused(prefix, family):
    with pytest.raises(OptionClash, match=f"clashes with '{family}'"):
        check_name_prefix(prefix)
    with pytest.raises(OptionClash):
        LorapubConfig(name_prefix=prefix)
    # a prefix must end its names' managed part with '@' (never in an id): "relax_" would make Relax's
    # own fixed name look managed, and is refused for its form already
    with pytest.raises(InvalidInput, match="followed by '@'"):
        check_name_prefix("relax_")


def test_the_default_prefix_is_outside_relaxs_names_and_goes_to_the_engines():
    assert check_name_prefix(DEFAULT_NAME_PREFIX) == "lorapub@"
    config = LorapubConfig()
    assert relax_lorapub.engine_env(config) == {"SGLANG_LORAPUB_MANAGED_PREFIX": "lorapub@"}
    assert relax_lorapub.sglang_overrides(LorapubConfig(capacity=3)) == {"max_loras_per_batch": 5, "max_loaded_loras": 5}
    assert relax_lorapub.sglang_overrides(LorapubConfig()) == {"max_loras_per_batch": RELAX_SLOTS, "max_loaded_loras": RELAX_SLOTS}


async def test_versions_carry_the_integrations_prefix_which_the_engines_must_protect(tmp_path):
    double = await SGLangDouble("e0", max_loaded_loras=RELAX_SLOTS, managed_prefix="lorapub_test@").start()
    try:
        args = relax_args(tmp_path, enabled=True, settings={"name_prefix": "lorapub_test@"})
        engine = SGLangWireEngine("e0", double.url)
        pub = relax_lorapub.RelaxLorapub(args, engines={"e0": engine}, deadlines=FAST)
        await pub.start()
        assert pub.name_prefix_applied is True
        report = await pub.deployment.publish(lora_snapshot(1), "step1")
        assert report.lora_name.startswith("lorapub_test@")
        await pub.aclose()
        await engine.close()

        other = relax_args(tmp_path, enabled=True, settings={"name_prefix": "lorapub_other@"})
        engine = SGLangWireEngine("e0", double.url)
        pub = relax_lorapub.RelaxLorapub(other, engines={"e0": engine}, deadlines=FAST)
        with pytest.raises(EngineError, match="SGLANG_LORAPUB_MANAGED_PREFIX=lorapub_other@"):
            await pub.start()  # the engine protects another prefix: refused before anything is sent
        await pub.aclose()
        await engine.close()
    finally:
        await double.stop()


# ------------------------------------------------------------------------------------------------
# Arguments, configuration, imports
# ------------------------------------------------------------------------------------------------


def test_a_closed_publisher_refuses_with_deployment_closed():
    """After close(), a publish call is DEPLOYMENT_CLOSED saying to make a new publisher (not a bare
    RuntimeError), and close() again is a no-op."""
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args([ENABLE_FLAG])
    args.lora_rank, args.lora_adapter_mode, args.lora_merge_mode = 8, True, False
    validate_args(args)
    publisher = LorapubPublisher(args, engines={})
    publisher.close()
    with pytest.raises(DeploymentClosed, match="make a new one") as refused:
        publisher.publish(lora_snapshot(1), "step1")
    assert refused.value.code == "DEPLOYMENT_CLOSED"
    publisher.close()


def test_arguments_follow_relaxs_convention_and_the_config_is_one_block(tmp_path):
    parser = argparse.ArgumentParser()
    assert add_arguments(parser) is parser  # Relax chains `parser = add_x_arguments(parser)`
    off = parser.parse_args([])
    assert off.enable_lorapub is False and relax_lorapub.config_from_args(off) is None
    assert validate_args(off) is None

    block = tmp_path / "lorapub.yaml"
    block.write_text("capacity: 4\nmax_lag: 2\non_stale: rebind\ntransport: nccl\n")
    on = parser.parse_args([ENABLE_FLAG, CONFIG_FLAG, str(block)])
    on.lora_rank, on.lora_adapter_mode, on.lora_merge_mode = 8, False, False
    with pytest.raises(InvalidInput, match="--lora-adapter-mode"):
        validate_args(on)
    on.lora_adapter_mode = True
    config = validate_args(on)
    assert (config.capacity, config.max_lag, config.on_stale, config.transport) == (4, 2, "rebind", "nccl")
    assert isinstance(config.epoch, int) and relax_lorapub.config_from_args(on) == config  # fixed once, on args
    bare = parser.parse_args([ENABLE_FLAG])
    with pytest.raises(InvalidInput, match="validate_args"):  # an actor never picks its own epoch
        relax_lorapub.RelaxLorapub(bare)
    block.write_text("capacity: 2\nbogus: 1\n")
    with pytest.raises(InvalidInput, match="unknown lorapub setting"):
        LorapubConfig.from_file(str(block))
    block.write_text("capacity: 3\nmax_lag: 2\n")  # max_lag 2 needs 4 slots: refused before any actor starts
    with pytest.raises(InvalidInput, match="set capacity: 4 or more, or max_lag: 1 or less"):
        LorapubConfig.from_file(str(block))
    with pytest.raises(InvalidInput, match="max_lag must be an int"):
        LorapubConfig(max_lag=-1)
    assert relax_lorapub.version_id_for(12) == "step12"
    assert engine_name("http://10.0.0.7:30000/") == "10.0.0.7_30000"


def test_the_hooks_import_without_relax_megatron_ray_torch_or_aiohttp():
    blocked = ["aiohttp", "megatron", "ray", "relax", "safetensors", "sglang", "torch", "yaml"]
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import argparse, lorapub.integrations.relax as r\n"
        "args = r.add_arguments(argparse.ArgumentParser()).parse_args([])\n"
        "pub = r.RelaxLorapub(args)\n"
        "inner = object()\n"
        "assert pub.wrap_backend(inner) is inner and r.install_weight_path(type('B', (), {'args': args})()) is None\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in " + repr(blocked) + "]\n"
        "assert not bad, bad\n"
        "print('ok', pub.enabled)\n"
    )
    src = str(pathlib.Path(lorapub.__file__).parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok False"


def test_the_hooks_use_only_lorapubs_public_face():
    package = pathlib.Path(relax_lorapub.__file__).parent
    modules, names = set(), set()
    for node in (n for f in sorted(package.glob("*.py")) for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lorapub"):
            modules.add(node.module)
            if node.module == "lorapub":
                names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("lorapub")}
    # lorapub.ports: the protocols lorapub documents for embedders (the types of engines, registry, copies)
    assert modules <= {"lorapub", "lorapub.ports", "lorapub.adapters.sglang_wire", "lorapub.adapters.ray_registry",
                       "lorapub.adapters.prometheus"}, modules
    assert names <= set(lorapub.__all__), names


def test_nothing_names_relaxs_gone_hooks_or_its_old_home():
    gone = ["_register_session", "scope_id", "_discard_session_locked", "finalize_and_discard", "discard_session",
            "_clear_removed_record_state", "partial_resume", "redai-infra"]
    here = pathlib.Path(__file__).parent
    files = [*sorted(pathlib.Path(relax_lorapub.__file__).parent.glob("*.py")), here / "relax_harness.py",
             here.parent.parent / "docs" / "relax.md"]
    for path in files:
        text = path.read_text()
        assert not [g for g in gone if g in text], path


async def test_a_failed_start_closes_the_adapters_it_built_and_a_retry_builds_new_ones(tmp_path):
    double = await SGLangDouble("e0", max_loaded_loras=RELAX_SLOTS, managed_prefix="lorapub@").start()  # as engine_env() launches it
    args = relax_args(tmp_path, enabled=True, settings={"registry": "lorapub_test_registry"})
    pub = relax_lorapub.RelaxLorapub(args, worker_urls=[double.url], deadlines=FAST)
    built: list = []
    build = pub._build_engines

    async def spy():
        engines = await build()
        built.extend(engines.values())
        return engines

    async def registry_down(engines, options):  # as a Ray registry that fails after the engines were asked
        for engine in engines.values():
            await engine.incarnation()
        raise RuntimeError("the Ray cluster is unreachable")

    async def no_ray(engines, options):  # this test's stand-in for a reachable Ray registry: in-process
        return None

    pub._build_engines, pub._shared_registry = spy, registry_down
    try:
        with pytest.raises(RuntimeError, match="unreachable"):
            await pub.start()
        assert built and all(e.client.current_http.closed for e in built) and pub._built_engines == []
        pub._shared_registry = no_ray  # the cluster is back: the retry starts with adapters of its own
        await pub.start()
        assert len(built) == 2 and built[1] is not built[0]
        assert (await pub.deployment.publish(lora_snapshot(1), "step1")).lora_name
    finally:
        await pub.aclose()
        await double.stop()


async def test_an_in_process_registry_is_refused_for_relaxs_own_workers(tmp_path):
    # trainer and shards are processes of their own: registries of their own would unload each other's versions
    args = relax_args(tmp_path, enabled=True, settings={"registry": ""})
    pub = relax_lorapub.RelaxLorapub(args, worker_urls=["http://127.0.0.1:9"], deadlines=FAST)
    with pytest.raises(InvalidInput, match="set registry: <a Ray actor name>"):
        await pub.start()
    await pub.aclose()


@pytest.mark.parametrize("error, details, status", [
    ("capacity", {"held_by_sessions": 2, "waiting_on_engines": []}, "deferred"),  # sessions keep the slots
    # an engine still running requests on the version it unloads: it confirms once they end
    ("capacity", {"held_by_sessions": 0, "waiting_on_engines": ["e1"], "unreachable_engines": []}, "deferred"),
    ("capacity", {"held_by_sessions": 1, "waiting_on_engines": ["e1"], "unreachable_engines": ["e1"]}, "deferred"),
    # only an engine that does not answer: every later step would find the same
    ("capacity", {"held_by_sessions": 0, "waiting_on_engines": ["e1"], "unreachable_engines": ["e1"]}, "failed"),
    ("blocked", {"attempt": "1-A#a1"}, "deferred"),  # waiting behind another publication
    ("blocked", {"attempt": "1-B#a2", "waiting_on_engines": ["e1"], "unreachable_engines": []}, "deferred"),
    ("blocked", {"attempt": "1-B#a2", "waiting_on_engines": ["e1"], "unreachable_engines": ["e1"]}, "failed"),
    ("blocked", {"version": "1-C", "failed": True}, "failed"),  # this step's own publication failed
])
def test_a_step_is_deferred_only_when_a_later_step_can_succeed(tmp_path, error, details, status):
    import concurrent.futures
    import types

    from lorapub import CapacityError, PublicationBlocked
    from lorapub.integrations.relax.trainer import LorapubWeightPath, PublishOutcome

    backend = types.SimpleNamespace(args=relax_args(tmp_path, enabled=True))
    path = LorapubWeightPath(backend, None, original=lambda *a: None, rank=lambda: 0, background=True)
    future: concurrent.futures.Future = concurrent.futures.Future()
    cls = CapacityError if error == "capacity" else PublicationBlocked
    future.set_exception(cls("what the registry said", **details))
    outcome = PublishOutcome("step3", "d" * 64)
    path._settled(outcome, future, background=True)
    assert outcome.status == status
    assert path._take_background_failures() == (status == "failed")  # raised on every rank at the next update


def test_the_guides_config_block_names_every_setting_with_its_default():
    import dataclasses
    import re

    guide = (pathlib.Path(__file__).parents[2] / "docs" / "relax.md").read_text()
    block = guide.split("# lorapub.yaml: every key is optional; these are the defaults\n", 1)[1].split("```", 1)[0]
    said = dict(re.findall(r"^(\w+): (\S+)", block, flags=re.M))
    fields = {f.name: f.default for f in dataclasses.fields(LorapubConfig)}
    assert set(said) == set(fields)
    for name, default in fields.items():
        assert said[name].strip('"') == ("null" if default is None else str(default).lower()
                                         if isinstance(default, bool) else f"{default:g}"
                                         if isinstance(default, float) else str(default)), name


async def test_the_trainer_serves_the_fleets_status_where_the_config_says(tmp_path):
    import aiohttp

    double = await SGLangDouble("e0", max_loaded_loras=RELAX_SLOTS, managed_prefix="lorapub@").start()
    engine = SGLangWireEngine("e0", double.url)
    args = relax_args(tmp_path, enabled=True, settings={"status": "127.0.0.1:0"})
    pub = relax_lorapub.RelaxLorapub(args, role="trainer", engines={"e0": engine}, deadlines=FAST)
    try:
        await pub.start()
        await pub.deployment.publish(lora_snapshot(1), "step1")
        url = pub.deployment.status_server.url
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/status") as r:
                assert r.status == 200 and (await r.json())["default"].endswith("-step1")
            async with http.get(url + "/metrics") as r:
                assert r.status == 200 and 'lorapub_publications_total{outcome="committed"} 1.0' in await r.text()
    finally:
        await pub.aclose()
        await engine.close()
        await double.stop()
    shard = relax_lorapub.RelaxLorapub(args, engines={"e0": SGLangWireEngine("e0", double.url)}, deadlines=FAST)
    assert shard.role == "shard"  # a shard serves none: one endpoint per fleet, the trainer's


@pytest.mark.parametrize("status", ["9464", "host:", "host:http", "host:70000"])
def test_a_status_address_that_is_not_host_port_is_refused_on_the_driver(status):
    with pytest.raises(InvalidInput, match="host:port"):
        LorapubConfig(status=status)
