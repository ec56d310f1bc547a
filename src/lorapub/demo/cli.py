"""``lorapub demo``: the whole publish -> bind -> reclaim lifecycle, live, on a CPU: two in-process
engines (:class:`lorapub.testing.SGLangDouble`, running lorapub's engine-side staging) by default,
or two patched SGLang servers (``--engine-url`` twice); the bytes travel ``--transport``'s way.
Its options, errors and clean-up are described in README.md, "Two commands".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Mapping, Sequence

from lorapub.cli.logs import add_logging_options, configure_logging
from lorapub.cli.progress import PublishProgressBar
from lorapub.cli.status import add_status_parser, run_status

if TYPE_CHECKING:  # for the annotations only: the functions below import what they use when they run
    from lorapub import Deployment
    from lorapub.adapters.sglang_wire import SGLangWireEngine
    from lorapub.core.identity import VersionKey
    from lorapub.demo.workload import RequestRecord, WorkloadResult
    from lorapub.ports import Transport
    from lorapub.testing import SGLangDouble

PROG = "lorapub"
#: Seconds an engine given by ``--engine-url`` has to answer lorapub's state route at start.
REACH_TIMEOUT = 10.0


class DemoError(Exception):
    """Why the demo cannot run (a bad argument, an engine it cannot reach or use): exit status 2."""


def _row(*cells: object, widths: Sequence[int]) -> str:
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))


def _version() -> str:
    """lorapub's version, from the package already imported (this module lives in it), else its metadata."""
    version = getattr(sys.modules.get("lorapub"), "__version__", None)
    if version is None:
        from importlib.metadata import version as metadata_version

        version = metadata_version("lorapub")
    return version


async def demo(args: argparse.Namespace) -> int:
    if args.stash_dir:
        return await _demo(args, args.stash_dir)
    with tempfile.TemporaryDirectory(prefix="lorapub-demo-") as stash:  # removed however the demo ends
        return await _demo(args, stash)


async def _reach(engines: Mapping[str, SGLangWireEngine]) -> None:
    """Each engine given by URL answers lorapub's state route, or the demo stops before it starts."""
    from lorapub import LorapubError

    for name, engine in engines.items():
        try:
            async with asyncio.timeout(REACH_TIMEOUT):
                await engine.state()
        except TimeoutError:
            raise DemoError(f"engine {name} at {engine.base_url} did not answer within {REACH_TIMEOUT:g} s") from None
        except LorapubError as e:
            raise DemoError(f"cannot use engine {name} at {engine.base_url}: {e}") from None


def _transport(args: argparse.Namespace, folder: str) -> Transport:
    """The deployment's transport, as ``--transport`` names it."""
    from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, SharedDir
    from lorapub.errors import InvalidInput

    if args.transport != "shared-dir" and args.shared_dir:
        raise DemoError("argument --shared-dir: goes with --transport shared-dir")
    if args.transport == "http":
        return HTTPBytes()
    if args.transport == "shm":
        try:
            return SameHostIPC()
        except InvalidInput as e:
            raise DemoError(f"argument --transport shm: {e.message}") from None
    if args.shared_dir:
        try:
            return SharedDir(args.shared_dir)
        except InvalidInput as e:
            raise DemoError(f"argument --shared-dir: {e.message}") from None
    shared = os.path.join(folder, "shared")  # the embedded engines read it too
    os.makedirs(shared, exist_ok=True)
    return SharedDir(shared)


async def _demo(args: argparse.Namespace, stash: str) -> int:
    from lorapub import Deadlines, Deployment
    from lorapub.errors import InvalidInput
    from lorapub.adapters.sglang_wire import SGLangWireEngine

    doubles: list[SGLangDouble] = []
    engines: dict[str, SGLangWireEngine] = {}
    dep: Deployment | None = None
    try:
        transport = _transport(args, stash)
        if args.engine_url:
            try:
                engines = {f"e{i}": SGLangWireEngine(f"e{i}", url) for i, url in enumerate(args.engine_url)}
            except InvalidInput as e:
                raise DemoError(f"argument --engine-url: {e.message}") from None
            await _reach(engines)
        else:
            from lorapub.testing import SGLangDouble

            for i in range(2):
                double = SGLangDouble(f"e{i}", decode_delay=0.003)
                double.stash_root = os.path.join(stash, f"engine-e{i}")  # its own disk: inside the demo's folder
                double.shm_dir = getattr(transport, "shm_dir", None)  # its LORAPUB_SHM_DIR
                doubles.append(await double.start())
            engines = {f"e{i}": SGLangWireEngine(f"e{i}", d.url) for i, d in enumerate(doubles)}
        deadlines = Deadlines(begin=10, bucket=10, end=30, cleanup=30, commit=5, reclaim=60)
        try:
            dep = await Deployment(engines, epoch=args.epoch, deadlines=deadlines, bucket_cap_bytes=16 << 10,
                                   transport=transport).start()
        except InvalidInput as e:
            raise DemoError(e.message) from None
        return await _lifecycle(args, dep, engines, doubles)
    finally:
        if dep is not None:
            await dep.close()  # first: its reconciler and reclaims still call the engines
        for engine in engines.values():
            await engine.close()
        for dbl in doubles:
            await dbl.stop()


async def _lifecycle(args: argparse.Namespace, dep: Deployment, engines: Mapping[str, SGLangWireEngine],
                     doubles: Sequence[SGLangDouble]) -> int:
    from lorapub import CapacityError, LorapubError, NoPublishedVersion
    from lorapub.demo.workload import WorkloadSpec, run_workload, until
    from lorapub.testing import lora_snapshot

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:7.3f}s] {msg}", flush=True)

    bar = PublishProgressBar()  # drawn for publications over 100 MB (the demo's are smaller)
    occupancy: list[int] = []
    pubs: list[tuple[str, str, float, dict[str, float]]] = []

    async def sample_slots() -> None:
        while True:
            occupancy.append((await dep.state()).slots_held)
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample_slots())
    workload: asyncio.Task[WorkloadResult] | None = None
    try:
        say(f"engines: {', '.join(f'{n}={e.base_url}' for n, e in engines.items())}; buckets travel {dep.transport!r}")
        probe = dep.session("before-any-version")
        try:
            await probe.generate({"input_ids": [1, 2, 3]})
        except NoPublishedVersion as e:
            say(f"generation before the first publication -> {e.code}")
        await probe.close()

        a = await dep.publish(lora_snapshot(101), "A", progress=bar)
        pubs.append(("A", "PUBLISHED", a.seconds, dict(a.phases)))
        say(f"published A as {a.lora_name} in {a.seconds * 1000:.1f} ms ({a.collectives} buckets)")

        done = 0

        def progress(rec: RequestRecord) -> None:
            nonlocal done
            done += 1
            if done % 20 == 0:
                say(f"  … {done} requests done")

        spec = WorkloadSpec(sessions=args.sessions, arrival_interval=0.015, turns=(3, 6), seed=args.seed)
        workload = asyncio.create_task(run_workload(spec, dep.session, on_record=progress))
        await until(lambda: len(dep.sessions.sessions) >= min(4, spec.sessions), timeout=10)
        old_bound = [s for s in dep.sessions.sessions.values() if s.binding is not None]
        say(f"{len(old_bound)} sessions bound to A are mid-trajectory; publishing B now (no pause, no flush)")
        b = await dep.publish(lora_snapshot(202), "B", progress=bar)
        pubs.append(("B", "PUBLISHED", b.seconds, dict(b.phases)))
        say(f"published B as {b.lora_name} in {b.seconds * 1000:.1f} ms; new sessions bind B, old ones keep A")

        try:
            await dep.publish(lora_snapshot(303), "C", progress=bar)
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
                await dep.publish(lora_snapshot(303), "C", progress=bar)
            except LorapubError as e:
                state = await dep.state()
                c = [v for v in state.versions.values() if v.key.version_id == "C"][0]
                pubs.append(("C", c.state.value, 0.0, {}))
                assert state.default is not None  # B, published above: a failed publication leaves it
                say(f"C failed on e1 -> {e.code}; C is {c.state.value}, default still {state.default.version_id}")
        d = await dep.publish(lora_snapshot(404), "D", progress=bar)
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
        # Nothing of the demo outlives it (an interrupted demo's sessions end here, before the engines close).
        tasks = [t for t in (sampler, workload) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    state = await dep.state()
    print("\nversions")
    bindings: dict[VersionKey, int] = {}
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
    for dbl in doubles:  # every life of the engine (a restart drops what it held, not these counts)
        count = {kind: sum(1 for e in dbl.events if e[0] == kind)
                 for kind in ("load", "unload", "implicit_reload", "pause", "restart")}
        print(f"  {dbl.name}: loads {count['load']}, physical unloads {count['unload']}, implicit reloads "
              f"{count['implicit_reload']}, pauses {count['pause']}, restarts {count['restart']}")
    ok = result.failures == 0 and result.mixed_version_sessions() == 0 and max(occupancy or [0]) <= state.capacity
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    add_logging_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run the publish -> bind -> reclaim lifecycle on two engines")
    d.add_argument("--engine-url", action="append", help="a patched SGLang server (give two); default: embedded engines")
    d.add_argument("--transport", choices=("http", "shm", "shared-dir"), default="http",
                   help="how the adapter's bytes reach the engines' own staging: HTTP bodies (default), shared-memory "
                        "files in /dev/shm (engines on this host), or files in --shared-dir")
    d.add_argument("--shared-dir", help="with --transport shared-dir: a folder the engines read as their LORAPUB_SHM_DIR "
                                        "(default: one inside the demo's folder, which the embedded engines read)")
    d.add_argument("--stash-dir", help="the demo's folder: the embedded engines' own disks and the shared folder "
                                       "(default: a temporary one, removed at exit)")
    d.add_argument("--sessions", type=_positive_int, default=40, help="rollout sessions (at least 1; default 40)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--epoch", type=int, default=os.environ.get("LORAPUB_EPOCH", "1"))
    add_status_parser(sub)
    return parser


def _error(command: str, message: str) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``lorapub demo``. A bad argument, or an engine the demo cannot reach or use, is one line on
    stderr and exit status 2, as argparse does; the folder the demo makes for itself is removed on
    every way out."""
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, json_lines=args.log_json)
    if args.command == "status":
        return run_status(args)
    if args.command != "demo":
        return 2
    if args.engine_url and len(args.engine_url) != 2:
        return _error("demo", f"argument --engine-url: give it twice (two patched SGLang servers), got {len(args.engine_url)}")
    try:
        return asyncio.run(_main_task(args))
    except DemoError as e:
        return _error("demo", str(e))
    except KeyboardInterrupt:
        print(f"{PROG} demo: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{PROG} demo: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


class _Terminated(Exception):
    """The demo was stopped by SIGTERM (and cleaned up)."""


async def _main_task(args: argparse.Namespace) -> int:
    """The demo; a SIGTERM cancels it as Ctrl-C does, so every way out cleans up."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None  # asyncio.run runs this coroutine as its task
    terminated = False

    def terminate() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, terminate)
    except (NotImplementedError, RuntimeError):  # no signal handlers here (not the main thread, or Windows)
        pass
    try:
        return await demo(args)
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated() from None
        raise
    finally:
        try:
            loop.remove_signal_handler(signal.SIGTERM)
        except (NotImplementedError, RuntimeError):
            pass


if __name__ == "__main__":
    raise SystemExit(main())
