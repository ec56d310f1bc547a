"""lorapub's Relax hooks, driven through a harness of Relax's own interfaces (tests/integrations/
relax_harness.py, which cites the Relax files it follows) against lorapub's real Deployment and two
SGLang contract doubles (lorapub.testing.SGLangDouble, SGLang's own LoRARegistry inside).

The trainer side (DeviceDirectBackend + BlockingRelaxLoraPublication) runs in a worker thread with
its own event loop, the shard side (AgenticSessionShard + RelaxLoraPublication) on the test loop;
they share one registry, as Relax's trainer and session shards share lorapub's Ray registry actor.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import pathlib
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest

import lorapub
from lorapub import CapacityError, Deadlines, NoPublishedVersion, OverwriteDeployment, SessionClosed
from lorapub.integrations import relax as relax_lora
from lorapub.integrations.relax import (
    ARGUMENT,
    BlockingRelaxLoraPublication,
    RelaxLoraPublication,
    add_arguments,
    engine_name,
    error_result,
    snapshot_from_export,
    validate_args,
)
from lorapub.runtime.registry import LocalRegistry  # the in-process registry docs/embedding.md names
from lorapub.testing import SGLangDouble, peft_lora_state_dict

from tests.integrations.relax_harness import (
    LORA_ADAPTER_NAME,
    AgenticSessionShard,
    DeviceDirectBackend,
    SGLangBackendAdapter,
)

FAST = Deadlines(begin=5, bucket=5, end=20, cleanup=5, commit=2, reclaim=10)  # end: the first load imports torch
MANAGED = LORA_ADAPTER_NAME + "@"


class SharedRegistry:
    """Stands in for lorapub's Ray registry actor: one writer, shared by the trainer thread and the
    shard loop, one command at a time. Counts commands by name (what the tests check)."""

    def __init__(self, inner: LocalRegistry) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.commands: Counter[str] = Counter()

    async def handle(self, command):
        with self.lock:
            self.commands[type(command).__name__] += 1
            return self.inner.apply(command)


class Trainer:
    """What Megatron's LoRA parameters hold: a new seeded adapter per optimizer step."""

    def __init__(self) -> None:
        self.step = 1

    def adapter(self) -> dict[str, Any]:
        return peft_lora_state_dict(self.step)


def relax_args(tmp_path, *, enabled: bool, transport: str | None = None) -> argparse.Namespace:
    parser = add_arguments(argparse.ArgumentParser())
    argv = ([ARGUMENT] if enabled else []) + (["--lora-publication-transport", transport] if transport else [])
    args = parser.parse_args(argv + ["--lora-publication-stash-dir", str(tmp_path / "stash"),
                                     "--lora-publication-epoch", "7", "--lora-publication-registry", ""])
    # Relax's own LoRA arguments (relax/utils/megatron_peft_utils.py reads these attributes)
    args.lora_rank, args.lora_alpha, args.lora_dropout = 8, 16, 0.0
    args.lora_target_modules = ["q_proj", "v_proj"]
    args.lora_adapter_mode, args.lora_merge_mode = True, False
    validate_args(args)
    return args


@dataclass
class Relax:
    doubles: list[SGLangDouble]
    shard: AgenticSessionShard
    backend: SGLangBackendAdapter
    device: DeviceDirectBackend
    trainer: Trainer
    shard_pub: RelaxLoraPublication
    trainer_pub: BlockingRelaxLoraPublication
    registry: SharedRegistry | None

    async def update_weights(self) -> None:
        await asyncio.to_thread(self.device.update_weights_for_rollout)

    async def register(self, session_id: str, rollout_id: int = 1):
        await self.shard._register_session(session_id=session_id, scope_id="train", rollout_id=rollout_id)
        return self.shard._session_records[session_id]

    async def settle(self) -> None:
        await self.shard_pub.settle()
        await asyncio.to_thread(self.trainer_pub.settle)

    def double_of(self, lora_id: str) -> SGLangDouble:
        return next(d for d in self.doubles if lora_id in d.loaded)


async def make_relax(tmp_path, *, enabled: bool, transport: str | None = None) -> Relax:
    doubles = [await SGLangDouble("e0").start(), await SGLangDouble("e1").start()]
    urls = [d.url for d in doubles]
    args = relax_args(tmp_path, enabled=enabled, transport=transport)
    registry = None
    options: dict[str, Any] = {}
    if enabled:
        registry = SharedRegistry(LocalRegistry(7, {engine_name(d.url): d.incarnation for d in doubles}))
        options = {"registry": registry, "deadlines": FAST, "bucket_cap_bytes": 8 << 10}
    shard_pub = RelaxLoraPublication(args, worker_urls=lambda: _async(urls), **options)  # _sglang_worker_urls
    trainer_pub = BlockingRelaxLoraPublication(args, worker_urls=lambda: urls, **options)  # rollout_topology
    backend = SGLangBackendAdapter(args, worker_urls=urls, lora_publication=shard_pub)
    shard = AgenticSessionShard(args, backend=backend, lora_publication=shard_pub, worker_urls=lambda: urls)
    trainer = Trainer()
    device = DeviceDirectBackend(args, trainer.adapter, rollout_urls=urls, lora_publication=trainer_pub)
    return Relax(doubles, shard, backend, device, trainer, shard_pub, trainer_pub, registry)


async def _async(value):
    return value


@pytest.fixture
async def relax_on(tmp_path):
    relax = await make_relax(tmp_path, enabled=True)
    yield relax
    await teardown(relax)


@pytest.fixture
async def relax_off(tmp_path):
    relax = await make_relax(tmp_path, enabled=False)
    yield relax
    await teardown(relax)


async def teardown(relax: Relax) -> None:
    await relax.shard_pub.aclose()
    await asyncio.to_thread(relax.trainer_pub.close)
    await relax.backend.close()
    for d in relax.doubles:
        await d.stop()


async def turn(relax: Relax, session_id: str, input_ids: list[int], n: int = 4) -> dict:
    return await relax.shard.chat(session_id=session_id, input_ids=input_ids, max_completion_tokens=n)


def managed(relax: Relax) -> set[str]:
    return {name for d in relax.doubles for name in d.registered() if name.startswith(MANAGED)}


def events_since(relax: Relax, marks: list[int]) -> list[tuple[str, str]]:
    return [e for d, m in zip(relax.doubles, marks) for e in d.events[m:]]


# ------------------------------------------------------------------------------------------------
# versioned publication on
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", [None, "shared-dir"])
async def test_adapter_bytes_reach_the_engines_over_http_unless_a_shared_dir_is_chosen(tmp_path, transport):
    from lorapub.adapters.sglang_http import SGLangEngine
    from lorapub.adapters.sglang_wire import SGLangWireEngine

    relax = await make_relax(tmp_path, enabled=True, transport=transport)
    try:
        await relax.update_weights()
        a = relax.device.reports[-1]
        record = await relax.register("s1")
        out = await turn(relax, "s1", [1, 2, 3])
        assert record.lora.lora_path == a.lora_name and out["lora_id"]
        engines = relax.shard_pub._built_engines
        stash = tmp_path / "stash"
        staged = [p for p in stash.rglob("*") if p.is_file()] if stash.exists() else []
        if transport is None:  # the default: each engine stages the bytes itself, nothing shared on disk
            assert engines and all(type(e) is SGLangWireEngine for e in engines)
            assert staged == []
            assert all(d.staging.report()["attempts"] for d in relax.doubles)
        else:
            assert engines and all(type(e) is SGLangEngine for e in engines)
            assert staged  # the version's folder the engines read
    finally:
        await teardown(relax)


async def test_first_generation_binds_and_tool_turns_reuse_the_bound_lora_path(relax_on):
    record = await relax_on.register("s1")
    assert record.lora is not None and record.lora.lora_path is None  # OPEN: nothing bound yet

    early = await turn(relax_on, "s1", [1, 2, 3])  # before any publication: typed, never the base model
    assert early["_http_status"] == 503 and early["error"]["code"] == "NO_PUBLISHED_VERSION"
    assert record.lora.lora_path is None and record.lora.requests == 0

    await relax_on.update_weights()  # step 1: the first sync publishes version A
    a = relax_on.device.reports[-1]
    assert a.lora_name.startswith(MANAGED) and "step1" in a.lora_name

    ids = [1, 2, 3]
    first = await turn(relax_on, "s1", ids)
    assert record.lora.lora_path == a.lora_name  # bound on the first generation, kept on the record
    serving = relax_on.double_of(first["lora_id"])
    assert serving.lora_registry.get_all_adapters()[a.lora_name].lora_id == first["lora_id"]
    for tool_output in ([7, 7], [8], [9, 9, 9]):  # tool turns: history + model output + tool tokens
        ids = ids + first["output_ids"] + tool_output
        first = await turn(relax_on, "s1", ids)
        assert first["lora_id"] == serving.lora_registry.get_all_adapters()[a.lora_name].lora_id
        assert record.lora.lora_path == a.lora_name
    assert record.lora.requests == 4


async def test_a_publication_mid_session_does_not_move_the_bound_session(relax_on):
    await relax_on.update_weights()
    a = relax_on.device.reports[-1]
    await relax_on.register("old")
    r1 = await turn(relax_on, "old", [5, 6, 7])
    marks = [len(d.events) for d in relax_on.doubles]

    relax_on.trainer.step = 2
    await relax_on.update_weights()  # step 2: version B beside A, while "old" is mid-trajectory
    b = relax_on.device.reports[-1]
    assert b.lora_name != a.lora_name
    happened = {kind for kind, _ in events_since(relax_on, marks)}
    assert "pause" not in happened and "flush" not in happened  # no global pause, no KV flush
    assert managed(relax_on) == {a.lora_name, b.lora_name}

    r2 = await turn(relax_on, "old", [5, 6, 7] + r1["output_ids"] + [4])
    assert relax_on.shard._session_records["old"].lora.lora_path == a.lora_name
    assert r2["lora_id"] == r1["lora_id"]  # the same engine-local adapter as its first turn

    new = await relax_on.register("new")
    await turn(relax_on, "new", [5, 6, 7])
    assert new.lora.lora_path == b.lora_name  # new sessions bind the new default


async def test_resume_after_the_partial_resume_gate_and_a_legal_retry_keep_the_binding(relax_on):
    await relax_on.update_weights()
    a = relax_on.device.reports[-1]
    record = await relax_on.register("s", rollout_id=1)
    r1 = await turn(relax_on, "s", [3, 1, 4])

    # Relax parks the session's next request behind the partial-resume gate at the end of rollout 1 ...
    await relax_on.shard.gate_rollout_irs_for_partial_resume(rollout_id=1)
    parked = asyncio.create_task(turn(relax_on, "s", [3, 1, 4] + r1["output_ids"] + [1]))
    await asyncio.sleep(0.05)
    assert not parked.done() and record.ir_queue
    relax_on.trainer.step = 2
    await relax_on.update_weights()  # ... the weights move on (version B) ...
    b = relax_on.device.reports[-1]
    await relax_on.shard.release_partial_resume_gate(rollout_id=2)  # ... and it resumes in rollout 2
    resumed = await parked
    assert "error" not in resumed and record.lora.lora_path == a.lora_name

    # a failed request, retried by the agent (the agentic layer decides; nothing resends on its own)
    serving = relax_on.double_of(resumed["lora_id"])
    serving.inject("generate", "error", count=1, status=500)
    failed = await turn(relax_on, "s", [2, 7])
    assert failed["error"]["code"] == "ENGINE_ERROR"  # typed, code kept
    retried = await turn(relax_on, "s", [2, 7])
    assert "error" not in retried and record.lora.lora_path == a.lora_name
    assert retried["lora_id"] == resumed["lora_id"] and b.lora_name != a.lora_name


async def test_close_releases_exactly_once_and_the_old_version_is_reclaimed_after_settle(relax_on):
    await relax_on.update_weights()
    a = relax_on.device.reports[-1]
    old = await relax_on.register("old")
    await turn(relax_on, "old", [1, 1, 2])
    relax_on.trainer.step = 2
    await relax_on.update_weights()
    b = relax_on.device.reports[-1]
    new = await relax_on.register("new")
    await turn(relax_on, "new", [1, 1, 2])
    await relax_on.settle()
    assert a.lora_name in managed(relax_on)  # an open session still holds A: not reclaimed

    assert (await relax_on.shard.finalize_and_discard(session_id="old"))["status"] == "completed"
    assert await relax_on.shard.discard_session(session_id="old") is False  # already gone
    await relax_on.shard_pub.release(old.lora)  # a second release of the same record is a no-op
    await relax_on.settle()

    assert old.lora.released and old.lora not in relax_on.shard_pub.open_records
    assert relax_on.registry.commands["CloseAndRelease"] == 1
    assert managed(relax_on) == {b.lora_name}
    for d in relax_on.doubles:
        assert d.physical_unloads.count(a.lora_name) == 1
    again = await turn(relax_on, "new", [1, 1, 2, 3])
    assert "error" not in again and new.lora.lora_path == b.lora_name


async def test_a_close_racing_an_in_flight_generation_releases_once_after_the_request_ends(relax_on):
    await relax_on.update_weights()
    a = relax_on.device.reports[-1]
    old = await relax_on.register("old")
    r1 = await turn(relax_on, "old", [4, 4])
    serving = relax_on.double_of(r1["lora_id"])
    relax_on.trainer.step = 2
    await relax_on.update_weights()  # A is retired; only "old" keeps it

    serving.inject("generate", "slow", count=1, delay=0.3)
    pending = asyncio.create_task(turn(relax_on, "old", [4, 4] + r1["output_ids"]))
    for _ in range(200):
        if serving.refs(a.lora_name):
            break
        await asyncio.sleep(0.005)
    assert serving.refs(a.lora_name) == 1  # the request holds SGLang's native ref on A

    assert await relax_on.shard.discard_session(session_id="old") is True
    answer = await pending
    assert answer["error"]["code"] == "session_discarded"
    await relax_on.settle()
    assert old.lora.released and relax_on.registry.commands["CloseAndRelease"] == 1
    assert a.lora_name not in managed(relax_on)
    assert all(d.physical_unloads.count(a.lora_name) == 1 for d in relax_on.doubles)

    with pytest.raises(SessionClosed):  # a late runner of the removed record never sends again
        await relax_on.shard_pub.generate(old.lora, {"input_ids": [1], "sampling_params": {}})


async def test_a_crashed_or_cancelled_close_path_still_releases(relax_on):
    await relax_on.update_weights()
    a = relax_on.device.reports[-1]
    crashed = await relax_on.register("crashed")
    cancelled = await relax_on.register("cancelled")
    r = await turn(relax_on, "crashed", [6, 6])
    await turn(relax_on, "cancelled", [6, 6])
    relax_on.trainer.step = 2
    await relax_on.update_weights()

    # crash: an in-flight request must be aborted, and no worker url is known -> RuntimeError
    relax_on.double_of(r["lora_id"]).inject("generate", "slow", count=1, delay=0.3)
    pending = asyncio.create_task(turn(relax_on, "crashed", [6, 6, 1]))
    await asyncio.sleep(0.05)
    urls, relax_on.shard._worker_urls = relax_on.shard._worker_urls, lambda: []
    with pytest.raises(RuntimeError, match="no SGLang worker urls"):
        await relax_on.shard.discard_session(session_id="crashed")
    relax_on.shard._worker_urls = urls
    pending.cancel()

    # crash earlier still: the close path dies right after the record was removed
    early = await relax_on.register("early")
    await turn(relax_on, "early", [6, 6])

    async def dies(**_):
        raise RuntimeError("shard crashed")

    finish, relax_on.shard._finish_discarded_session = relax_on.shard._finish_discarded_session, dies
    with pytest.raises(RuntimeError, match="shard crashed"):
        await relax_on.shard.discard_session(session_id="early")
    relax_on.shard._finish_discarded_session = finish
    with pytest.raises(SessionClosed):  # removed from the shard: refused at once, before any release ran
        await relax_on.shard_pub.generate(early.lora, {"input_ids": [1], "sampling_params": {}})

    # cancel: the discard is cancelled while it waits on the abort fan-out
    relax_on.shard.abort_delay = 1.0
    slow = relax_on.double_of(r["lora_id"])
    slow.inject("generate", "slow", count=1, delay=0.3)
    other = relax_on.doubles[1 - relax_on.doubles.index(slow)]
    other.inject("generate", "slow", count=1, delay=0.3)
    inflight = asyncio.create_task(turn(relax_on, "cancelled", [6, 6, 2]))
    await asyncio.sleep(0.05)
    discard = asyncio.create_task(relax_on.shard.discard_session(session_id="cancelled"))
    while "cancelled" in relax_on.shard._session_records:
        await asyncio.sleep(0.005)
    discard.cancel()
    with pytest.raises(asyncio.CancelledError):
        await discard
    inflight.cancel()  # its chat waiter is never answered: the close path died before it got there
    await asyncio.gather(inflight, pending, return_exceptions=True)

    await relax_on.settle()
    for _ in range(100):
        if crashed.lora.released and cancelled.lora.released and early.lora.released:
            break
        await asyncio.sleep(0.01)
    assert crashed.lora.released and cancelled.lora.released and early.lora.released
    assert relax_on.registry.commands["CloseAndRelease"] == 3 and not relax_on.shard_pub.open_records
    await relax_on.settle()
    assert a.lora_name not in managed(relax_on)


async def test_typed_errors_propagate_and_capacity_defers_the_publication(relax_on):
    await relax_on.update_weights()
    a = relax_on.device.reports[-1]
    old = await relax_on.register("old")
    await turn(relax_on, "old", [2, 2])
    relax_on.trainer.step = 2
    await relax_on.update_weights()
    b = relax_on.device.reports[-1]

    relax_on.trainer.step = 3
    await relax_on.update_weights()  # A (held by "old") and B (default) fill both slots
    assert [e.code for e in relax_on.device.deferred] == ["CAPACITY_ERROR"]
    assert isinstance(relax_on.device.deferred[0], CapacityError)
    assert managed(relax_on) == {a.lora_name, b.lora_name}  # nothing of step 3 reached an engine
    with pytest.raises(CapacityError) as direct:  # the hook itself raises it unchanged
        await asyncio.to_thread(relax_on.trainer_pub.publish, peft_lora_state_dict(9),
                                relax_on.device._lora_sync.config_dict(), weight_version=99)
    assert direct.value.code == "CAPACITY_ERROR"
    late = await relax_on.register("late")
    await turn(relax_on, "late", [2, 2])
    assert late.lora.lora_path == b.lora_name  # the default did not move

    await relax_on.shard.finalize_and_discard(session_id="old")
    await relax_on.settle()
    await relax_on.update_weights()  # the deferred adapter is published by the next update
    c = relax_on.device.reports[-1]
    assert "step4" in c.lora_name and managed(relax_on) == {b.lora_name, c.lora_name}

    with pytest.raises(SessionClosed) as closed:
        await relax_on.shard_pub.generate(old.lora, {"input_ids": [1], "sampling_params": {}})
    result = error_result(closed.value)
    assert result["_http_status"] == 404 and result["error"]["code"] == "SESSION_CLOSED"
    with pytest.raises(SessionClosed):  # a record without a lorapub session is refused, never sent bare
        await relax_on.shard_pub.generate(None, {"input_ids": [1], "sampling_params": {}})
    assert error_result(NoPublishedVersion("none yet"))["error"]["code"] == "NO_PUBLISHED_VERSION"


async def test_the_wire_guard_refuses_a_record_that_would_change_version(tmp_path):
    class Engine:  # the smallest EngineAdmin the deployment needs here: it only answers generations
        name = "e0"
        sent: list[str] = []

        async def incarnation(self):
            return "life0"

        async def generate(self, payload):
            self.sent.append(payload["lora_path"])
            return {"output_ids": [1], "meta_info": {}}

    pub = RelaxLoraPublication(relax_args(tmp_path, enabled=True), engines={"e0": Engine()})
    await pub.start()
    try:
        guarded = pub.deployment.engines["e0"]

        class Flipping:  # a session that (wrongly) changes version mid-life
            names = iter(["relax_policy_lora@7-a-0", "relax_policy_lora@7-a-0", "relax_policy_lora@7-b-1"])

            async def generate(self, payload):
                return await guarded.generate({**payload, "lora_path": next(self.names)})

        record = relax_lora.RelaxLoraSession("s", Flipping())
        await pub.generate(record, {"input_ids": [1]})
        await pub.generate(record, {"input_ids": [1]})
        with pytest.raises(relax_lora.BindingChanged) as changed:
            await pub.generate(record, {"input_ids": [1]})
        assert changed.value.code == "BINDING_CHANGED" and isinstance(changed.value, lorapub.LorapubError)
        assert Engine.sent == ["relax_policy_lora@7-a-0"] * 2  # the third request never left
        assert record.lora_path == "relax_policy_lora@7-a-0" and record.requests == 2
    finally:
        await pub.aclose()


# ------------------------------------------------------------------------------------------------
# the switch off: the old overwrite path
# ------------------------------------------------------------------------------------------------


async def test_switch_off_keeps_the_old_overwrite_path(relax_off):
    assert not relax_off.shard_pub.enabled and not relax_off.trainer_pub.enabled
    record = await relax_off.register("s")
    assert record.lora is None  # the record keeps Relax's own request path
    with pytest.raises(RuntimeError, match="is off"):
        await relax_off.shard_pub.generate(record.lora, {"input_ids": [1]})

    await relax_off.update_weights()
    assert isinstance(relax_off.trainer_pub.publication.deployment, OverwriteDeployment)
    for d in relax_off.doubles:
        kinds = [kind for kind, _ in d.events]
        assert kinds.index("pause") < kinds.index("load") < len(kinds) - 1 - kinds[::-1].index("continue")
        assert d.registered() == [LORA_ADAPTER_NAME] and not managed(relax_off)

    r1 = await turn(relax_off, "s", [1, 2, 3])
    relax_off.trainer.step = 2
    await relax_off.update_weights()  # overwrite the fixed name under pause + flush
    r2 = await turn(relax_off, "s", [1, 2, 3] + r1["output_ids"])
    assert "error" not in r1 and "error" not in r2
    assert r2["lora_id"] != r1["lora_id"]  # the old behaviour: the session moved mid-trajectory
    assert all(d.events.count(("unload", LORA_ADAPTER_NAME)) == 1 for d in relax_off.doubles)

    assert await relax_off.shard.discard_session(session_id="s") is True
    await relax_off.shard_pub.release(None)  # nothing to release with the switch off


# ------------------------------------------------------------------------------------------------
# arguments, snapshot, imports
# ------------------------------------------------------------------------------------------------


def test_add_arguments_follows_relaxs_convention_and_defaults_off():
    parser = argparse.ArgumentParser()
    assert add_arguments(parser) is parser  # Relax chains `parser = add_x_arguments(parser)`
    off = parser.parse_args([])
    assert off.enable_versioned_lora_publication is False and relax_lora.is_enabled(off) is False
    on = parser.parse_args([ARGUMENT, "--lora-publication-epoch", "3"])
    assert relax_lora.is_enabled(on) and on.lora_publication_registry == "relax_lora_publication"

    on.lora_rank, on.lora_adapter_mode, on.lora_merge_mode = 8, False, False
    with pytest.raises(ValueError, match="--lora-adapter-mode"):
        validate_args(on)
    on.lora_adapter_mode = True
    validate_args(on)
    unset = parser.parse_args([ARGUMENT])
    unset.lora_rank, unset.lora_adapter_mode = 8, True
    validate_args(unset)
    epoch = unset.lora_publication_epoch
    assert isinstance(epoch, int) and relax_lora.resolve_epoch(unset) == epoch  # fixed once
    not_validated = parser.parse_args([ARGUMENT])
    with pytest.raises(ValueError, match="validate_args"):  # an actor never picks its own epoch
        RelaxLoraPublication(not_validated)


def test_snapshot_from_relaxs_export_is_a_frozen_copy():
    torch = pytest.importorskip("torch")
    merged = {k: torch.from_numpy(v.copy()) for k, v in peft_lora_state_dict(1).items()}
    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    snap = snapshot_from_export(merged, config)
    digest = snap.digest
    next(iter(merged.values())).add_(1.0)  # training steps on
    assert snapshot_from_export(merged, config).digest != digest and snap.digest == digest
    assert relax_lora.version_id_for(12) == "step12"
    assert engine_name("http://10.0.0.7:30000/") == "10.0.0.7_30000"


def test_the_hooks_import_without_relax_megatron_ray_torch_or_aiohttp():
    blocked = ["aiohttp", "megatron", "ray", "relax", "safetensors", "sglang", "torch"]
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import argparse, lorapub.integrations.relax as r\n"
        "args = r.add_arguments(argparse.ArgumentParser()).parse_args([])\n"
        "pub = r.RelaxLoraPublication(args)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in " + repr(blocked) + "]\n"
        "assert not bad, bad\n"
        "print('ok', pub.enabled)\n"
    )
    src = str(pathlib.Path(lorapub.__file__).parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok False"


def test_the_hooks_use_only_lorapubs_public_face():
    tree = ast.parse(pathlib.Path(relax_lora.__file__).read_text())
    modules, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lorapub"):
            modules.add(node.module)
            if node.module == "lorapub":
                names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("lorapub")}
    assert modules <= {"lorapub", "lorapub.adapters.sglang_http", "lorapub.adapters.sglang_wire",
                       "lorapub.adapters.ray_registry"}, modules
    assert names <= set(lorapub.__all__), names
