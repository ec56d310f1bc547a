"""GPU acceptance: numerics of bound versions, bidirectional KV isolation, and an online run.

    python3 -m tests.gpu.acceptance --device cuda --out report.json

Real LoRA numerics (HF Qwen3 + PEFT on the device) published and served through lorapub's
own registry, publisher, reclaimer and session service; engines are ``PeftEngine``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time

import torch

from lorapub.deployment import Deployment
from lorapub.effects_runner import Deadlines
from lorapub.errors import CapacityError, LorapubError
from lorapub.workload import percentile
from tests.gpu.fixtures import adapter_snapshot, build_all
from tests.gpu.peft_engine import PeftEngine

SEED = 1234
SCORE_IDS = list(range(7, 512, 32))  # 16 fixed scoring token ids at the last prompt position
MAX_NEW = 4
PROMPT_LEN = 96
TOOL_LEN = 12


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 512) for _ in range(n)]


def vec(out: dict) -> list[float]:
    return list(out["meta_info"]["scores"]) + list(out["meta_info"]["output_token_logprobs"])


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


class Baselines:
    """A-only / B-only / C-only engines, each clean: one adapter, cache cleared before every call."""

    def __init__(self, paths, snapshots, device, stash):
        self.engines = {}
        self.paths, self.snapshots, self.device, self.stash = paths, snapshots, device, stash

    async def engine(self, which: str) -> PeftEngine:
        if which not in self.engines:
            e = PeftEngine(f"clean{which}", self.paths["base"], self.stash, device=self.device, score_ids=SCORE_IDS)
            e.add_adapter(self.paths[which], f"only-{which}")
            e.adapters[f"only-{which}"] = f"clean-{which}"
            e.refs[f"clean-{which}"] = 0
            self.engines[which] = e
        return self.engines[which]

    async def score(self, which: str, ids: list[int]) -> list[float]:
        e = await self.engine(which)
        e.kv.clear()
        return vec(await e.generate({"input_ids": ids, "lora_path": f"only-{which}", "sampling_params": {"max_new_tokens": MAX_NEW}}))


async def run(device: str, root: str) -> dict:
    t_start = time.monotonic()
    paths = build_all(os.path.join(root, "fixtures"))
    snaps = {k: adapter_snapshot(paths[k]) for k in "ABC"}
    stash = os.path.join(root, "stash")
    report: dict = {
        "env": {
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        },
        "config": {"seed": SEED, "dtype": "bfloat16", "score_ids": SCORE_IDS, "max_new_tokens": MAX_NEW,
                   "sampling": "greedy", "prompt_len": PROMPT_LEN, "tool_len": TOOL_LEN,
                   "digests": {k: s.digest for k, s in snaps.items()}},
    }
    try:
        import peft
        import transformers

        report["env"].update(transformers=transformers.__version__, peft=peft.__version__)
    except ImportError:
        pass
    rng = random.Random(SEED)
    prompt = tokens(rng, PROMPT_LEN)
    base = Baselines(paths, snaps, device, stash)

    # -- baselines, stability, separation, epsilon ---------------------------------------
    runs = {k: [await base.score(k, prompt) for _ in range(3)] for k in "AB"}
    instability = max(max_diff(r, runs[k][0]) for k in "AB" for r in runs[k])
    separation = max_diff(runs["A"][0], runs["B"][0])
    probe = PeftEngine("probe", paths["base"], stash, device=device, score_ids=SCORE_IDS)
    probe.add_adapter(paths["B"], "B")
    probe.adapters["B"], probe.refs["pB"] = "pB", 0
    cold = vec(await probe.generate({"input_ids": prompt, "lora_path": "B", "sampling_params": {"max_new_tokens": MAX_NEW}}))
    cache_delta = 0.0  # the same tokens through a cached prefix (several split points) vs cold
    for split in (16, 48, PROMPT_LEN - 1):
        probe.kv.clear()
        await probe.generate({"input_ids": prompt[:split], "lora_path": "B", "sampling_params": {"max_new_tokens": MAX_NEW}})
        warm = vec(await probe.generate({"input_ids": prompt, "lora_path": "B", "sampling_params": {"max_new_tokens": MAX_NEW}}))
        cache_delta = max(cache_delta, max_diff(warm, runs["B"][0]))
    eps = max(10 * instability, 3 * cache_delta, 1e-3)  # fixed rule, decided before the scenario runs
    report["epsilon"] = {"instability": instability, "cached_vs_cold": cache_delta, "separation_A_B": separation,
                         "epsilon": eps, "separated": separation > 10 * eps, "cold_matches_baseline": max_diff(cold, runs["B"][0])}

    # -- the S_old / S_mid / S_new scenario on E0/E1 through lorapub ------------------------
    engines = {n: PeftEngine(n, paths["base"], stash, device=device, score_ids=SCORE_IDS) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, enabled=True, stash_dir=stash, bucket_cap_bytes=64 << 10,
                           deadlines=Deadlines(begin=30, bucket=60, end=60, cleanup=60, commit=10, reclaim=120)).start()
    occupancy, latencies, failures, pubs = [], [], 0, {}

    async def slots():
        occupancy.append((await dep.registry.snapshot()).slots_held)

    async def turn(session, ids, engine_name):
        nonlocal failures
        session.engine = engines[engine_name]
        t0 = time.monotonic()
        try:
            out = await session.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW}})
        except LorapubError:
            failures += 1
            raise
        latencies.append(time.monotonic() - t0)
        await slots()
        return out

    pubs["A"] = await dep.publish(snaps["A"], "A")
    await slots()
    sessions = {"S_old": dep.session("S_old"), "S_mid": dep.session("S_mid"), "S_new": dep.session("S_new")}
    contexts = {name: list(prompt) for name in sessions}
    checks: list[dict] = []

    async def checked_turn(name, engine_name, label):
        s = sessions[name]
        out = await turn(s, contexts[name], engine_name)
        version = s.binding.version.version_id
        ref = await base.score(version, contexts[name])
        checks.append({"session": name, "turn": label, "engine": engine_name, "version": version,
                       "cached_tokens": out["meta_info"]["cached_tokens"], "diff": max_diff(vec(out), ref),
                       "diff_other": max_diff(vec(out), await base.score("B" if version == "A" else "A", contexts[name]))})
        return out

    first = await checked_turn("S_old", "e0", "first")
    # publish B while S_old keeps going; E1's end is slow so only E0 is READY for a while
    engines["e1"].end_delay = 1.0
    progress: list[float] = []
    stop = asyncio.Event()

    async def keep_old_going():
        ids = contexts["S_old"] + first["output_ids"] + tokens(rng, TOOL_LEN)
        while not stop.is_set():
            await turn(sessions["S_old"], ids, "e0")
            progress.append(time.monotonic())

    background = asyncio.create_task(keep_old_going())
    t_pub = time.monotonic()
    publishing = asyncio.create_task(dep.publish(snaps["B"], "B"))
    while not any("-B-" in n for n in engines["e0"].adapters):
        await asyncio.sleep(0.01)
    await checked_turn("S_mid", "e1", "first (E0 READY only)")
    pubs["B"] = await publishing
    t_pub_end = time.monotonic()
    stop.set()
    await background
    engines["e1"].end_delay = 0.0
    await checked_turn("S_new", "e1", "first (after commit)")
    marks = [t_pub] + [p for p in progress if t_pub <= p <= t_pub_end] + [t_pub_end]
    report["no_progress_gap_during_B_s"] = max(b - a for a, b in zip(marks, marks[1:]))
    report["requests_during_B_publication"] = len(marks) - 2

    for k in range(2):  # tool turns on both engines, then abort/resume = the same request again
        for name in sessions:
            contexts[name] = contexts[name] + tokens(rng, TOOL_LEN)
            out = await checked_turn(name, "e0" if (k + hash(name)) % 2 else "e1", f"tool turn {k + 1}")
            contexts[name] = contexts[name] + out["output_ids"]
    for name in sessions:
        await checked_turn(name, "e1", "resume (same request again)")
        await checked_turn(name, "e0", "resume on the other engine")
    report["scenario"] = checks
    report["bindings"] = {n: s.binding.version.version_id for n, s in sessions.items()}

    # -- C rejected, A reclaimed, a partial failure cleaned ------------------------------------
    online: dict = {}
    try:
        await dep.publish(snaps["C"], "C")
        online["C_while_A_bound"] = "accepted"
    except CapacityError as e:
        online["C_while_A_bound"] = e.code
    for name in ("S_old", "S_mid"):
        await sessions[name].close()
    await dep.settle()
    state = await dep.registry.snapshot()
    online["A_after_sessions_closed"] = state.versions[pubs["A"].version].state.value
    online["A_unloads"] = {n: e.unloads.count(pubs["A"].lora_name) for n, e in engines.items()}
    engines["e1"].fail_end = 1
    try:
        await dep.publish(snaps["C"], "C")
        online["C_with_e1_failure"] = "published"
    except LorapubError as e:
        state = await dep.registry.snapshot()
        c = next(v for v in state.versions.values() if v.key.version_id == "C")
        online["C_with_e1_failure"] = f"{e.code}; C is {c.state.value}; default {state.default.version_id}"
        online["C_left_on_engines"] = {n: [a for a in e_.adapters if "-C-" in a] for n, e_ in engines.items()}
    b_after = await turn(sessions["S_new"], contexts["S_new"], "e0")
    online["S_new_still_matches_B"] = max_diff(vec(b_after), await base.score("B", contexts["S_new"])) <= eps
    pubs["C2"] = await dep.publish(snaps["C"], "C2")
    await slots()
    await sessions["S_new"].close()
    await dep.settle()
    online["max_slots_held"] = max(occupancy)
    online["failures"] = failures
    online["request_latency_ms"] = {q: percentile(latencies, q) * 1000 for q in (50, 95, 99)}
    online["publications"] = {k: {"ms": r.seconds * 1000, "phases_ms": {p: v * 1000 for p, v in r.phases.items()}}
                              for k, r in pubs.items()}
    report["online"] = online

    # -- KV isolation, both directions, independent initial caches -------------------------
    kv: dict = {}
    for first_v, second_v in (("A", "B"), ("B", "A")):
        e = PeftEngine(f"kv-{first_v}", paths["base"], stash, device=device, score_ids=SCORE_IDS)
        for v in "AB":
            e.add_adapter(paths[v], v)
            e.adapters[v] = f"id-{v}-{first_v}"
            e.refs[e.adapters[v]] = 0
        gen = lambda v: e.generate({"input_ids": prompt, "lora_path": v, "sampling_params": {"max_new_tokens": MAX_NEW}})  # noqa: E731
        await gen(first_v)
        warm = await gen(first_v)
        one = await gen(second_v)
        two = await gen(second_v)
        cold = await base.score(second_v, prompt)
        kv[f"{first_v}_warm_then_{second_v}"] = {
            f"{first_v}_repeat_cached": warm["meta_info"]["cached_tokens"],
            f"first_{second_v}_cached": one["meta_info"]["cached_tokens"],
            f"first_{second_v}_vs_cold": max_diff(vec(one), cold),
            f"repeat_{second_v}_cached": two["meta_info"]["cached_tokens"],
            f"repeat_{second_v}_vs_cold": max_diff(vec(two), cold),
        }
    bad = PeftEngine("kv-broken", paths["base"], stash, device=device, score_ids=SCORE_IDS, key_includes_lora=False)
    for v in "AB":
        bad.add_adapter(paths[v], v)
        bad.adapters[v] = f"bad-{v}"
        bad.refs[bad.adapters[v]] = 0
    await bad.generate({"input_ids": prompt, "lora_path": "A", "sampling_params": {"max_new_tokens": MAX_NEW}})
    leaked = await bad.generate({"input_ids": prompt, "lora_path": "B", "sampling_params": {"max_new_tokens": MAX_NEW}})
    kv["negative_control_cache_without_lora_id"] = {
        "first_B_cached": leaked["meta_info"]["cached_tokens"],
        "first_B_vs_cold": max_diff(vec(leaked), await base.score("B", prompt)),
    }
    report["kv_isolation"] = kv
    report["seconds"] = time.monotonic() - t_start
    return report


def verdicts(r: dict) -> dict[str, bool]:
    eps = r["epsilon"]["epsilon"]
    kv = r["kv_isolation"]
    return {
        "baselines stable and A/B separated (separation > 10 eps)": r["epsilon"]["separated"],
        "every response matches its bound version within eps": all(c["diff"] <= eps for c in r["scenario"]),
        "and is far from the other version": all(c["diff_other"] > 10 * eps for c in r["scenario"]),
        "S_old and S_mid bound A, S_new bound B": r["bindings"] == {"S_old": "A", "S_mid": "A", "S_new": "B"},
        "KV: A warm -> first B has 0 cached and equals B cold": kv["A_warm_then_B"]["first_B_cached"] == 0
        and kv["A_warm_then_B"]["first_B_vs_cold"] <= eps,
        "KV: B repeated hits its own cache within eps": kv["A_warm_then_B"]["repeat_B_cached"] > 0
        and kv["A_warm_then_B"]["repeat_B_vs_cold"] <= eps,
        "KV mirror: B warm -> first A has 0 cached and equals A cold": kv["B_warm_then_A"]["first_A_cached"] == 0
        and kv["B_warm_then_A"]["first_A_vs_cold"] <= eps,
        "KV mirror: A repeated hits its own cache": kv["B_warm_then_A"]["repeat_A_cached"] > 0
        and kv["B_warm_then_A"]["repeat_A_vs_cold"] <= eps,
        "negative control: a cache key without lora_id leaks (the check can fail)":
            kv["negative_control_cache_without_lora_id"]["first_B_cached"] > 0
            and kv["negative_control_cache_without_lora_id"]["first_B_vs_cold"] > eps,
        "C rejected for capacity while A bound": r["online"]["C_while_A_bound"] == "CAPACITY_ERROR",
        "A reclaimed, unloaded once per engine": r["online"]["A_after_sessions_closed"] == "RECLAIMED"
        and set(r["online"]["A_unloads"].values()) == {1},
        "partial failure cleaned, default kept": "FAILED_CLEAN" in r["online"]["C_with_e1_failure"]
        and "default B" in r["online"]["C_with_e1_failure"],
        "no request failures, <= 2 managed versions": r["online"]["failures"] == 0 and r["online"]["max_slots_held"] <= 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    parser.add_argument("--root")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="lorapub-gpu-")
    report = asyncio.run(run(args.device, root))
    report["verdicts"] = verdicts(report)
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({k: report[k] for k in ("env", "epsilon", "bindings", "online", "kv_isolation", "seconds")}, indent=1, default=str))
    for name, ok in report["verdicts"].items():
        print(f"[{'pass' if ok else 'FAIL'}] {name}")
    return 0 if all(report["verdicts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
