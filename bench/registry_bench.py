"""Session transitions through the registry's Ray actor: batched vs one call per command.

Method: one local Ray cluster; a registry actor with version A published; C concurrent
callers (asyncio tasks in one rollout process, 100 by default) each run a loop of
BindFirst + CloseAndRelease on fresh session keys (two state transitions per loop) for
a fixed number of transitions. The same workload runs with ``RayRegistry(batch=False)``
(control: one actor call per command, as before) and ``batch=True`` (the commands of one
event-loop turn share one actor call), alternating, each repeated; the table prints the
median and the spread (min–max) of transitions/s, p50 and p99 per-command latency, and
the number of actor calls. ``--durable`` puts the actor's registry on a SQLiteStore.

    python3 bench/registry_bench.py [--callers 100] [--transitions 6000] [--repeats 3] [--durable]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import ray

from lorapub.adapters.ray_registry import RayRegistry
from lorapub.core.commands import BindFirst, CloseAndRelease, Commit, RecordPrepared, RecordReady, Reserve
from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SOURCE
from lorapub.core.identity import SessionKey, VersionKey
from lorapub.core.commands import RecordBucketDone
from lorapub.testing.fixtures import fake_plan

EPOCH = 1
ENGINES = {"e0": "e0-life", "e1": "e1-life"}


async def publish_a(registry: RayRegistry) -> None:
    key = VersionKey(EPOCH, "A")
    digest, plan = fake_plan("A", 1)
    reply = (await registry.handle(Reserve(key, digest, plan))).reply
    for engine, life in ENGINES.items():
        await registry.handle(RecordPrepared(reply.token, engine, life))
    for party in (SOURCE, *ENGINES):
        await registry.handle(RecordBucketDone(reply.token, party, 0, None if party == SOURCE else ENGINES[party]))
    for engine, life in ENGINES.items():
        await registry.handle(RecordReady(ReadyLocal(engine, reply.token, digest, life, "x")))
    await registry.handle(Commit(key, reply.token, reply.expected_default_revision))


async def workload(registry: RayRegistry, callers: int, transitions: int, tag: str) -> dict:
    per_caller = max(1, transitions // (2 * callers))
    latencies: list[float] = []

    async def caller(i: int) -> None:
        for j in range(per_caller):
            key = SessionKey(EPOCH, f"{tag}-{i}-{j}", "n")
            for command in (BindFirst(key), CloseAndRelease(key)):
                t = time.perf_counter()
                await registry.handle(command)
                latencies.append(time.perf_counter() - t)

    calls_before = registry.calls
    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    seconds = time.perf_counter() - started
    latencies.sort()
    return {
        "tps": len(latencies) / seconds,
        "p50": latencies[len(latencies) // 2] * 1e3,
        "p99": latencies[int(len(latencies) * 0.99)] * 1e3,
        "calls": registry.calls - calls_before,
        "n": len(latencies),
    }


def fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):,.1f}{unit} ({min(values):,.1f}–{max(values):,.1f})"


async def main(args) -> None:
    store = tempfile.mktemp(suffix=".db") if args.durable else None
    handle = RayRegistry.create("bench-registry", epoch=EPOCH, engines=ENGINES, store_path=store, call_timeout=120)
    await publish_a(handle)
    runs: dict[str, list[dict]] = {"one call per command (control)": [], "batched": []}
    for r in range(args.repeats):
        for label, batch in (("one call per command (control)", False), ("batched", True)):
            registry = RayRegistry(handle.actor, call_timeout=120, batch=batch)
            runs[label].append(await workload(registry, args.callers, args.transitions, f"{r}-{batch}"))
    print(f"{args.callers} callers, {runs['batched'][0]['n']} transitions per run, {args.repeats} repeats, "
          f"{'SQLiteStore' if args.durable else 'memory'} registry; median (min–max)")
    print(f"{'':34} {'transitions/s':>28} {'p50 ms':>22} {'p99 ms':>22} {'actor calls':>12}")
    for label, rs in runs.items():
        print(f"{label:34} {fmt([x['tps'] for x in rs]):>28} {fmt([x['p50'] for x in rs]):>22} "
              f"{fmt([x['p99'] for x in rs]):>22} {statistics.median([x['calls'] for x in rs]):>12,.0f}")
    ratio = statistics.median([x["tps"] for x in runs["batched"]]) / statistics.median(
        [x["tps"] for x in runs["one call per command (control)"]])
    print(f"batched / control throughput: {ratio:.1f}x")
    ray.kill(handle.actor)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--transitions", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--durable", action="store_true")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        asyncio.run(main(args))
    finally:
        ray.shutdown()
