"""Session transitions through the registry's Ray actor: batched vs one call per command, as
callers and live sessions grow.

Method: one local Ray cluster; a registry actor with version A published and N live (bound)
sessions; C concurrent callers (asyncio tasks in one rollout process) each run a loop of
BindFirst + CloseAndRelease on fresh session keys (two state transitions per loop) for a fixed
number of transitions. The same workload runs with ``RayRegistry(batch=False)`` (control: one
actor call per command, as before) and ``batch=True`` (the commands of one event-loop turn share
one actor call), alternating, each repeated; the table prints the median and the spread
(min–max) of transitions/s, p50 and p99 per-command latency, and the number of actor calls, for
every caller count at the first live-session count, then for every live-session count at the
last caller count (1/10/100 callers at 1,000 sessions; 1,000/10,000/100,000 sessions at 100
callers by default). With 100 or more callers a third strategy runs beside them: batched, with
the actor's start-up objects put back in the collector (``gc.unfreeze()`` in the actor: the
control of the freeze the actor does once it has opened its registry). Inside the actor every
apply of its registry and every collection of its process is timed (through Ray's
``__ray_call__``). ``--durable`` puts the actor's registry on a SQLiteStore.

    python3 bench/registry_bench.py [--callers 1,10,100] [--live 1000,10000,100000]
                                    [--transitions 6000] [--repeats 3] [--durable] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def fill(handle: RayRegistry, live: int, have: int) -> None:
    """Bind sessions until ``live`` are live (they stay bound: the registry's size under test)."""
    registry = RayRegistry(handle.actor, call_timeout=600, batch=True)
    for start in range(have, live, 5000):  # one actor call per 5,000 (one event-loop turn each)
        await asyncio.gather(*(registry.handle(BindFirst(SessionKey(EPOCH, f"live-{i}", "n")))
                               for i in range(start, min(live, start + 5000))))


# -- inside the actor (run there through Ray's __ray_call__) ----------------------------------------------
def _instrument(actor) -> None:
    """Time every command or batch the actor's registry applies and every collection its process runs."""
    import gc as _gc

    actor._bench = {"apply": [], "gc": [], "gc_started": 0.0}
    registry = actor._registry()

    def timed(inner):
        def apply(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                actor._bench["apply"].append(time.perf_counter() - t)
        return apply

    registry.apply, registry.apply_many = timed(registry.apply), timed(registry.apply_many)

    def on_gc(phase, info):
        if phase == "start":
            actor._bench["gc_started"] = time.perf_counter()
        else:
            actor._bench["gc"].append(time.perf_counter() - actor._bench["gc_started"])

    _gc.callbacks.append(on_gc)


def _take_timings(actor) -> tuple[float, float, float]:
    """(median apply, longest apply, longest collection) in ms since the last call; then reset."""
    apply, collections = actor._bench["apply"], actor._bench["gc"]
    actor._bench["apply"], actor._bench["gc"] = [], []
    return (statistics.median(apply) * 1e3 if apply else 0.0, max(apply, default=0.0) * 1e3,
            max(collections, default=0.0) * 1e3)


def _unfreeze(actor) -> int:
    import gc as _gc

    frozen = _gc.get_freeze_count()
    _gc.unfreeze()  # the start-up objects back in the oldest generation: as before the freeze
    return frozen


def _freeze(actor) -> None:
    import gc as _gc

    _gc.collect()
    _gc.freeze()


UNFROZEN = "batched, actor not frozen (control)"


async def measure(handle: RayRegistry, callers: int, args, tag: str) -> dict[str, list[dict]]:
    """Control, batched and, with 100 or more callers, batched with the actor's start-up objects
    back in the collector (the freeze's control), interleaved, ``args.repeats`` times each."""
    strategies = [("one call per command (control)", False, False), ("batched", True, False)]
    if callers >= 100:
        strategies.append((UNFROZEN, True, True))
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in strategies}
    for r in range(args.repeats):
        for label, batch, unfrozen in strategies:
            if unfrozen:
                await handle.actor.__ray_call__.remote(_unfreeze)
            await handle.actor.__ray_call__.remote(_take_timings)
            registry = RayRegistry(handle.actor, call_timeout=120, batch=batch)
            run = await workload(registry, callers, args.transitions, f"{tag}-{r}-{len(runs[label])}-{batch}-{unfrozen}")
            run["apply_p50"], run["apply_max"], run["gc_max"] = await handle.actor.__ray_call__.remote(_take_timings)
            if unfrozen:
                await handle.actor.__ray_call__.remote(_freeze)
            runs[label].append(run)
    return runs


async def main(args) -> None:
    store = tempfile.mktemp(suffix=".db") if args.durable else None
    handle = RayRegistry.create("bench-registry", epoch=EPOCH, engines=ENGINES, store_path=store, call_timeout=120)
    await publish_a(handle)
    await handle.actor.__ray_call__.remote(_instrument)
    callers, lives = args.callers, args.live
    plan = [(lives[0], c) for c in callers] + [(n, callers[-1]) for n in lives[1:]]
    print(f"{args.transitions} transitions per run, {args.repeats} repeats, "
          f"{'SQLiteStore' if args.durable else 'memory'} registry; median (min–max)")
    print("actor: each call's apply inside the actor (a command, or a batch; median / longest of the run, ms) and the longest "
          "collection of the actor's process (ms); median over the repeats")
    print(f"{'live sessions':>13} {'callers':>7}  {'':36} {'transitions/s':>28} {'p50 ms':>22} {'p99 ms':>22} "
          f"{'actor calls':>12} {'actor: apply / longest':>23} {'longest gc':>11}")
    have, rows = 0, []
    for live, c in plan:
        await fill(handle, live, have)
        have = max(have, live)
        runs = await measure(handle, c, args, f"{live}-{c}")
        for label, rs in runs.items():
            med = lambda k: statistics.median([x[k] for x in rs])  # noqa: E731
            rows.append({"live_sessions": live, "callers": c, "strategy": label, "runs": rs})
            print(f"{live:>13,} {c:>7}  {label:36} {fmt([x['tps'] for x in rs]):>28} {fmt([x['p50'] for x in rs]):>22} "
                  f"{fmt([x['p99'] for x in rs]):>22} {med('calls'):>12,.0f} "
                  f"{med('apply_p50'):>12.1f} / {med('apply_max'):>6.1f} {med('gc_max'):>11.1f}", flush=True)
        ratio = statistics.median([x["tps"] for x in runs["batched"]]) / statistics.median(
            [x["tps"] for x in runs["one call per command (control)"]])
        print(f"{'':>13} {'':>7}  batched / control throughput: {ratio:.1f}x", flush=True)
    ray.kill(handle.actor)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"durable": args.durable, "transitions": args.transitions, "rows": rows}, f, indent=1)


def counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive counts, got {text!r}")
    return values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=counts, default=[1, 10, 100], help="caller counts (default 1,10,100)")
    parser.add_argument("--live", type=counts, default=[1000, 10000, 100000],
                        help="live sessions in the registry (default 1000,10000,100000)")
    parser.add_argument("--transitions", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--durable", action="store_true")
    parser.add_argument("--json", help="also write every run's figures to this file")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        asyncio.run(main(args))
    finally:
        ray.shutdown()
