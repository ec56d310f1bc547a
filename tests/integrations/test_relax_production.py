"""A Relax run in production shape, through the stand-ins of ``relax_harness.py`` (which follow the
call sequences of Relax's pinned ``service.py`` and ``runtime.py``): groups that end the way Relax ends
them, engines that come and go, a trainer that restarts, and the refusals Relax's agents see."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace

import pytest

from lorapub import InvalidInput
from lorapub.integrations import relax as relax_lorapub
from lorapub.integrations.relax import LorapubConfig, LorapubPublisher, RelaxLorapub

from tests.integrations import relax_harness as harness
from tests.integrations.relax_harness import RuntimeDomain
from tests.integrations.test_relax import FAST, ask, make_relax, served, specs, start_group, teardown


# ------------------------------------------------------------------------------------------------
# Groups end the way Relax ends them
# ------------------------------------------------------------------------------------------------


async def run_group(relax, group_id: str, *session_ids: str, turns: int = 1) -> list:
    """One group as Relax runs it: start_group, every member's turns, the agents exit, and the driver's
    ``collect_group`` ends it with the shard's ``release_group``."""
    first = await start_group(relax, group_id, *session_ids)
    answers = list(await asyncio.gather(*first.values()))
    for _ in range(turns - 1):
        answers += await asyncio.gather(*(ask(relax.shard, sid, [4]) for sid in session_ids))
    for sid in session_ids:
        await relax.shard.finish_agent(sid)
    exports = await RuntimeDomain(relax.shard).collect_group(group_id, session_ids)
    assert exports is not None and all("error" not in a for a in answers), answers
    return exports


async def test_a_completed_group_is_forgotten_and_its_id_comes_back_as_a_new_group(tmp_path):
    relax = await make_relax(tmp_path, enabled=True)
    try:
        await relax.step(1)
        # a PrepareDomain rebuilt: train ids restart at train:prepare_group_0, with the same session ids
        for round_ in range(3):
            await run_group(relax, "train:prepare_group_0", "s0", "s1")
            assert relax.lorapub._groups == {} and relax.lorapub.open_sessions == ()
            assert relax.lorapub.deployment.sessions.sessions == {}  # nothing of the ended group stays
            if round_ == 1:
                await relax.step(2)
                await relax.lorapub.deployment.reconcile()
        exports = await run_group(relax, "train:prepare_group_0", "s0", "s1")
        assert [e["metadata"]["lorapub"]["version_id"] for e in exports] == ["step2", "step2"]
    finally:
        await teardown(relax)


class _Member:
    __slots__ = ("closed",)

    def __init__(self) -> None:
        self.closed = False

    async def open(self):
        return self

    async def close(self) -> None:
        self.closed = True


class _Sessions:
    """The part of a Deployment the shard's group bookkeeping touches, with nothing behind it: what
    the shard itself keeps per group is all that is measured."""

    def session(self, session_id, nonce=None, *, group=None):
        return _Member()

    async def close(self) -> None:
        pass


def _bare_lorapub(lorapub: RelaxLorapub) -> RelaxLorapub:
    async def started() -> None:
        lorapub.deployment = _Sessions()

    lorapub._start_deployment = started
    return lorapub


async def test_an_id_still_known_starts_a_new_group_and_releases_what_the_old_one_left_open():
    lorapub = _bare_lorapub(RelaxLorapub(SimpleNamespace(enable_lorapub=True),
                                         config=LorapubConfig(epoch=1, registry=""), engines={}))
    await lorapub.open_group("train:prepare_group_0", ("a", "b"))
    old = dict(lorapub._groups["train:prepare_group_0"].members)
    await lorapub.release("a")  # b's finish never reached lorapub, and no release_group came
    await lorapub.open_group("train:prepare_group_0", ("a", "b"))  # Relax let the id go: a new group
    assert old["b"].closed and lorapub.member("b") is not old["b"] and not lorapub.member("b").closed
    assert set(lorapub.open_sessions) == {"a", "b"}
    await lorapub.aclose()


async def test_100k_groups_through_release_group_with_reused_ids_keep_shard_memory_bounded():
    args = SimpleNamespace(enable_lorapub=True, agentic_session_lifecycle=False)
    harness.INJECT["shard"] = {"config": LorapubConfig(epoch=1, registry=""), "engines": {}}
    try:
        shard = harness.AgenticSessionShard(args, None, None, None)
    finally:
        harness.INJECT["shard"] = {}
    _bare_lorapub(shard._lorapub)
    driver = RuntimeDomain(shard)
    ids = [f"train:prepare_group_{i}" for i in range(4)]  # reused: a PrepareDomain rebuilt restarts them
    started_at = time.monotonic()
    objects_at: dict[int, int] = {}
    for n in range(100_000):
        group_id = ids[n % len(ids)]
        session_ids = (f"{group_id}.session-{n % 2}",)
        await shard.start_group("train", group_id, specs(*session_ids))
        for sid in session_ids:  # the agent exits: _finalize_terminal_session -> _finish_session_once
            await shard.finish_agent(sid)
        assert await driver.collect_group(group_id, session_ids) is not None  # -> the shard's release_group
        assert not shard._groups and not shard._lorapub._groups and not shard._lorapub.open_sessions
        if n in (10_000, 99_999):
            gc.collect()
            objects_at[n] = len(gc.get_objects())
    assert objects_at[99_999] - objects_at[10_000] < 200, objects_at  # nothing grows with the groups run
    assert time.monotonic() - started_at < 30
    await shard.shutdown()


# ------------------------------------------------------------------------------------------------
# Start and errors as Relax expects
# ------------------------------------------------------------------------------------------------


async def test_a_session_that_starts_before_the_first_version_waits_for_it(tmp_path):
    relax = await make_relax(tmp_path, enabled=True, settings={"first_version_wait": 30})
    try:
        turns = await start_group(relax, "g", "s1", "s2")  # Relax's rollouts start before its first sync ends
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in turns.values())  # waiting, not refused
        await relax.step(1)
        answers = await asyncio.gather(*turns.values())
        assert all("error" not in a for a in answers), answers
        assert served(relax, "s1")["version_id"] == served(relax, "s2")["version_id"] == "step1"
        assert relax.lorapub.metrics()["lorapub/waited_first_version"] == 2
    finally:
        await teardown(relax)


async def test_a_pause_answers_a_request_waiting_for_the_first_version_and_resume_sends_it_again(tmp_path):
    relax = await make_relax(tmp_path, enabled=True, settings={"first_version_wait": 30})
    try:
        turns = await start_group(relax, "g", "s1")
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await relax.shard.pause_generation()  # Relax's own first sync pauses: the waiting request is aborted
        assert time.monotonic() - started < 2  # the pause does not wait out first_version_wait
        ir = next(iter(relax.shard._session_records["s1"].live_irs))
        assert ir.abort_count == 1 and ir in relax.shard._session_records["s1"].queued_irs
        await relax.step(1)
        await relax.shard.resume_generation(1)
        answer = await turns["s1"]
        assert "error" not in answer and served(relax, "s1")["version_id"] == "step1"
    finally:
        await teardown(relax)


def test_codes_agents_must_not_resend_are_4xx_and_the_resendable_ones_5xx():
    import lorapub.errors as errors

    codes = {cls.code for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.LorapubError) and cls is not errors.LorapubError}
    resent_by_clients = {408, 409, 429}  # OpenAI-style clients resend these and every 5xx
    for code in codes:
        status = relax_lorapub.error_result(_error_with(code))["_http_status"]
        if code in relax_lorapub.RESENDABLE:
            assert status >= 500, code
        else:
            assert 400 <= status < 500 and status not in resent_by_clients, (code, status)
    for code in ("OUTCOME_UNKNOWN", "PROVENANCE_MISMATCH", "BINDING_STALE", "SESSION_CLOSED", "DEPLOYMENT_CLOSED"):
        assert code in relax_lorapub.NOT_RESENDABLE


def _error_with(code: str):
    import lorapub.errors as errors

    cls = next(c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.LorapubError) and c.code == code)
    return cls(f"a {code}")


async def test_one_members_exit_keeps_its_siblings_and_only_relaxs_drop_ends_them(tmp_path):
    relax = await make_relax(tmp_path, enabled=True)
    try:
        await relax.step(1)
        await asyncio.gather(*(await start_group(relax, "g", "a", "b", "c")).values())
        await relax.shard.finish_agent("a")  # one agent exits normally
        await relax.step(2)
        await relax.lorapub.deployment.reconcile()
        assert "error" not in await ask(relax.shard, "b", [5])
        assert served(relax, "b")["version_id"] == "step1"  # the siblings keep the group's version
        assert relax.lorapub.member("b") is not None and relax.lorapub.member("c") is not None
        # an agent that exits on failure: Relax's controlled drop (a None result), which collect_group turns
        # into drop_group — Relax asks for the siblings' end, and only then do they end
        await relax.shard._finish_session(relax.shard._session_records["b"], None)
        assert relax.lorapub.member("c") is not None
        assert await RuntimeDomain(relax.shard).collect_group("g", ("a", "b", "c")) is None
        assert relax.lorapub.member("c") is None and "g" not in relax.shard._groups
    finally:
        await teardown(relax)


async def test_cut_trajectories_are_counted_in_relaxs_own_metrics(tmp_path):
    relax = await make_relax(tmp_path, enabled=True, registry_options={"max_lag": 0, "on_stale": "rebind"})
    try:
        await relax.step(1)
        await asyncio.gather(*(await start_group(relax, "g", "s1", "s2")).values())
        await relax.step(2)  # step1 retires: the group moves at its next turn boundary
        await relax.lorapub.deployment.reconcile()
        assert "error" not in await ask(relax.shard, "s1", [5])
        assert served(relax, "s1")["version_id"] == "step2" and served(relax, "s1")["rebinds"] == 1
        metrics = await relax.shard.agentic_kv_metrics(reset=True)  # Relax: agentic_kv/lorapub/...
        assert metrics["lorapub/cut_trajectories"] == 1 and metrics["lorapub/rebound_turns"] == 1
        assert (await relax.shard.agentic_kv_metrics())["lorapub/cut_trajectories"] == 0  # reset
    finally:
        await teardown(relax)


# ------------------------------------------------------------------------------------------------
# Relax's defaults, and the transport by evidence
# ------------------------------------------------------------------------------------------------


def test_the_defaults_follow_relaxs_max_staleness_and_rebind():
    config = relax_lorapub.config_from_args(SimpleNamespace(enable_lorapub=True, max_staleness=2))
    assert (config.max_lag, config.capacity, config.on_stale) == (2, 4, "rebind")
    config = relax_lorapub.config_from_args(SimpleNamespace(enable_lorapub=True))  # Relax's default: 1
    assert (config.max_lag, config.capacity) == (1, 3)
    assert relax_lorapub.sglang_overrides(config) == {"max_loras_per_batch": 5, "max_loaded_loras": 5}
    assert LorapubConfig(max_lag=None).resolved().capacity == 2  # sessions keep theirs: 2 slots serve it
    with pytest.raises(InvalidInput, match="set capacity: 4 or more"):
        LorapubConfig(capacity=3).resolved(SimpleNamespace(max_staleness=2))


def test_auto_picks_http_even_beside_gpus_and_nccl_only_by_name(monkeypatch):
    torch = pytest.importorskip("torch")
    from lorapub.adapters.sglang_wire import HTTPBytes, TorchDistributed
    from lorapub.integrations.relax.options import make_transport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a trainer with GPUs of its own
    args = SimpleNamespace(colocate=False)
    assert type(make_transport(LorapubConfig(transport="auto"), args)) is HTTPBytes  # TorchDistributed is one too
    nccl = make_transport(LorapubConfig(transport="nccl", transport_host="127.0.0.1"), args)
    assert isinstance(nccl, TorchDistributed)


def test_share_verdict_over_gloo_raises_on_every_rank_when_rank_0s_publication_fails(tmp_path):
    pytest.importorskip("torch")
    import json
    import os
    import pathlib
    import subprocess
    import sys

    world = 2
    init = f"file://{tmp_path / 'rendezvous'}"
    root = pathlib.Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.integrations.gloo_ranks", str(r), str(world), init,
                               str(tmp_path / f"rank{r}.json")], cwd=root, env=env)
             for r in range(world)]
    try:
        codes = [p.wait(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["shared"] for r in results] == [[1, 0]] * world  # a MAX over the ranks: the flag of any one
    assert [r["raised"] for r in results] == ["WeightPublicationFailed"] * world  # every rank raises together
    assert results[0]["published"] == ["step3"] and results[1]["published"] == []  # rank 0 alone publishes


# ------------------------------------------------------------------------------------------------
# A trainer restart resumes
# ------------------------------------------------------------------------------------------------


async def restart_trainer(relax, copies=None) -> None:
    """Rank 0's process dies and Relax starts the trainer again: a new DeviceDirectBackend (its weight
    path installed afresh), the same args, the same shared registry, the same engines (and the store its
    frozen copies outlive it in, where given)."""
    await asyncio.to_thread(relax.path.close)  # the old process is gone (its publication thread with it)
    urls = [d.url for d in relax.doubles]
    options = {"registry": relax.registry, "deadlines": FAST, "bucket_cap_bytes": 8 << 10,
               **({"copies": copies} if copies is not None else {})}
    harness.INJECT["trainer"] = {"publisher": lambda: LorapubPublisher(relax.args, worker_urls=urls, **options),
                                 "background": False}
    try:
        relax.device = harness.DeviceDirectBackend(relax.args, "nccl", None, [relax.model], model_name="tiny-qwen3",
                                                   quantization_config=None)
    finally:
        harness.INJECT["trainer"] = {}
    relax.device.init_process_group_for_rollout(
        {i: {"ip": "127.0.0.1", "port": int(u.rsplit(":", 1)[1])} for i, u in enumerate(urls)})


async def test_a_restarted_trainer_resumes_without_pause_or_flush_and_publishes_as_usual(tmp_path):
    relax = await make_relax(tmp_path, enabled=True)
    try:
        await relax.step(1)  # the run's first sync: Relax's own, then step1
        await relax.step(2)
        turns = await start_group(relax, "g", "s1", "s2")  # sessions open across the restart
        await asyncio.gather(*turns.values())
        assert served(relax, "s1")["version_id"] == "step2"

        await restart_trainer(relax)
        marks = [len(d.events) for d in relax.doubles]
        relax.model.step = 3
        await relax.update_weights()  # Relax's caller gives no rollout id: the id comes from the step count
        assert relax.path.resumed
        assert relax.lifecycle_events(marks) == []  # no pause, flush or continue reached the engines
        assert relax.device.base_syncs == 0  # no base broadcast either
        assert [o.status for o in relax.path.outcomes] == ["published"]
        assert relax.path.outcomes[0].version_id == "step3"  # counted on: no id of the run before comes back

        assert "error" not in await ask(relax.shard, "s1", [7])  # the open sessions keep their version
        assert served(relax, "s1")["version_id"] == "step2"
        await relax.lorapub.deployment.reconcile()
        await asyncio.gather(*(await start_group(relax, "g2", "t1")).values())
        assert served(relax, "t1")["version_id"] == "step3"  # a new group binds the restarted trainer's version
    finally:
        await teardown(relax)


# ------------------------------------------------------------------------------------------------
# Engines follow Relax's topology
# ------------------------------------------------------------------------------------------------


def set_workers(relax, doubles) -> None:
    """Relax's fleet changes: the router's /workers (the shard's source) and the coordinator's topology,
    which Relax sets on the trainer's backend before every update (the trainer's source)."""
    relax.args.worker_urls = [d.url for d in doubles]
    relax.device.init_process_group_for_rollout(
        {i: {"ip": "127.0.0.1", "port": int(d.url.rsplit(":", 1)[1])} for i, d in enumerate(doubles)})


async def test_engines_join_and_leave_under_load_with_no_request_failed_and_no_version_missing(tmp_path):
    from lorapub.testing import SGLangDouble

    from tests.integrations.test_relax import RELAX_SLOTS

    relax = await make_relax(tmp_path, enabled=True)
    e2 = await SGLangDouble("e2", max_loaded_loras=RELAX_SLOTS, managed_prefix="lorapub@").start()
    stop = asyncio.Event()
    answers: list[dict] = []
    served_by: set[str] = set()  # the engines the sessions' turns went to

    async def rollouts(worker: int) -> None:  # groups of two, a few turns each, one after another
        n = 0
        while not stop.is_set():
            group_id, members = f"w{worker}.g{n}", (f"w{worker}.g{n}.a", f"w{worker}.g{n}.b")
            answers.extend(await asyncio.gather(*(await start_group(relax, group_id, *members)).values()))
            for _ in range(3):
                answers.extend(await asyncio.gather(*(ask(relax.shard, sid, [n % 7 + 1]) for sid in members)))
                served_by.update(m.engine.name for m in map(relax.lorapub.member, members) if m and m.engine)
            for sid in members:
                await relax.shard.finish_agent(sid)
            assert await RuntimeDomain(relax.shard).collect_group(group_id, members) is not None
            n += 1

    try:
        await relax.step(1)
        load = [asyncio.create_task(rollouts(w)) for w in range(4)]
        await asyncio.sleep(0.3)

        e0, e1 = relax.doubles
        set_workers(relax, [e0, e1, e2])  # a third server joins
        await relax.step(2)  # the trainer sees it in its topology and loads the live versions there
        await asyncio.to_thread(relax.path._following.result, 30)
        joined = await relax.lorapub.follow_workers()  # the shard sees it in the router's list
        assert joined["added"] == ["127.0.0.1_" + e2.url.rsplit(":", 1)[1]]
        await asyncio.sleep(0.5)
        assert relax_lorapub.engine_name(e2.url) in served_by, "the new engine takes traffic"
        assert relax_lorapub.engine_name(e2.url) in relax.path.publisher.deployment.engines

        set_workers(relax, [e1, e2])  # one server leaves
        await relax.step(3)
        leaving = await relax.lorapub.follow_workers()
        assert leaving["leaving"] == [relax_lorapub.engine_name(e0.url)]
        await asyncio.gather(*relax.lorapub._leaving.values())
        await asyncio.to_thread(relax.path._following.result, 30)
        trainer = relax.path.publisher.deployment
        for _ in range(200):  # the trainer's own drain and removal run in the background
            if relax_lorapub.engine_name(e0.url) not in trainer.engines:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*load)

        assert relax_lorapub.engine_name(e0.url) not in relax.lorapub.deployment.engines
        assert relax_lorapub.engine_name(e0.url) not in trainer.engines
        failed = [a for a in answers if "error" in a]
        assert not failed, failed[:3]  # no request failed, none refused VERSION_MISSING
        assert len(answers) > 40
        await relax.settle()
        assert [o.status for o in relax.path.outcomes] == ["published"] * 3
    finally:
        stop.set()
        await teardown(relax)
        await e2.stop()


async def test_a_joining_engine_gets_a_version_the_trainer_published_before_its_restart(tmp_path):
    from lorapub.testing import SGLangDouble

    from lorapub.integrations.relax.copies import LocalCopies
    from tests.integrations.test_relax import RELAX_SLOTS

    copies = LocalCopies()  # stands in for the detached Ray actor: it outlives the trainer process
    relax = await make_relax(tmp_path, enabled=True, registry_options={"capacity": 3})
    e2 = await SGLangDouble("e2", max_loaded_loras=RELAX_SLOTS, managed_prefix="lorapub@").start()
    try:
        await restart_trainer(relax, copies=copies)  # the run's trainer keeps its copies in the store
        await relax.step(1)
        await asyncio.gather(*(await start_group(relax, "g", "s1")).values())  # s1 holds step1 throughout
        await relax.step(2)
        step1 = served(relax, "s1")["lora_name"]

        await restart_trainer(relax, copies=copies)  # a new trainer process: step1's copy is not its own
        set_workers(relax, [*relax.doubles, e2])
        await relax.step(3)
        await asyncio.to_thread(relax.path._following.result, 30)
        joined = await relax.lorapub.follow_workers(join_timeout=10)
        assert joined["added"] == [relax_lorapub.engine_name(e2.url)]
        assert step1 in e2.registered()  # loaded from the copy the trainer before the restart kept
        trainer = relax.path.publisher.deployment
        fleet = await trainer.state()
        assert relax_lorapub.engine_name(e2.url) not in fleet.members  # SERVING (not joining)
        assert "error" not in await ask(relax.shard, "s1", [3])
        assert {k.version_id for k, _ in copies.items()} <= {"step1", "step2", "step3"}
    finally:
        await teardown(relax)
        await e2.stop()


async def test_a_worker_with_too_few_slots_is_refused_each_look_and_leaks_no_adapter(tmp_path, caplog):
    from lorapub.testing import SGLangDouble

    relax = await make_relax(tmp_path, enabled=True)
    small = await SGLangDouble("small", max_loaded_loras=2, managed_prefix="lorapub@").start()
    try:
        await relax.step(1)
        await relax.lorapub.start()
        set_workers(relax, [*relax.doubles, small])
        for _ in range(3):
            await relax.lorapub.follow_workers(join_timeout=5)
        name = relax_lorapub.engine_name(small.url)
        assert name not in relax.lorapub.deployment.engines
        assert all(e.name != name for e in relax.lorapub._built_engines)  # none kept open, look after look
        assert "was refused" in caplog.text and "max-loaded-loras" in caplog.text  # the message names the fix
    finally:
        await teardown(relax)
        await small.stop()
