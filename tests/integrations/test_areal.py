"""AReaL 1.0.4's released code against lorapub: its ``RemoteSGLangEngine`` (through the drop-in), its
``WorkflowExecutor``, ``GroupedRolloutWorkflow`` and ``MultiTurnWorkflow``, and the update sequence of
its FSDP trainer, on two SGLang doubles. Nothing of AReaL is copied here (see docs/areal.md)."""

from __future__ import annotations

import time

import pytest

from . import areal_harness as H

H.areal_on_path()

with H.kept_from_areal():  # AReaL swaps the root logger and the event loop policy on import: put back
    from areal.api.io_struct import WeightUpdateMeta
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.infra.remote_inf_engine import RemoteInfEngine
    from areal.workflow.multi_turn import MultiTurnWorkflow

    from lorapub import InvalidInput, LorapubError
    from lorapub.integrations.areal import (
        LorapubAReaLConfig,
        LorapubInferenceEngineConfig,
        LorapubRemoteInfEngine,
        LorapubSGLangEngine,
    )

PROMPT = {"messages": [{"role": "user", "content": "t1 t2 t3"}]}


@pytest.fixture(autouse=True)
def _kept_from_areal():
    with H.kept_from_areal():  # AReaL's getLogger runs again in each engine
        yield


@pytest.fixture(autouse=True)
def _reward_pools_joined():
    """AReaL's reward wrapper forks a process pool shared by the whole process and shuts it down only at
    exit; a forked worker left running keeps this test process's pipes open (under pytest-xdist the run
    then never ends). Each test's pools are shut down, and their processes joined, when it ends."""
    yield
    from areal.api.reward_api import AsyncRewardWrapper

    AsyncRewardWrapper._atexit_shutdown_all()


@pytest.fixture
def fleet():
    fleet = H.Fleet(2, slots=6, decode_delay=0.01)
    yield fleet
    fleet.close()


@pytest.fixture
def area(tmp_path):
    H.name_resolve_in_memory(str(tmp_path / "name_resolve"))
    return tmp_path


def _engine(fleet, area, *, offpolicyness=2, on=True, **lorapub):
    config = H.engine_config(offpolicyness=offpolicyness, fileroot=str(area))
    block = LorapubAReaLConfig(enabled=True, epoch=11, **lorapub) if on else None
    engine = (LorapubSGLangEngine(config, lorapub=block, reconcile_interval=0.2) if on
              else LorapubSGLangEngine(config))
    engine.initialize(addr=fleet.addresses)
    meta = WeightUpdateMeta.from_disk("areal-test", "t0", str(area), use_lora=True, lora_name=H.LORA_NAME,
                                      lora_keep_versions=offpolicyness + 2)  # what AReaL's RLTrainer sets
    return engine, meta


def _workflow(max_turns=3):
    return MultiTurnWorkflow(reward_fn=H.no_reward, gconfig=H.gconfig(max_new_tokens=4), tokenizer=H.tiny_tokenizer(),
                             max_turns=max_turns, turn_discount=0.9)


def _turn_versions(traj):
    """Per row (sample): the version of each turn, from the ``versions`` tensor AReaL's trainer reads."""
    rows = []
    for row in traj["versions"].tolist():
        turns, last = [], -1
        for v in row:
            if v != -1 and last == -1:
                turns.append(v)
            elif v != -1:
                assert v == turns[-1], f"one turn spans two versions: {row}"
            last = v
        rows.append(turns)
    return rows


def _failed(fleet):
    return [a for d in fleet.doubles for a in fleet.on_loop(lambda d=d: list(d.answers)) if a[0] != 200]


def test_multi_turn_trajectories_outlive_lora_keep_versions_publications(fleet, area):
    """Each trajectory keeps its version across its turns while more versions than AReaL's
    lora_keep_versions are published; a move happens only as a recorded rebind past max_lag; nothing fails."""
    engine, meta = _engine(fleet, area, offpolicyness=1)
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        served_before = len(engine._engine.served)
        for _ in range(3):
            engine.submit(PROMPT, workflow=_workflow(max_turns=6), group_size=2)
        for version in range(1, 5):  # 4 publications > lora_keep_versions = 3
            time.sleep(0.12)
            H.train_step_update(engine, meta, version, seed=version)
        trajectories = engine.wait(3, timeout=30)
        served = list(engine._engine.served)[served_before:]
        assert all(s["lag"] <= 1 for s in served), [s["lag"] for s in served]  # max_lag = max_head_offpolicyness
        moved = 0
        for traj in trajectories:
            for turns in _turn_versions(traj):
                assert len(turns) == 6 and turns == sorted(turns)
                moved += sum(1 for a, b in zip(turns, turns[1:]) if a != b)
        assert moved == 0 or any(s["rebinds"] for s in served)  # a move is a rebind lorapub recorded
        assert _failed(fleet) == []
        assert engine.lorapub.skipped_pauses == 5  # the trainer's pause_generation never reached a server
        assert all(fleet.on_loop(lambda d=d: d.events.count(("pause", ""))) == 0 for d in fleet.doubles)
        engine.lorapub.run(engine.lorapub.deployment.settle())
        names = [fleet.on_loop(lambda d=d: sorted(d.registered())) for d in fleet.doubles]
        assert names[0] == names[1] and len(names[0]) <= 3 and any("-v4-" in n for n in names[0])
    finally:
        engine.destroy()


def test_past_max_head_offpolicyness_a_sample_moves_at_a_turn_boundary_and_its_tokens_say_so(fleet, area):
    """max_head_offpolicyness 0 is max_lag 0: a sample whose version is no longer the newest moves to the
    newest at its next turn (on_stale: rebind), recorded by lorapub; no turn spans two versions, and the
    versions tensor AReaL's trainer reads gives each turn's tokens the version that made them."""
    engine, meta = _engine(fleet, area, offpolicyness=0)
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        served_before = len(engine._engine.served)
        for _ in range(2):
            engine.submit(PROMPT, workflow=_workflow(max_turns=8), group_size=2)
        time.sleep(0.15)  # the samples are mid-trajectory on v0
        H.train_step_update(engine, meta, 1, seed=1)
        trajectories = engine.wait(2, timeout=30)
        served = list(engine._engine.served)[served_before:]
        rows = [turns for t in trajectories for turns in _turn_versions(t)]
        assert all(turns == sorted(turns) and set(turns) <= {0, 1} for turns in rows), rows
        assert any(turns[0] == 0 and turns[-1] == 1 for turns in rows), rows  # moved mid-trajectory
        assert any(s["rebinds"] for s in served) and all(s["lag"] == 0 for s in served)
        assert _failed(fleet) == []
    finally:
        engine.destroy()


def test_a_failed_load_on_one_server_publishes_nothing_and_rollouts_go_on(fleet, area):
    engine, meta = _engine(fleet, area)
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        # every attempt fails on e1 (AReaL's request_retries: 3, the publication's attempts too)
        fleet.on_loop(lambda: fleet.doubles[1].inject("load", "error", count=3))
        with pytest.raises(LorapubError, match="PUBLICATION_FAILED"):
            H.train_step_update(engine, meta, 1, seed=1)
        # AReaL's global version moved on (its trainer sets it after the update); trajectories bind v0
        engine.set_version(1)
        for _ in range(2):
            engine.submit(PROMPT, workflow=_workflow(), group_size=2)
        trajectories = engine.wait(2, timeout=30)
        assert {v for t in trajectories for turns in _turn_versions(t) for v in turns} == {0}
        engine.lorapub.run(engine.lorapub.deployment.settle())
        for d in fleet.doubles:  # v1 is on no server: staged, refused on one, cleaned up on both
            assert not any("-v1-" in n for n in fleet.on_loop(d.registered))
        H.train_step_update(engine, meta, 2, seed=2)  # the next update goes through
        engine.submit(PROMPT, workflow=_workflow(max_turns=1))
        assert _turn_versions(engine.wait(1, timeout=30)[0]) == [[2]]
        assert _failed(fleet) == []
    finally:
        engine.destroy()


def test_a_load_that_fails_once_is_published_on_the_next_attempt(fleet, area, monkeypatch):
    """AReaL's own load retries each server's request (request_retries); the publication is tried again
    as often, so a one-off refusal costs a retry, not the training step. Each publication's log line
    names where its time went (live, a 264 MB update took 14-25 s with about 1 s on the servers)."""
    engine, meta = _engine(fleet, area)
    said = []
    monkeypatch.setattr(engine._engine.logger, "info", lambda msg, *args: said.append(msg % args))
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        fleet.on_loop(lambda: fleet.doubles[1].inject("load", "error", count=1))
        report = H.train_step_update(engine, meta, 1, seed=1)
        assert report.version.version_id == "v1"
        for d in fleet.doubles:
            assert any("-v1-" in n for n in fleet.on_loop(d.registered))
        [line] = [m for m in said if m.startswith("lorapub: published v1 ")]
        for part in ("read and snapshot", "the publication", "waited for a slot", "begin", "transfer", "end", "commit"):
            assert f"{part} " in line, line
    finally:
        engine.destroy()


def test_grpo_groups_bind_one_version_per_prompt(fleet, area):
    """n_samples of one prompt (AReaL's group_size) are one lorapub group: one version for all of them,
    even when a publication lands between their first requests."""
    engine, meta = _engine(fleet, area, offpolicyness=3)
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        for i in range(6):
            engine.submit(PROMPT, workflow=_workflow(max_turns=2), group_size=4)
            if i in (1, 3):
                H.train_step_update(engine, meta, i, seed=i)
        trajectories = engine.wait(6, timeout=30)
        for traj in trajectories:
            rows = _turn_versions(traj)
            assert len(rows) == 4
            assert len({v for turns in rows for v in turns}) == 1, rows
        assert _failed(fleet) == []
    finally:
        engine.destroy()


def test_a_bfloat16_adapter_as_areals_trainer_saves_it_is_published_and_served(fleet, area):
    """AReaL's trainer saves a bf16 model's LoRA in bfloat16 (a live run's every update failed on reading it
    with numpy): the update is published, both servers hold it, and trajectories run on it."""
    pytest.importorskip("torch")
    engine, meta = _engine(fleet, area)
    try:
        H.train_step_update(engine, meta, 0, seed=0, save=H.save_adapter_bf16)
        engine.submit(PROMPT, workflow=_workflow(max_turns=2), group_size=2)
        trajectories = engine.wait(1, timeout=30)
        assert [len(turns) for traj in trajectories for turns in _turn_versions(traj)] == [2, 2]
        assert _failed(fleet) == []
        names = [fleet.on_loop(lambda d=d: sorted(d.registered())) for d in fleet.doubles]
        assert names[0] == names[1] and any("-v0-" in n for n in names[0]), names
    finally:
        engine.destroy()


def test_a_restarted_server_is_healed_and_no_request_fails(fleet, area):
    """A server that crashed between waves (a crash mid-request loses that request on either path) comes
    back empty: lorapub sends what it refuses to the other holder, re-provisions it, and the next
    publication reaches it."""
    engine, meta = _engine(fleet, area)
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        for _ in range(2):
            engine.submit(PROMPT, workflow=_workflow(max_turns=2), group_size=2)
        engine.wait(2, timeout=30)
        fleet.on_loop(fleet.doubles[0].restart)  # nothing loaded, a new incarnation
        for _ in range(2):
            engine.submit(PROMPT, workflow=_workflow(max_turns=3), group_size=2)
        trajectories = engine.wait(2, timeout=30)
        assert {v for t in trajectories for turns in _turn_versions(t) for v in turns} == {0}
        H.train_step_update(engine, meta, 1, seed=1)
        deadline = time.monotonic() + 20
        while not all(any("-v1-" in n for n in fleet.on_loop(d.registered)) for d in fleet.doubles):
            assert time.monotonic() < deadline, "the restarted server never got v1"
            time.sleep(0.1)
        for _ in range(2):
            engine.submit(PROMPT, workflow=_workflow(max_turns=2), group_size=2)
        assert {v for t in engine.wait(2, timeout=30) for turns in _turn_versions(t) for v in turns} == {1}
        # what the restarted server refused before anything ran ("never been loaded") went once to the
        # other holder: no trajectory saw an error (every sample above came back)
        refused = _failed(fleet)
        assert all(status == 400 and "never been loaded" in error and "-v0-" in name
                   for status, name, error, _ in refused), refused
        assert [a for a in fleet.on_loop(lambda: list(fleet.doubles[1].answers)) if a[0] != 200] == []
    finally:
        engine.destroy()


def test_agenerate_outside_an_episode_is_a_session_of_its_own(fleet, area):
    """A request made straight through ``agenerate`` (no submit) binds the newest version for itself alone;
    before the first update it is NO_PUBLISHED_VERSION, never the base model."""
    import asyncio

    from areal.api import ModelRequest

    from lorapub import NoPublishedVersion

    engine, meta = _engine(fleet, area)
    try:
        def request():
            return ModelRequest(rid="direct", input_ids=[1, 2, 3], gconfig=H.gconfig(max_new_tokens=3))

        with pytest.raises(NoPublishedVersion, match=r"call publish_initial\(") as refused:
            asyncio.run(engine.agenerate(request()))
        assert refused.value.code == "NO_PUBLISHED_VERSION"
        H.train_step_update(engine, meta, 0, seed=0)
        H.train_step_update(engine, meta, 1, seed=1)
        response = asyncio.run(engine.agenerate(request()))
        assert response.output_versions == [1, 1, 1] and len(response.output_logprobs) == 3
        engine.lorapub.run(engine.lorapub.deployment.settle())
        assert all(not any("-v0-" in n for n in fleet.on_loop(d.registered)) for d in fleet.doubles)
    finally:
        engine.destroy()


def test_switched_off_it_is_areals_own_engine(fleet, area):
    engine, meta = _engine(fleet, area, on=False)
    try:
        assert type(engine._engine) is RemoteInfEngine and engine.lorapub is None
        H.train_step_update(engine, meta, 0, seed=0)
        engine.submit(PROMPT, workflow=_workflow(max_turns=1))
        assert _turn_versions(engine.wait(1, timeout=30)[0]) == [[0]]
        named = {a[1] for d in fleet.doubles for a in fleet.on_loop(lambda d=d: list(d.answers))}
        assert named == {f"{H.LORA_NAME}-v0"}  # AReaL's own naming, AReaL's own load
        assert all(fleet.on_loop(lambda d=d: d.events.count(("pause", ""))) == 1 for d in fleet.doubles)
    finally:
        engine.destroy()


def test_an_offpolicyness_meaning_no_limit_is_refused_at_once_naming_what_to_do():
    """RLTrainer's evaluation engine sets max_head_offpolicyness 10**12 ("no limit"): refused when the engine
    is made, saying to set a real staleness or to run AReaL's own path, not at initialize with a
    --max-loaded-loras suggestion no server can take."""
    config = LorapubAReaLConfig(enabled=True)
    with pytest.raises(InvalidInput, match="AReaL's own path") as refused:
        config.check(lora_name="policy", use_lora=True, max_head_offpolicyness=10**12)
    assert "rollout.max_head_offpolicyness 1000000000000" in str(refused.value)
    # typed, with the stable code, and still the ValueError AReaL's config loading expects of a bad setting
    assert refused.value.code == "INVALID_INPUT" and isinstance(refused.value, ValueError)
    assert config.check(lora_name="policy", use_lora=True, max_head_offpolicyness=1022) is config


def test_selected_through_areals_config():
    """The block rides in AReaL's structured config (OmegaConf, as its YAML loader builds it)."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(LorapubInferenceEngineConfig(backend="sglang:d2", use_lora=True, lora_name="policy"))
    merged = OmegaConf.merge(schema, OmegaConf.create({"max_head_offpolicyness": 3, "lorapub": {"enabled": True,
                                                                                              "epoch": 5}}))
    config = OmegaConf.to_object(merged)
    engine = LorapubSGLangEngine(config)
    assert isinstance(engine._engine, LorapubRemoteInfEngine) and engine.lorapub.max_lag == 3
    assert engine.lorapub_config.capacity_for(3) == 5
    engine.lorapub.close()
    off = LorapubSGLangEngine(OmegaConf.to_object(schema))
    assert type(off._engine) is RemoteInfEngine
    with pytest.raises(InvalidInput, match="max_head_offpolicyness \\+ 2"):
        LorapubSGLangEngine(config, lorapub={"enabled": True, "capacity": 3})
    with pytest.raises(InvalidInput, match="use_lora"):
        LorapubSGLangEngine(OmegaConf.to_object(OmegaConf.merge(schema, {"use_lora": False})), lorapub={"enabled": True})
    assert issubclass(LorapubSGLangEngine, RemoteSGLangEngine)


def test_the_side_by_side_runs_small_and_lorapub_meets_its_bar(capsys):
    """bench/areal_side_by_side.py --quick, in-process: every figure printed for both paths; lorapub's
    path at 0 failed requests, 0 mixed-version samples, every sample back, p99 lag <= max_lag. AReaL's
    own figures are what they are (not asserted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("areal_side_by_side", H.ROOT / "bench" / "areal_side_by_side.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--quick"])
    printed = capsys.readouterr().out
    for key in results["lorapub"]:
        if key not in ("path", "update errors", "update seconds", "request errors (first 3)", "refused answers (first 8)"):
            assert key in printed
    ours = results["lorapub"]
    assert ours["requests failed (raised to the workflow)"] == 0
    assert ours["mixed-version samples"] == 0 and ours["groups lost (a sample raised)"] == 0
    assert ours["samples finished / submitted"] == "12 / 12"
    assert ours["requests that fell back to the base model"] == 0
    assert float(ours["version lag p50 / p99 / max (token-weighted)"].split(" / ")[1]) <= 1
    assert ours["pause calls reaching the servers"] == 0
    assert results["areal"]["agenerate calls"] > 0


def test_importing_areal_leaves_the_process_event_loops_as_they_were():
    """AReaL installs uvloop's policy on import; the rest of the suite must keep asyncio's own loops."""
    import asyncio
    import sys

    assert "uvloop" in sys.modules  # AReaL did import it
    assert "uvloop" not in type(asyncio.get_event_loop_policy()).__module__
    loop = asyncio.new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_the_initial_adapter_is_v0_and_the_trainers_updates_run_in_fsdps_own_order(fleet, area):
    """AReaL's RLTrainer loads its initial LoRA as ``<lora_name>-v0`` at server launch (``sglang.lora_paths``,
    which lorapub does not read) and never sends it as an update. ``publish_initial`` publishes it as v0
    without touching name_resolve: the key for the rollout's version 0 is the one the trainer's first update
    writes (v0 sent through ``update_weights_from_disk`` would need it written first, and the trainer's own
    ``name_resolve.add`` then fails). The updates then run in FSDPEngine's order: handed over before the
    adapter is saved."""
    from lorapub import PublicationReport

    engine, meta = _engine(fleet, area)
    try:
        initial = area / "initial_lora"  # RLTrainer's _save_initial_lora_weights folder
        H.save_adapter(str(initial), seed=0)
        report = engine.publish_initial(str(initial))
        assert isinstance(report, PublicationReport) and report.version.version_id == "v0"
        assert initial.exists()  # the trainer's own folder: not deleted
        engine.submit(PROMPT, workflow=_workflow(max_turns=2), group_size=2)
        assert {v for t in engine.wait(1, timeout=30) for turns in _turn_versions(t) for v in turns} == {0}
        for version in (1, 2):  # global_step + 1, keyed by the trainer's version before the update
            H.fsdp_update(engine, meta, version, seed=version)
            engine.submit(PROMPT, workflow=_workflow(max_turns=1))
            assert _turn_versions(engine.wait(1, timeout=30)[0]) == [[version]]
        assert _failed(fleet) == []
    finally:
        engine.destroy()


def test_publish_initial_refuses_what_it_cannot_publish(fleet, area, tmp_path):
    """A folder with no PEFT adapter, and the call with lorapub off, are typed refusals that say what to do;
    nothing was published."""
    from lorapub import NoPublishedVersion

    engine, _ = _engine(fleet, area)
    try:
        with pytest.raises(InvalidInput, match="adapter_model.safetensors"):
            engine.publish_initial(str(tmp_path / "nothing-here"))
        with pytest.raises(NoPublishedVersion):
            engine.lorapub.run(engine.lorapub.deployment.session("probe").generate({"input_ids": [1]}))
    finally:
        engine.destroy()
    off, _ = _engine(fleet, area, on=False)
    try:
        with pytest.raises(InvalidInput, match="sglang.lora_paths"):
            off.publish_initial(str(tmp_path))
    finally:
        off.destroy()


def test_an_update_before_initialize_is_a_typed_error_naming_the_call(area, tmp_path):
    """The trainer's update reaches an engine whose lorapub was never started: INVALID_INPUT saying to call
    initialize() first, not a bare RuntimeError; nothing was published."""
    config = H.engine_config(offpolicyness=2, fileroot=str(area))
    engine = LorapubSGLangEngine(config, lorapub=LorapubAReaLConfig(enabled=True, epoch=11))
    try:
        H.save_adapter(str(tmp_path), seed=1)
        with pytest.raises(InvalidInput, match=r"initialize\(\) first") as refused:
            engine.publish_initial(str(tmp_path))
        assert refused.value.code == "INVALID_INPUT"
    finally:
        engine.lorapub.close()


def test_an_update_whose_folder_holds_no_adapter_is_a_typed_error(fleet, area):
    """The trainer announced an update whose folder holds no PEFT adapter: the future raises INVALID_INPUT
    (not an OSError), naming the files, and the previous version stays the one trajectories bind."""
    from areal.utils import name_resolve, names

    from lorapub import InvalidInput

    engine, meta = _engine(fleet, area)
    try:
        H.train_step_update(engine, meta, 0, seed=0)
        name_resolve.add(names.update_weights_from_disk("areal-test", "t0", engine.get_version()), "0", replace=True)
        with pytest.raises(InvalidInput, match="adapter_config.json"):
            engine.update_weights_from_disk(meta.with_version(1)).result(timeout=30)
        engine.submit(PROMPT, workflow=_workflow(max_turns=1))
        assert _turn_versions(engine.wait(1, timeout=30)[0]) == [[0]]
    finally:
        engine.destroy()


def test_after_destroy_calls_are_refused_typed(fleet, area):
    """After ``destroy`` the engine's lorapub is closed: a generation or a publication is DEPLOYMENT_CLOSED
    (a typed lorapub error), not a bare RuntimeError."""
    import asyncio

    from areal.api import ModelRequest

    from lorapub import DeploymentClosed

    engine, meta = _engine(fleet, area)
    H.train_step_update(engine, meta, 0, seed=0)
    engine.destroy()
    initial = area / "initial_lora"
    H.save_adapter(str(initial), seed=0)
    with pytest.raises(DeploymentClosed, match="new engine"):
        engine.publish_initial(str(initial))
    request = ModelRequest(rid="late", input_ids=[1, 2, 3], gconfig=H.gconfig(max_new_tokens=2))
    with pytest.raises(DeploymentClosed):
        asyncio.run(engine.agenerate(request))


def test_offload_still_pauses_the_servers_first_and_onload_continues_them(fleet, area):
    """RLTrainer's colocated offload is ``pause`` (the executor), ``pause_generation``, ``offload``; its onload is
    ``onload``, ``continue_generation``. lorapub drops the two generation calls (updates need no pause), so its
    ``offload`` sends the servers' pause itself before their memory is released (a request still running
    there must stop first), and its ``onload`` sends the continue after the memory is back."""
    engine, _ = _engine(fleet, area)
    try:
        inner = engine._engine
        sent = []
        inner._run_request_on_all_servers = lambda req: sent.append(req.endpoint)  # the servers' side
        engine.pause()
        engine.pause_generation()  # not sent
        engine.offload()
        assert sent == ["/pause_generation", "/release_memory_occupation"]
        engine.onload()
        engine.continue_generation()  # not sent
        engine.resume()
        assert sent[2:] == ["/resume_memory_occupation", "/continue_generation"]
    finally:
        engine.destroy()
