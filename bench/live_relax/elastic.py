#!/usr/bin/env python3
"""An elastic fleet under Relax-shaped load: two engines, then a third joins while rollouts run and the
first drains and leaves.

    python3 bench/live_relax/elastic.py                                    # three SGLang doubles (CPU)
    python3 bench/live_relax/elastic.py --engine-url U0 --engine-url U1 --engine-url U2 --adapter DIR
                                                                           # three live patched servers

The rollouts and the trainer go through lorapub's Relax integration by way of the stand-ins of
``tests/integrations/relax_harness.py`` (driver.py beside it says how). The fleet changes the way Relax
changes it: the router's worker list (the shard's source, ``follow_workers``) and the coordinator's
topology (the trainer's, read before each weight update). Phases: the first sync (Relax's own) and two
engines; rollouts start; the third engine joins and a weight update publishes; the first engine leaves
the lists and a weight update publishes; the rollouts go on, then stop. Printed and written (``--json``):
every request's outcome (failed ones by code; VERSION_MISSING would be a version missing), the engines
the turns went to in each phase, the join and drain times, each publication's outcome, and what each
engine holds at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src"), os.path.dirname(os.path.abspath(__file__))]

from lorapub import Deadlines  # noqa: E402
from lorapub.adapters.sglang_wire import SGLangWireEngine  # noqa: E402
from lorapub.integrations.relax import DEFAULT_NAME_PREFIX, engine_name  # noqa: E402
from lorapub.local_registry import LocalRegistry  # noqa: E402

import driver  # noqa: E402  (bench/live_relax/driver.py: the versions, the adapter sync, the registry)
from tests.integrations import relax_harness as harness  # noqa: E402


async def until_healthy(url: str, timeout: float) -> float:
    """Seconds until ``url`` answers /health (live, the third server boots while the first two serve: a
    router lists a worker once it is healthy)."""
    import aiohttp

    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return time.monotonic() - started
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")
            await asyncio.sleep(1.0)


async def until_file(path: str, timeout: float) -> float:
    """Seconds until ``path`` exists (live: the servers are up and warm; this process built its versions
    meanwhile, which took a minute and more beside the servers' boots)."""
    started = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - started > timeout:
            raise SystemExit(f"{path} did not appear within {timeout:g} s: the servers did not come up")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


def topology(urls: list[str]) -> dict[int, dict]:
    return {i: {"ip": urllib.parse.urlsplit(u).hostname, "port": urllib.parse.urlsplit(u).port}
            for i, u in enumerate(urls)}


async def run(args) -> dict:
    procs: list = []
    urls = list(args.engine_url or [])
    if not urls:  # three doubles: driver.start_doubles starts two, so twice, keeping three
        first, procs_a = await driver.start_doubles(args)
        more, procs_b = await driver.start_doubles(args)
        await driver.bench.stop_engines(procs_b[1:])
        urls, procs = [*first, more[0]], [*procs_a, procs_b[0]]
    if len(urls) != 3:
        raise SystemExit("give three --engine-url (two to start with, the third joins)")
    labels = {engine_name(u): f"e{i}" for i, u in enumerate(urls)}
    folder = tempfile.mkdtemp(prefix="relax-elastic-")
    tempfile.tempdir = folder
    epoch = int(time.time() * 1000)
    relax = driver.relax_args(args, enabled=True, urls=urls[:2], epoch=epoch, folder=folder)
    built = time.perf_counter()
    snapshots = {step: driver.version_snapshot(args, step) for step in range(1, 4)}
    for snapshot in snapshots.values():
        snapshot.digest  # noqa: B018 - hashed now, while the servers may still be booting
    print(f"versions built in {time.perf_counter() - built:.1f} s", flush=True)  # live once: 95 s with the imports
    if args.start_after:
        waited = await until_file(args.start_after, args.boot_timeout)
        print(f"ready {waited:.1f} s after the versions were built ({args.start_after})", flush=True)
    incarnations = {}
    for u in urls[:2]:
        probe = SGLangWireEngine(engine_name(u), u)
        try:
            incarnations[engine_name(u)] = await probe.incarnation()
        finally:
            await probe.close()
    registry = driver.SharedRegistry(LocalRegistry(epoch, incarnations, args.capacity, max_lag=args.max_lag,
                                                   name_prefix=DEFAULT_NAME_PREFIX))
    options = {"registry": registry, "deadlines": Deadlines(), **({} if args.adapter else {"bucket_cap_bytes": 64 << 10})}
    harness.INJECT["shard"] = options
    harness.INJECT["trainer"] = {"background": False,
                                 "publisher": lambda: driver.TimedPublisher(relax, worker_urls=urls[:2], **options)}
    try:
        shard = harness.AgenticSessionShard(relax, None, None, None)
        model = harness.Model(lambda step: {n: snapshots[step].tensor(n) for n in snapshots[step].tensor_names})
        device = harness.DeviceDirectBackend(relax, "nccl", None, [model], model_name="relax-elastic",
                                             quantization_config=None)
    finally:
        harness.INJECT["shard"], harness.INJECT["trainer"] = {}, {}
    device._lora_sync = driver.AdapterSync(relax, device.model, snapshots[1].serving_config)
    device.init_process_group_for_rollout(topology(urls[:2]))
    path, lorapub = device._lorapub_path, shard._lorapub
    await shard.resume_generation(0)

    phase = ["two engines"]
    outcomes: collections.Counter = collections.Counter()
    by_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    stop = asyncio.Event()
    timeline: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def mark(what: str) -> None:
        timeline.append((round(time.monotonic() - t0, 3), what))
        print(f"{timeline[-1][0]:8.2f}s  {what}", flush=True)

    async def ask(sid: str, tokens: list[int]) -> None:
        answer = await shard.chat(session_id=sid, messages=[{"role": "user", "content": tokens}], tools=[],
                                  chat_template_kwargs={}, max_completion_tokens=args.max_new_tokens, stop=None,
                                  seed=None)
        outcomes[answer["error"]["code"] if "error" in answer else "ok"] += 1
        member = lorapub.member(sid)
        if member is not None and member.engine is not None:
            by_phase[phase[0]][labels.get(member.engine.name, member.engine.name)] += 1

    async def rollouts(worker: int) -> None:
        n = 0
        while not stop.is_set():
            gid = f"w{worker}.g{n}"
            members = tuple(f"{gid}.s{i}" for i in range(args.group_size))
            await shard.start_group("train", gid, tuple(harness.SessionSpec({}, None, None, s) for s in members))
            first = [asyncio.create_task(ask(s, [1 + n % 50] * 24)) for s in members]
            while not shard._groups[gid].first_request_barrier_crossed and not all(t.done() for t in first):
                await asyncio.sleep(0.002)
            await shard.lease_group(gid, 1)
            await asyncio.gather(*first)
            for turn in range(args.turns - 1):
                await asyncio.gather(*(ask(s, [2 + turn] * 6) for s in members))
            for s in members:
                await shard.finish_agent(s)
            if await harness.RuntimeDomain(shard).collect_group(gid, members) is None:
                outcomes["group_dropped"] += 1
            n += 1

    async def update(step: int) -> dict:
        model.step = step
        started = time.monotonic()
        await asyncio.to_thread(device.update_weights_for_rollout, True, False, rollout_id=step)
        following = getattr(path, "_following", None)
        if following is not None:
            await asyncio.to_thread(following.result, args.join_timeout)
        return {"step": step, "seconds": round(time.monotonic() - started, 3)}

    report: dict = {"engines": labels, "phases": {}, "updates": []}
    load: list[asyncio.Task] = []
    try:
        report["updates"].append(await update(1))  # the first sync: Relax's own (the base), then step1
        mark("step1 published on e0, e1")
        load = [asyncio.create_task(rollouts(w)) for w in range(args.workers)]
        await asyncio.sleep(args.phase_s)
        report["e2_boot_wait_s"] = round(await until_healthy(urls[2], args.boot_timeout), 1)  # 0 once it is up

        phase[0] = "e2 joins"
        relax.worker_urls = list(urls)  # the router lists the third server; so does the coordinator
        device.init_process_group_for_rollout(topology(urls))
        started = time.monotonic()
        report["updates"].append(await update(2))  # the trainer adds e2 and loads the live versions there
        joined = await lorapub.follow_workers(join_timeout=args.join_timeout)
        report["join_s"] = round(time.monotonic() - started, 3)
        mark(f"e2 joined: {joined}")
        await asyncio.sleep(args.phase_s)

        phase[0] = "e0 drains"
        relax.worker_urls = list(urls[1:])
        device.init_process_group_for_rollout(topology(urls[1:]))
        started = time.monotonic()
        report["updates"].append(await update(3))
        leaving = await lorapub.follow_workers()
        await asyncio.gather(*lorapub._leaving.values())
        report["drain_s"] = round(time.monotonic() - started, 3)
        mark(f"e0 left: {leaving}")
        phase[0] = "e1, e2"
        await asyncio.sleep(args.phase_s)
    finally:
        stop.set()
        results = await asyncio.gather(*load, return_exceptions=True)
        report["rollout_errors"] = [repr(r) for r in results if isinstance(r, BaseException)]
        report["outcomes"] = dict(outcomes)
        report["phases"] = {k: dict(v) for k, v in by_phase.items()}
        report["publications"] = [{"version": o.version_id, "status": o.status, "error": repr(o.error) if o.error else None}
                                  for o in path.outcomes]
        report["shard_engines"] = sorted(labels.get(n, n) for n in lorapub.deployment.engines)
        trainer = path.publisher.deployment
        report["trainer_engines"] = sorted(labels.get(n, n) for n in trainer.engines) if trainer else []
        report["held_at_end"] = {labels[engine_name(u)]: sorted(h) for u, h in (await driver.held_adapters(urls)).items()}
        report["timeline"] = timeline
        failed = sum(c for code, c in outcomes.items() if code != "ok")
        report["verdict"] = {"requests": sum(outcomes.values()), "failed": failed,
                             "version_missing": outcomes.get("VERSION_MISSING", 0),
                             "e2_served": report["phases"].get("e0 drains", {}).get("e2", 0)
                             + report["phases"].get("e1, e2", {}).get("e2", 0),
                             "e0_removed": "e0" not in report["shard_engines"] and "e0" not in report["trainer_engines"]}
        await shard.shutdown()
        path.close()
        if procs:
            await driver.bench.stop_engines(procs)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-url", action="append", help="a live patched SGLang server; give three")
    parser.add_argument("--adapter", metavar="DIR", help="publish versions of this PEFT folder (it must fit the servers)")
    parser.add_argument("--capacity", type=int, default=3, help="lorapub's managed version slots")
    parser.add_argument("--max-lag", type=int, default=None)
    parser.add_argument("--transport", choices=("http", "ipc"), default="http")
    parser.add_argument("--wait", type=float, default=60.0, help="publish_wait")
    parser.add_argument("--workers", type=int, default=8, help="rollout loops running at once")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds of load in each phase")
    parser.add_argument("--join-timeout", type=float, default=120.0)
    parser.add_argument("--boot-timeout", type=float, default=420.0,
                        help="how long the third server may take to answer /health before it joins")
    parser.add_argument("--start-after", metavar="FILE",
                        help="build the versions, then wait for FILE to exist before the first request (live: "
                             "the recipe starts this beside the servers' boots and writes FILE once they are up)")
    parser.add_argument("--decode-delay", type=float, default=0.002, help="the doubles' decode time a token, s")
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--prefill-per-token", type=float, default=20e-6)
    parser.add_argument("--engine-model", choices=sorted(driver.bench.ENGINE_MODELS), default="patched",
                        help="how the doubles' loads meet decoding (bench/run.py's models)")
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report["verdict"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    v = report["verdict"]
    return 0 if v["failed"] == 0 and v["e0_removed"] and v["e2_served"] > 0 and not report["rollout_errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
