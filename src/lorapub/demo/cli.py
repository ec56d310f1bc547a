"""``lorapub demo``: the whole publish -> bind -> reclaim lifecycle, live, on a CPU.

By default it starts two in-process engines that speak SGLang's LoRA admin
contract (:class:`lorapub.testing.SGLangDouble`);
pass ``--engine-url`` twice to drive real, patched SGLang servers instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time


def _row(*cells, widths):
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))


async def demo(args) -> int:
    from lorapub import CapacityError, Deadlines, Deployment, LorapubError, NoPublishedVersion
    from lorapub.adapters.sglang_http import SGLangEngine
    from lorapub.demo.workload import WorkloadSpec, run_workload, until
    from lorapub.testing import lora_snapshot

    stash = args.stash_dir or tempfile.mkdtemp(prefix="lorapub-demo-")
    doubles = []
    if args.engine_url:
        urls = args.engine_url
    else:
        from lorapub.testing import SGLangDouble

        doubles = [await SGLangDouble(f"e{i}", decode_delay=0.003).start() for i in range(2)]
        urls = [d.url for d in doubles]
    engines = {f"e{i}": SGLangEngine(f"e{i}", url, stash) for i, url in enumerate(urls)}
    deadlines = Deadlines(begin=10, bucket=10, end=30, cleanup=30, commit=5, reclaim=60)
    dep = await Deployment(engines, epoch=args.epoch, deadlines=deadlines, bucket_cap_bytes=16 << 10).start()
    t0 = time.monotonic()
    say = lambda msg: print(f"[{time.monotonic() - t0:7.3f}s] {msg}", flush=True)  # noqa: E731
    occupancy: list[int] = []
    pubs: list[tuple[str, str, float, dict]] = []

    async def sample_slots():
        while True:
            occupancy.append((await dep.state()).slots_held)
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample_slots())
    try:
        say(f"engines: {', '.join(f'{n}={e.base_url}' for n, e in engines.items())}")
        probe = dep.session("before-any-version")
        try:
            await probe.generate({"input_ids": [1, 2, 3]})
        except NoPublishedVersion as e:
            say(f"generation before the first publication -> {e.code}")
        await probe.close()

        a = await dep.publish(lora_snapshot(101), "A")
        pubs.append(("A", "PUBLISHED", a.seconds, dict(a.phases)))
        say(f"published A as {a.lora_name} in {a.seconds * 1000:.1f} ms ({a.collectives} buckets)")

        done = 0

        def progress(rec):
            nonlocal done
            done += 1
            if done % 20 == 0:
                say(f"  … {done} requests done")

        spec = WorkloadSpec(sessions=args.sessions, arrival_interval=0.015, turns=(3, 6), seed=args.seed)
        workload = asyncio.create_task(run_workload(spec, dep.session, on_record=progress))
        await until(lambda: len(dep.sessions.sessions) >= 4, timeout=10)
        old_bound = [s for s in dep.sessions.sessions.values() if s.binding is not None]
        say(f"{len(old_bound)} sessions bound to A are mid-trajectory; publishing B now (no pause, no flush)")
        b = await dep.publish(lora_snapshot(202), "B")
        pubs.append(("B", "PUBLISHED", b.seconds, dict(b.phases)))
        say(f"published B as {b.lora_name} in {b.seconds * 1000:.1f} ms; new sessions bind B, old ones keep A")

        try:
            await dep.publish(lora_snapshot(303), "C")
        except CapacityError as e:
            pubs.append(("C", e.code, 0.0, {}))
            say(f"publishing C while A and B hold both slots -> {e.code} (nothing sent to any engine)")

        result = await workload
        await dep.settle()
        state = await dep.state()
        say(f"all sessions closed; A is {state.versions[a.version].state.value} on both engines")

        if doubles:
            doubles[1].inject("load", "error", count=1, status=500)
            say("injecting a load failure on e1 for the next publication")
            try:
                await dep.publish(lora_snapshot(303), "C")
            except LorapubError as e:
                state = await dep.state()
                c = [v for v in state.versions.values() if v.key.version_id == "C"][0]
                pubs.append(("C", c.state.value, 0.0, {}))
                say(f"C failed on e1 -> {e.code}; C is {c.state.value}, default still {state.default.version_id}")
        d = await dep.publish(lora_snapshot(404), "D")
        pubs.append(("D", "PUBLISHED", d.seconds, dict(d.phases)))
        say("capacity freed by A's reclaim and C's cleanup: D published; B retired and reclaimed when unused")
        await dep.settle()
        if doubles:
            late = dep.session("after-restart")
            await late.generate({"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 2}})
            doubles[1].restart()
            say("e1 crashed and restarted: it lost D; a session keeps generating on D (routed to e0)")
            await late.generate({"input_ids": [7, 8, 9, 10], "sampling_params": {"max_new_tokens": 2}})
            health = await dep.reconcile()
            holders = sorted(health.fleet.holders.get(d.version, ())) if health.fleet else []
            say(f"reconciler: D re-provisioned from lorapub's frozen copy on {', '.join(holders)}; "
                f"health: {health.describe()}")
            await late.close()
    finally:
        sampler.cancel()

    state = await dep.state()
    print("\nversions")
    bindings: dict = {}
    for record in state.sessions.values():  # CLOSED tombstones keep the version they bound
        if record.version is not None:
            bindings[record.version] = bindings.get(record.version, 0) + 1
    w = (10, 14, 16, 12, 14, 40)
    print(_row("version", "state", "sessions bound", "refs now", "digest", "lora_name", widths=w))
    for v in sorted(state.versions.values(), key=lambda v: v.key):
        print(_row(v.key.version_id, v.state.value, bindings.get(v.key, 0), v.session_refs, v.digest[:12], v.lora_name, widths=w))
    print("\npublications")
    for name, outcome, secs, phases in pubs:
        ph = ", ".join(f"{k} {v * 1000:.1f}ms" for k, v in phases.items())
        print(f"  {name}: {outcome:<14} {secs * 1000:7.1f} ms  {ph}")
    gaps = result.longest_gap()
    print("\nworkload")
    print(f"  sessions {spec.sessions}, requests {len(result.records)}, failures {result.failures}, "
          f"mixed-version sessions {result.mixed_version_sessions()}")
    print(f"  request latency p50 {result.latency(50) * 1000:.1f} ms, p95 {result.latency(95) * 1000:.1f} ms, "
          f"p99 {result.latency(99) * 1000:.1f} ms")
    print("  longest no-progress gap " + ", ".join(f"{e} {g * 1000:.1f} ms" for e, g in sorted(gaps.items())))
    print(f"  managed slots held: max {max(occupancy) if occupancy else 0} (capacity {state.capacity})")
    for dbl in doubles:
        print(f"  {dbl.name}: loads {sum(1 for e in dbl.events if e[0] == 'load')}, physical unloads {len(dbl.physical_unloads)}, "
              f"implicit reloads {sum(1 for e in dbl.events if e[0] == 'implicit_reload')}, pauses {sum(1 for e in dbl.events if e[0] == 'pause')}")
    await dep.close()  # first: its reconciler and reclaims still call the engines
    for e in engines.values():
        await e.close()
    for dbl in doubles:
        await dbl.stop()
    ok = result.failures == 0 and result.mixed_version_sessions() == 0 and max(occupancy or [0]) <= state.capacity
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lorapub")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the publish -> bind -> reclaim lifecycle on two engines")
    d.add_argument("--engine-url", action="append", help="a patched SGLang server (give two); default: embedded engines")
    d.add_argument("--stash-dir", help="attempt stash directory the engines can read")
    d.add_argument("--sessions", type=int, default=40)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--epoch", type=int, default=int(os.environ.get("LORAPUB_EPOCH", "1")))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(demo(args))
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
