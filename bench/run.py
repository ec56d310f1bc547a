#!/usr/bin/env python3
"""lorapub vs pause/flush/overwrite, side by side in one run, plus control-plane scaling.

    python3 bench/run.py                      # embedded engines (contract double), CPU
    python3 bench/run.py --engine-url U0 --engine-url U1 --stash-dir /shared   # real patched SGLang

Part 1 runs the same seeded agentic workload twice against fresh E0/E1 engines,
publishing a new adapter version on a fixed cadence: (a) the baseline pauses
generation, flushes the KV cache and overwrites one fixed adapter name;
(b) lorapub publishes immutable versions beside the live ones. Part 2 measures
the registry's decisions alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from lorapub.adapters.sglang_http import SGLangEngine, SGLangOverwriteAdmin  # noqa: E402
from lorapub.core import registry as R  # noqa: E402
from lorapub.core.attempt import ReadyLocal  # noqa: E402
from lorapub.core.effects import SOURCE  # noqa: E402
from lorapub.core.identity import SessionKey, VersionKey  # noqa: E402
from lorapub.runtime.deployment import deploy  # noqa: E402
from lorapub.runtime.runner import Deadlines  # noqa: E402
from lorapub.errors import CapacityError, PublicationBlocked  # noqa: E402
from lorapub.testing.fixtures import lora_snapshot  # noqa: E402
from lorapub.runtime.registry import LocalRegistry  # noqa: E402
from lorapub.core.registry import BindFirst, CloseAndRelease  # noqa: E402
from lorapub.demo.workload import WorkloadSpec, percentile, run_workload  # noqa: E402


# -- part 1: online publication ----------------------------------------------------------
async def one_strategy(enabled: bool, args, spec: WorkloadSpec, publications: int | None = None) -> dict:
    n_publications = args.publications if publications is None else publications
    doubles = []
    stash = tempfile.mkdtemp(prefix="lorapub-bench-")
    if args.engine_url:
        urls = args.engine_url
    else:
        from lorapub.testing import SGLangDouble

        doubles = [await SGLangDouble(
                f"e{i}", decode_delay=args.decode_delay, load_delay=args.load_delay, prefill_per_token=args.prefill_per_token
            ).start() for i in range(2)]
        urls = [d.url for d in doubles]
    if enabled:
        engines = {f"e{i}": SGLangEngine(f"e{i}", u, args.stash_dir or stash) for i, u in enumerate(urls)}
    else:
        engines = {f"e{i}": SGLangOverwriteAdmin(f"e{i}", u) for i, u in enumerate(urls)}
    dep = await deploy(engines, epoch=1, enabled=enabled, deadlines=Deadlines(), bucket_cap_bytes=64 << 10, stash_dir=stash)
    await dep.publish(lora_snapshot(1000), "v0")  # bootstrap: before any session exists
    windows, publications, deferred = [], [], 0
    # the trainer builds snapshots in its own process; here they are ready before the run
    snapshots = {i: lora_snapshot(1000 + i) for i in range(1, n_publications + 1)}

    async def cadence():
        nonlocal deferred
        for i in range(1, n_publications + 1):
            await asyncio.sleep(args.cadence)
            t0 = time.monotonic()
            try:
                report = await dep.publish(snapshots[i], f"v{i}")
            except (CapacityError, PublicationBlocked):
                deferred += 1  # both slots still in use by live sessions: try at the next tick
                continue
            t1 = time.monotonic()
            windows.append((t0, t1))
            phases = {} if isinstance(report, float) else dict(report.phases)
            publications.append((t1 - t0, phases))

    publisher = asyncio.create_task(cadence())
    result = await run_workload(spec, dep.session)
    await publisher
    if enabled:
        await dep.settle()
    for e in engines.values():
        await e.close()
    for d in doubles:
        await d.stop()
    gaps_during = [max(result.longest_gap((a, b)).values() or [0.0]) for a, b in windows]
    cached_after = [result.cached_ratio(a, b + 0.1) for a, b in windows]  # turns around each publication
    return {
        "p50": result.latency(50), "p95": result.latency(95), "p99": result.latency(99),
        "gap": max(result.longest_gap().values()),
        "gap_publication": max(gaps_during or [0.0]),
        "failed": result.failures,
        "requests": len(result.records),
        "mixed": result.mixed_version_sessions(),
        "cached_after": statistics.fmean([c for c in cached_after if c == c] or [float("nan")]),
        "publication": statistics.fmean([p for p, _ in publications]) if publications else float("nan"),
        "phases": {k: statistics.fmean([ph.get(k, 0.0) for _, ph in publications]) for k in ("begin", "transfer", "end", "commit")}
        if publications and publications[0][1] else {},
        "published": len(publications),
        "deferred": deferred,
    }


def ms(x: float) -> str:
    return f"{x * 1000:9.1f} ms"


def ratio(a: float, b: float) -> str:
    if b == 0:
        return "     n/a" if a == 0 else "     inf"
    return f"{a / b:8.3f}"


async def part1(args) -> dict:
    spec = WorkloadSpec(sessions=args.sessions, arrival_interval=args.arrival, turns=(3, 6), seed=args.seed,
                        tool_latency=0.005, max_new_tokens=8)
    print(f"== online publication: {spec.sessions} sessions, 3-6 tool turns, seed {spec.seed}, "
          f"{args.publications} publications every {args.cadence}s, load time {args.load_delay * 1000:.0f} ms ==")
    quiet = await one_strategy(True, args, spec, publications=0)  # control: the same run, nothing published
    base = await one_strategy(False, args, spec)
    lora = await one_strategy(True, args, spec)
    rows = [
        ("request latency p50", ms(base["p50"]), ms(lora["p50"]), ratio(lora["p50"], base["p50"])),
        ("request latency p95", ms(base["p95"]), ms(lora["p95"]), ratio(lora["p95"], base["p95"])),
        ("request latency p99", ms(base["p99"]), ms(lora["p99"]), ratio(lora["p99"], base["p99"])),
        ("longest no-progress gap (whole run)", ms(base["gap"]), ms(lora["gap"]), ratio(lora["gap"], base["gap"])),
        ("longest no-progress gap (publications)", ms(base["gap_publication"]), ms(lora["gap_publication"]),
         ratio(lora["gap_publication"], base["gap_publication"])),
        ("requests failed", f"{base['failed']:12d}", f"{lora['failed']:12d}", ratio(lora["failed"], base["failed"])),
        ("mixed-version sessions", f"{base['mixed']:12d}", f"{lora['mixed']:12d}", ratio(lora["mixed"], base["mixed"])),
        ("cached-token ratio around a publication", f"{base['cached_after']:12.3f}", f"{lora['cached_after']:12.3f}",
         ratio(lora["cached_after"], base["cached_after"])),
        ("publication latency", ms(base["publication"]), ms(lora["publication"]), ratio(lora["publication"], base["publication"])),
    ]
    print(f"{'figure':42}{'baseline':>14}{'lorapub':>14}{'lorapub/baseline':>18}")
    for name, b, l, r in rows:
        print(f"{name:42}{b:>14}{l:>14}{r:>18}")
    print(f"control run without publications: longest no-progress gap {quiet['gap'] * 1000:.1f} ms, "
          f"p99 {quiet['p99'] * 1000:.1f} ms")
    print(f"publications done: baseline {base['published']}, lorapub {lora['published']} "
          f"(deferred by capacity: {lora['deferred']}); requests: {base['requests']} / {lora['requests']}")
    if lora["phases"]:
        print("lorapub phases (mean): " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in lora["phases"].items()))
    bars = {
        "gap during publication <= 5% of baseline": lora["gap_publication"] <= 0.05 * base["gap_publication"],
        "0 extra request failures": lora["failed"] <= base["failed"] and lora["failed"] == 0,
        "0 mixed-version sessions": lora["mixed"] == 0,
    }
    return bars


# -- part 2: control plane -------------------------------------------------------------
def publish_decisions(state, version: str, n_buckets: int):
    """All registry decisions of one publication over every engine; returns (state, count)."""
    from lorapub.testing.fixtures import fake_plan

    digest, plan = fake_plan(version, tensors=n_buckets, cap=64)
    key = VersionKey(state.epoch, version)
    out = R.reserve(state, key, digest, plan)
    state, token, n = out.state, out.reply.token, 1
    for e, inc in state.engines.items():
        state = R.record_prepared(state, token, e, inc).state
        n += 1
    for i in range(len(plan)):
        for p in (SOURCE, *state.engines):
            state = R.record_bucket_done(state, token, p, i, state.engines.get(p)).state
            n += 1
    for e, inc in state.engines.items():
        state = R.record_ready(state, ReadyLocal(e, token, digest, inc)).state
        n += 1
    state = R.commit(state, key, token, state.default_revision).state
    return state, n + 1


def part2() -> dict:
    print("\n== control plane (registry decisions alone, this machine) ==")
    print(f"{'engines':>8}{'decisions/publication':>24}{'µs/decision':>14}{'publication decide':>22}")
    for n_engines in (2, 4, 8, 16, 32, 64):
        engines = {f"e{i}": "i0" for i in range(n_engines)}
        t0 = time.perf_counter()
        decisions = 0
        reps = 20
        for r in range(reps):
            state = R.new_registry(1, engines)
            state, n = publish_decisions(state, f"v{r}", 4)
            decisions += n
        dt = time.perf_counter() - t0
        print(f"{n_engines:8d}{decisions // reps:24d}{dt / decisions * 1e6:14.1f}{dt / reps * 1e3:19.2f} ms")

    print(f"\n{'sessions':>9}{'bind_first p50':>16}{'p99':>12}{'close p99':>12}{'transitions/s':>16}")
    results = {}
    for n in (10, 100, 1000, 10000):
        svc = LocalRegistry(1, {"e0": "i0", "e1": "i1"})
        state, _ = publish_decisions(svc.state, "A", 2)
        svc._state = state
        binds, closes = [], []
        keys = [SessionKey(1, f"s{i}", "n") for i in range(n)]
        t_all = time.perf_counter()
        for k in keys:  # n sessions bound at once: the n-th decision sees n-1 live ones
            t = time.perf_counter()
            svc.apply(BindFirst(k))
            binds.append(time.perf_counter() - t)
        for k in keys[: min(n, 1000)]:
            t = time.perf_counter()
            svc.apply(BindFirst(k))  # replays (lost replies) cost the same lookup
            binds.append(time.perf_counter() - t)
        for k in keys:
            t = time.perf_counter()
            svc.apply(CloseAndRelease(k))
            closes.append(time.perf_counter() - t)
        total = time.perf_counter() - t_all
        rate = svc.transitions / total
        results[n] = percentile(binds, 99)
        print(f"{n:9d}{percentile(binds, 50) * 1e6:13.1f} µs{percentile(binds, 99) * 1e6:9.1f} µs"
              f"{percentile(closes, 99) * 1e6:9.1f} µs{rate:16,.0f}")
    return {"registry decision p99 < 1 ms at 10,000 sessions": results[10000] < 1e-3}


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-url", action="append")
    parser.add_argument("--stash-dir")
    parser.add_argument("--sessions", type=int, default=60)
    parser.add_argument("--arrival", type=float, default=0.01)
    parser.add_argument("--publications", type=int, default=3)
    parser.add_argument("--cadence", type=float, default=0.25)
    parser.add_argument("--decode-delay", type=float, default=0.002)
    parser.add_argument("--load-delay", type=float, default=0.25, help="simulated adapter load + GPU prep (s)")
    parser.add_argument("--prefill-per-token", type=float, default=20e-6, help="simulated prefill cost of an uncached token (s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--skip-online", action="store_true")
    args = parser.parse_args()
    bars = {} if args.skip_online else await part1(args)
    bars.update(part2())
    print("\n== performance bars ==")
    for name, ok in bars.items():
        print(f"  [{'pass' if ok else 'FAIL'}] {name}")
    return 0 if all(bars.values()) else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
