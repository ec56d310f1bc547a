"""AReaL's own LoRA path against lorapub's, the same workload, on two SGLang doubles (CPU).

Both runs drive AReaL 1.0.4's released code: its ``RemoteSGLangEngine`` (lorapub's drop-in
``LorapubSGLangEngine``, switched off for AReaL's path and on for lorapub's), its
``WorkflowExecutor``, ``GroupedRolloutWorkflow`` and ``MultiTurnWorkflow``, and every weight update with
its FSDP trainer's calls (pause, update from disk, continue, set_version; the adapter saved and its
name_resolve key written before the update is handed over, which spares AReaL's 1 s poll).

The workload, per round: ``episodes`` prompts of ``group`` samples, ``turns`` turns each, submitted at
once; meanwhile the trainer makes ``updates`` updates ``interval`` seconds apart. Round 1's second
update fails to load on server e1 (injected, once). Between the rounds server e0 restarts (a crash
with nothing in flight: it comes back empty). AReaL's settings are its defaults and its RLTrainer's
(``lora_keep_versions = max_head_offpolicyness + 2``, 3 request retries); nothing is tuned against it.

Every call is counted: each ``agenerate`` the workflows made (and whether it raised), and each
``/generate`` answer of each server (its status, the adapter it named, and whether that server had
loaded that adapter before and unloaded it since).

    python3 bench/areal_side_by_side.py --quick            # the smoke test's size
    python3 bench/areal_side_by_side.py --json out.json    # the recorded size

Live (bench/live_areal/run.sh): ``--urls`` names running servers instead of doubles and ``--adapters``
two PEFT folders the trainer alternates; ``--paths`` runs one path (stock servers for AReaL's, patched
ones for lorapub's). There the injected load failure and the restart are left out, and the servers'
answers are not counted (only each ``agenerate``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]

from tests.integrations import areal_harness as H  # noqa: E402

H.areal_on_path()

import logging  # noqa: E402

from areal.api import RolloutWorkflow  # noqa: E402
from areal.api.io_struct import WeightUpdateMeta  # noqa: E402
from areal.infra import workflow_context  # noqa: E402
from areal.workflow.multi_turn import MultiTurnWorkflow  # noqa: E402

from lorapub.integrations.areal import LorapubAReaLConfig, LorapubSGLangEngine  # noqa: E402

PROMPT = {"messages": [{"role": "user", "content": "t1 t2 t3"}]}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


class Ends(RolloutWorkflow):
    """AReaL's workflow, with each sample's end counted (a sample that raises fails its whole group in
    ``GroupedRolloutWorkflow``, and the executor then never hands that group to ``wait``)."""

    def __init__(self, inner: RolloutWorkflow) -> None:
        self.inner = inner
        self.ended = 0
        self.failed_tasks: set[Any] = set()
        self.lock = threading.Lock()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        try:
            return await self.inner.arun_episode(engine, data)
        except BaseException:
            with self.lock:
                self.failed_tasks.add(workflow_context.get().task_id)
            raise
        finally:
            with self.lock:
                self.ended += 1


class LiveServers:
    """Running SGLang servers in a double fleet's place (nothing injected, nothing counted server-side)."""

    def __init__(self, urls: list[str]) -> None:
        self.addresses = [u.removeprefix("http://").rstrip("/") for u in urls]
        self.doubles: list[Any] = []

    def close(self) -> None:
        pass


def copy_adapter(adapters: list[str]) -> Any:
    import shutil

    def save(path: str, version: int) -> None:
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(adapters[version % len(adapters)], path)
    return save


def _saved_as_trainers_save() -> Any:
    """On the doubles, the adapter in bfloat16 as a bf16 model's trainer saves it (the live adapters are
    bf16: a reader that took numpy for it failed every live update, not one on the doubles), where torch is
    installed; else float32."""
    return H.save_adapter_bf16 if importlib.util.find_spec("torch") is not None else H.save_adapter


class Trainer:
    """The updates, as AReaL's FSDP trainer makes them; remembers the newest version it completed."""

    def __init__(self, engine: Any, meta: Any, save: Any = None) -> None:
        self.engine, self.meta, self.save = engine, meta, save
        self.newest = 0
        self.done = self.failed = 0
        self.paused_s = 0.0  # time the servers were paused (AReaL's pause_generation .. continue_generation)
        self.errors: list[str] = []
        self.seconds: list[float] = []  # each update, pause to continue
        self.completed: list[int] = [0]  # versions in the order they were completed

    def update(self, version: int) -> None:
        lorapub_on = self.engine.lorapub is not None
        tik = time.perf_counter()
        try:
            H.train_step_update(self.engine, self.meta, version, seed=version, save=self.save)
        except Exception as e:  # noqa: BLE001 - recorded: AReaL's trainer would stop here, the bench goes on
            self.failed += 1
            self.errors.append(f"v{version}: {type(e).__name__}: {str(e)[:160]}")
            return
        finally:
            self.seconds.append(round(time.perf_counter() - tik, 3))
            if not lorapub_on:
                self.paused_s += time.perf_counter() - tik
        self.done += 1
        self.newest = version
        if version:
            self.completed.append(version)


def run_path(name: str, args: argparse.Namespace, area: str) -> dict[str, Any]:
    live = bool(args.urls)
    fleet = LiveServers(args.urls) if live else H.Fleet(2, slots=args.offpolicyness + 4, decode_delay=args.decode_delay)
    H.name_resolve_in_memory(os.path.join(area, "name_resolve"))
    config = H.engine_config(offpolicyness=args.offpolicyness, fileroot=area, experiment=f"bench-{name}")
    on = name == "lorapub"
    engine = (LorapubSGLangEngine(config, lorapub=LorapubAReaLConfig(enabled=True, epoch=21), reconcile_interval=0.5)
              if on else LorapubSGLangEngine(config))
    engine.initialize(addr=fleet.addresses)
    meta = WeightUpdateMeta.from_disk(f"bench-{name}", "t0", area, use_lora=True, lora_name=H.LORA_NAME,
                                      lora_keep_versions=args.offpolicyness + 2)
    trainer = Trainer(engine, meta, copy_adapter(args.adapters) if args.adapters else _saved_as_trainers_save())
    inner = engine._engine
    calls: list[dict[str, Any]] = []
    original = inner.agenerate

    async def counted(req: Any) -> Any:
        record: dict[str, Any] = {"newest": trainer.newest, "start": time.perf_counter()}
        calls.append(record)
        try:
            resp = await original(req)
        except BaseException as e:
            record.update(error=f"{type(e).__name__}: {str(e)[:120]}", end=time.perf_counter())
            raise
        record.update(end=time.perf_counter(), tokens=len(resp.output_tokens),
                      versions=sorted(set(resp.output_versions)))
        return resp

    inner.agenerate = counted
    workflow = Ends(MultiTurnWorkflow(reward_fn=H.no_reward, gconfig=H.gconfig(max_new_tokens=args.tokens),
                                      tokenizer=H.tiny_tokenizer(), max_turns=args.turns, turn_discount=0.9))
    trajectories: list[Any] = []
    submitted = 0
    started = time.perf_counter()
    try:
        trainer.update(0)
        version = 0
        for round_ in range(args.rounds):
            if round_ > 0 and not live:  # a crash with nothing in flight: e0 comes back empty
                fleet.on_loop(fleet.doubles[0].restart)
            failed_before = len(workflow.failed_tasks)
            for _ in range(args.episodes):
                engine.submit(PROMPT, workflow=workflow, group_size=args.group)
            submitted += args.episodes
            for u in range(args.updates):
                time.sleep(args.interval)
                version += 1
                if round_ == 0 and u == 1 and not live:
                    fleet.on_loop(lambda: fleet.doubles[1].inject("load", "error"))
                trainer.update(version)
            deadline = time.monotonic() + args.wait
            while workflow.ended < submitted * args.group and time.monotonic() < deadline:
                time.sleep(0.05)
            accepted = args.episodes - (len(workflow.failed_tasks) - failed_before)
            if accepted > 0:
                trajectories += engine.wait(accepted, timeout=10, raise_timeout=False)
        if on:
            engine.lorapub.run(engine.lorapub.deployment.settle())
        answers = [(d.name, a) for d in fleet.doubles for a in fleet.on_loop(lambda d=d: list(d.answers))]
        ever = {d.name: fleet.on_loop(lambda d=d: set(d.ever_loaded)) for d in fleet.doubles}
        pauses = sum(fleet.on_loop(lambda d=d: d.events.count(("pause", ""))) for d in fleet.doubles)
        served = list(getattr(inner, "served", ()))
    finally:
        wall = time.perf_counter() - started
        engine.destroy()
        fleet.close()
    out = summarize(name, trainer, calls, trajectories, submitted * args.group, answers, ever, pauses, served, wall,
                    len(workflow.failed_tasks))
    if live:  # the servers' own answers are not seen
        for key in list(out):
            if key.startswith(("server answers", "answers ", "requests that fell back", "pause calls")):
                out[key] = "n/a"
    return out


def summarize(name: str, trainer: Trainer, calls: list[dict[str, Any]], trajectories: list[Any], samples: int,
              answers: list[tuple[str, tuple]], ever: dict[str, set[str]], pauses: int, served: list[dict],
              wall: float, failed_groups: int) -> dict[str, Any]:
    failed_calls = [c for c in calls if "error" in c]
    unloaded = sum(1 for _, (status, _, _, was_loaded) in answers if status == 400 and was_loaded)
    not_held = sum(1 for _, (status, _, _, was_loaded) in answers if status == 400 and not was_loaded)
    aborted = sum(1 for _, (status, _, error, _) in answers if status == 503 and "pause" in (error or ""))
    fell_back = sum(1 for _, (status, lora, _, _) in answers if status == 200 and not lora)
    # per sample: the versions of its turns, and whether one turn spanned two versions
    mixed = within_turn = rows = 0
    for traj in trajectories:
        if traj is None:
            continue
        for row in traj["versions"].tolist():
            rows += 1
            gen = [v for v in row if v != -1]
            if len(set(gen)) > 1:
                mixed += 1
            turn: list[int] = []
            for v in row + [-1]:
                if v != -1:
                    turn.append(v)
                elif turn:
                    within_turn += len(set(turn)) > 1
                    turn = []
    rebound_requests = sum(1 for s in served if s.get("rebinds"))
    lags: list[float] = []
    rank = {v: i for i, v in enumerate(trainer.completed)}  # lag counts completed updates, as lorapub's commits
    for c in calls:  # token-weighted: the newest version completed at dispatch minus the version it ran on
        if "versions" in c and c["versions"]:
            ran = min(c["versions"])
            lags += [max(0, rank[c["newest"]] - rank.get(ran, rank[c["newest"]]))] * max(1, c["tokens"])
    ends = sorted(c["end"] for c in calls if "end" in c and "error" not in c)
    spans = [(c["start"], c["end"]) for c in calls if "end" in c]
    # a gap counts while some request was waiting through it (not the idle time between rounds)
    gaps = [b - a for a, b in zip(ends, ends[1:]) if any(s <= a and e >= b for s, e in spans)]
    return {
        "path": name,
        "agenerate calls": len(calls),
        "requests failed (raised to the workflow)": len(failed_calls),
        "samples finished / submitted": f"{rows} / {samples}",
        "groups lost (a sample raised)": failed_groups,
        "server answers": len(answers),
        "answers refused: named a version that server had unloaded": unloaded,
        "answers refused: named a version that server does not hold (restart, failed load)": not_held,
        "answers aborted by a pause (resent by AReaL)": aborted,
        "requests that fell back to the base model": fell_back,
        "mixed-version samples": mixed,
        "... of which one turn spans two versions": within_turn,
        "requests on a rebound session (lorapub's record)": rebound_requests,
        "version lag p50 / p99 / max (token-weighted)": "{:g} / {:g} / {:g}".format(
            percentile(lags, 0.5), percentile(lags, 0.99), max(lags) if lags else 0),
        "updates done / failed": f"{trainer.done} / {trainer.failed}",
        "pause calls reaching the servers": pauses,
        "stall: servers paused (s)": round(trainer.paused_s, 3),
        "stall: longest gap between finished requests, some waiting (ms)": round(1000 * max(gaps), 1) if gaps else 0.0,
        "wall (s)": round(wall, 2),
        "update errors": trainer.errors,
        "update seconds": trainer.seconds,
        "request errors (first 3)": [c["error"] for c in failed_calls[:3]],
        "refused answers (first 8)": [f"{engine}: {status} {lora}: {error}" for engine, (status, lora, error, _) in answers
                                      if status != 200][:8],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small round (the smoke test)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--episodes", type=int, default=8, help="prompts per round")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (AReaL's group_size)")
    p.add_argument("--turns", type=int, default=4, help="MultiTurnWorkflow's max_turns (every turn is taken)")
    p.add_argument("--tokens", type=int, default=8, help="max_new_tokens per turn")
    p.add_argument("--updates", type=int, default=4, help="weight updates per round")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between updates")
    p.add_argument("--offpolicyness", type=int, default=1, help="max_head_offpolicyness (lorapub's max_lag)")
    p.add_argument("--decode-delay", type=float, default=0.01, help="the doubles' seconds per token")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a round's trajectories")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--paths", nargs="+", default=["areal", "lorapub"], choices=["areal", "lorapub"])
    p.add_argument("--urls", nargs="*", default=[], help="running SGLang servers (live) instead of doubles")
    p.add_argument("--adapters", nargs="*", default=[], help="PEFT adapter folders the trainer alternates (live)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.episodes, args.group, args.turns, args.updates, args.interval = 2, 3, 2, 3, 2, 0.15
    logging.getLogger().setLevel(logging.WARNING)
    for name in ("RemoteInfEngine", "WorkflowExecutor", "RewardAPI"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_path(name, args, os.path.join(tmp, name)) for name in args.paths}
    where = f"the servers {args.urls}" if args.urls else "two SGLang doubles"
    print(f"method: AReaL 1.0.4's RemoteSGLangEngine, WorkflowExecutor, GroupedRolloutWorkflow and MultiTurnWorkflow on "
          f"{where};")
    print(f"  {args.rounds} rounds x {args.episodes} prompts x {args.group} samples x {args.turns} turns x "
          f"{args.tokens} tokens{'' if args.urls else f' ({args.decode_delay * 1000:g} ms/token)'}; {args.updates} "
          f"updates/round {args.interval:g} s apart in FSDPEngine's order; "
          f"{'no fault injected (live)' if args.urls else 'the 2nd update of round 1 fails to load on e1; e0 restarts between rounds'}; "
          f"max_head_offpolicyness {args.offpolicyness} (lorapub: max_lag, capacity "
          f"{args.offpolicyness + 2}; AReaL: lora_keep_versions {args.offpolicyness + 2}); every call counted")
    first = next(iter(results.values()))
    keys = [k for k in first if k not in ("path", "update errors", "update seconds", "request errors (first 3)", "refused answers (first 8)")]
    width = max(len(k) for k in keys)
    titles = {"areal": "AReaL's own path", "lorapub": "lorapub"}
    print(f"| {'figure':<{width}} | " + " | ".join(titles[n] for n in results) + " |")
    print(f"| {'-' * width} | " + " | ".join("---:" for _ in results) + " |")
    for k in keys:
        print(f"| {k:<{width}} | " + " | ".join(str(r[k]) for r in results.values()) + " |")
    for name, r in results.items():
        for line in r["update errors"] + r["request errors (first 3)"]:
            print(f"  {name}: {line}")
        print(f"  {name}: seconds per update (pause to continue): {r['update seconds']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
