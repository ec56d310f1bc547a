#!/usr/bin/env python3
"""lorapub against the old pause/flush/overwrite path and a no-publication control, side by side.

    python3 bench/run.py            # 3 interleaved rounds; engines in processes of their own, CPU only
    python3 bench/run.py --quick    # a smoke run (small, one round): its figures are not the documented ones
    python3 bench/run.py --plot docs/benchmarks-timeline.png   # also the timeline plot (needs the bench extra)
    python3 bench/run.py --engine-url U0 --engine-url U1 --stash-dir /shared   # real patched SGLang servers
                                                       # (bucket files in /shared: their LORAPUB_SHM_DIR)
    python3 bench/run.py --engine-url U0 --engine-url U1 --transport http --adapter DIR   # ... bytes over HTTP,
                                                       # publishing versions of the PEFT adapter in DIR

Part 1 runs one seeded agentic workload against two engines in three strategies — a control
that publishes nothing, the baseline (lorapub's switch off: pause, flush, overwrite one fixed
adapter name) and lorapub (immutable versions published beside the live ones) — repeated in
interleaved rounds, and prints every figure as median [min–max] over the rounds, relative to
the control; the method is printed with the figures. Part 2 measures the registry's decisions alone.
With ``--plot PATH`` it also draws one round's completions per engine over time, a panel per
strategy, with the publications marked (matplotlib: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin  # noqa: E402
from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine, SharedDir  # noqa: E402
from lorapub.core import registry as R  # noqa: E402
from lorapub.core.attempt import ReadyLocal  # noqa: E402
from lorapub.core.effects import SOURCE  # noqa: E402
from lorapub.core.identity import SessionKey, VersionKey  # noqa: E402
from lorapub.runtime.deployment import deploy  # noqa: E402
from lorapub.runtime.overwrite import FIXED_LORA_NAME  # noqa: E402
from lorapub.runtime.runner import Deadlines  # noqa: E402
from lorapub.errors import (  # noqa: E402
    CapacityError,
    LorapubError,
    OutcomeUnknown,
    PublicationBlocked,
    PublicationSuperseded,
)
from lorapub.testing.fixtures import lora_snapshot  # noqa: E402
from lorapub.local_registry import LocalRegistry  # noqa: E402
from lorapub.core.registry import BindFirst, CloseAndRelease  # noqa: E402
from lorapub.demo.workload import WorkloadResult, WorkloadSpec, percentile, run_workload  # noqa: E402
from lorapub.snapshot import Snapshot  # noqa: E402
from bench.decode_probe import DecodeProbe, probe_gap, probe_tokens  # noqa: E402
from bench.attribution import CAUSES, SLOW, attribute, read_iterations, summarize  # noqa: E402

ENGINE_SERVER = os.path.join(ROOT, "bench", "engine_server.py")
STRATEGIES = ("control", "baseline", "lorapub")
FULL = dict(rounds=3, sessions=150, publications=3, cadence=0.25, load_delay=0.25, arrival=0.01)
# sessions keep arriving after the publication lands, so a request runs on the new version
QUICK = dict(rounds=1, sessions=16, publications=1, cadence=0.1, load_delay=0.05, arrival=0.04)
#: Seconds after a publish call returned that its attribution still covers (the new version's first use).
FIRST_USE_S = 1.0
PLOT_BIN = 0.05  # seconds: the timeline counts completions per bin of this width
#: How an engine's adapter load meets its decoding (--engine-model).
ENGINE_MODELS = {
    "stock": {"flags": ["--blocking-load"],
              "text": "the load blocking that engine's batches (stock SGLang's scheduler loads between batches)"},
    # lorapub's patched server as measured live (docs/gpu-acceptance.md, "Decode gaps during a load"):
    # the install took 1-2 ms on the scheduler thread in runs 3 and 5 (1.5-7.7 ms in run 6) and the
    # first batch's slot fill 8-16 ms: the model takes the first, the best case.
    "patched": {"flags": ["--install-stop", "0.002", "--first-use-stop", "0.012"],
                "text": "the load running beside decoding, then every step stopped 2 ms to swap it in and 12 ms at the "
                        "adapter's first step (lorapub's patched SGLang, as measured live)"},
    "beside": {"flags": [], "text": "decoding going on beside a load, no stop at all"},
}


# -- part 1: online publication ----------------------------------------------------------
_ADAPTER_VERSIONS: dict[int, Snapshot] = {}


def version_snapshot(args, i: int) -> Snapshot:
    """Publication ``i``'s adapter (0: the one every run starts from). By default a small seeded
    PEFT adapter; with ``--adapter DIR``, the PEFT folder's tensors scaled by ``1 + i/64`` (its
    shapes and dtypes, a digest of its own per version), built once per process: the trainer
    builds snapshots in its own process, so no run pays for them."""
    if not args.adapter:
        return lora_snapshot(1000 + i)
    if 0 not in _ADAPTER_VERSIONS:
        from tests.gpu.fixtures import adapter_snapshot  # the PEFT folder as lorapub publishes it

        _ADAPTER_VERSIONS[0] = adapter_snapshot(args.adapter)
    if i not in _ADAPTER_VERSIONS:
        base = _ADAPTER_VERSIONS[0]
        _ADAPTER_VERSIONS[i] = Snapshot({n: (base.tensor(n) * (1 + i / 64)).to(base.tensor(n).dtype)
                                         for n in base.tensor_names}, base.serving_config)
    return _ADAPTER_VERSIONS[i]


#: The first-token request's prompt: 64 fixed token ids every model here has (uncached under a new name).
SENTINEL_PROMPT = [1 + (i * 37) % 997 for i in range(64)]


def lorapub_transport(args, stash: str):
    """How lorapub's bytes reach the engines' own staging: HTTP bodies (nothing shared between
    publisher and engines), or bucket files in a folder the engines read (their LORAPUB_SHM_DIR)."""
    if args.transport == "http":
        return HTTPBytes()
    return SharedDir(args.stash_dir or stash)


async def start_engines(args, shared: str) -> tuple[list[str], list[asyncio.subprocess.Process]]:
    """Two fresh engines, each in a process of its own, serving on loopback and reading bucket files
    from ``shared``."""
    flags = ["--shm-dir", shared, "--decode-delay", str(args.decode_delay), "--load-delay", str(args.load_delay),
             "--prefill-per-token", str(args.prefill_per_token),
             "--max-loras", str(args.capacity + 1)] + ENGINE_MODELS[args.engine_model]["flags"]
    procs = [await asyncio.create_subprocess_exec(sys.executable, ENGINE_SERVER, f"e{i}", *flags,
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
             for i in range(2)]
    urls = []
    try:
        for p in procs:
            line = (await asyncio.wait_for(p.stdout.readline(), 60)).decode()
            if not line.startswith("URL "):
                raise RuntimeError(f"an engine process did not start (exit {p.returncode}): {line!r}")
            urls.append(line.split()[1])
    except BaseException:
        await stop_engines(procs)
        raise
    return urls, procs


async def stop_engines(procs: list[asyncio.subprocess.Process]) -> None:
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()  # the engine serves until its stdin closes
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 10)
        except asyncio.TimeoutError:
            p.kill()
            await p.wait()


def longest_stall(result: WorkloadResult, window: tuple[float, float] | None = None) -> float:
    """The longest time an engine made no progress while a request on it was pending: between
    two completions on one engine, counted from the later of the first completion and the
    earliest start among the requests still pending then (idle time is no stall); the larger
    engine's. ``window`` keeps the stretches that overlap it.

    Unlike ``WorkloadResult.longest_gap`` it does not take the start of the request that
    completes next for the start of the wait: a request that arrives during a stall and
    completes first would cut the stall short."""
    by_engine: dict[str, list] = {}
    for r in result.ok:
        by_engine.setdefault(r.engine or "?", []).append(r)
    longest = 0.0
    for recs in by_engine.values():
        recs.sort(key=lambda r: r.ended)
        pending_since = [0.0] * len(recs)  # [i]: the earliest start among recs[i:]
        earliest = math.inf
        for i in range(len(recs) - 1, -1, -1):
            earliest = pending_since[i] = min(earliest, recs[i].started)
        for i in range(1, len(recs)):
            a, b = max(recs[i - 1].ended, pending_since[i]), recs[i].ended
            if window and (b < window[0] or a > window[1]):
                continue
            longest = max(longest, b - a)
    return longest


async def retried(call, tries: int = 3):
    """``call()`` again on an unknown outcome (a lost reply), as lorapub's reclaimer would."""
    for attempt in range(tries):
        try:
            return await call()
        except OutcomeUnknown:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.5)


async def one_run(strategy: str, args, spec: WorkloadSpec, epoch: int) -> dict:
    """One strategy on fresh engines (or, with --engine-url, the servers as the previous run
    left them: as it found them); the figures of that run (seconds, counts). Each run is a
    deployment epoch of its own, so no two runs publish the same adapter name."""
    enabled = strategy != "baseline"
    n_publications = 0 if strategy == "control" else args.publications
    stash = tempfile.mkdtemp(prefix="lorapub-bench-")
    procs: list[asyncio.subprocess.Process] = []
    if args.engine_url:
        urls = args.engine_url
    else:
        urls, procs = await start_engines(args, stash)
    engines: dict = {}
    dep = None
    try:
        if enabled:
            engines = {f"e{i}": SGLangWireEngine(f"e{i}", u) for i, u in enumerate(urls)}
        else:
            engines = {f"e{i}": SGLangOverwriteAdmin(f"e{i}", u) for i, u in enumerate(urls)}
        # the small built-in adapter in several buckets; a real-sized one in lorapub's default buckets
        buckets = {} if args.adapter else {"bucket_cap_bytes": 64 << 10}
        # the old path stages its folder where the servers read it: --stash-dir for real servers elsewhere
        fresh = dict(capacity=args.capacity, max_lag=args.max_lag, transport=lorapub_transport(args, stash),
                     **({"on_stale": args.on_stale} if args.on_stale else {})) if enabled else {}
        dep = await deploy(engines, epoch=epoch, enabled=enabled, deadlines=Deadlines(),
                           stash_dir=args.stash_dir or stash, **buckets, **fresh)
        bootstrap = await dep.publish(version_snapshot(args, 0), "v0")  # before any session exists
        loaded = [] if isinstance(bootstrap, float) else [bootstrap.lora_name]
        calls: list[dict] = []  # every publish call: when, how it ended, how long it waited
        sessions = []
        # the trainer builds snapshots in its own process; here they are ready before the run
        snapshots = {i: version_snapshot(args, i) for i in range(1, n_publications + 1)}
        serial = asyncio.Lock()  # the old path publishes one at a time (a call queues behind the last)
        sentinel_tasks: list[asyncio.Task] = []
        sentinels = {"sent": 0, "ok": 0, "failed": 0}

        async def first_token(call: dict, lora_name: str) -> None:
            """The new version's first token: one request of one new token under its exact name (the old
            path: the fixed name) sent to every engine the moment the call lands; the earliest answer, on
            this clock, is when the version first served a token (the workload's own requests do not
            say: SGLang returns a non-streaming request's tokens only when it ends). Counted apart from
            the workload's requests."""
            payload = {"input_ids": SENTINEL_PROMPT, "lora_path": lora_name,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}}

            async def one(engine) -> float | None:
                sentinels["sent"] += 1
                try:
                    await engine.generate(payload)
                except Exception:  # noqa: BLE001 - counted and shown, never silent
                    sentinels["failed"] += 1
                    return None
                sentinels["ok"] += 1
                return time.monotonic()

            answered = [t for t in await asyncio.gather(*(one(e) for e in engines.values())) if t is not None]
            if answered:
                call["first_token"] = min(answered) - call["called"]

        async def one_call(i: int) -> None:
            call = {"version": f"v{i}", "called": time.monotonic(), "outcome": None, "waited": 0.0}
            calls.append(call)
            try:
                if enabled:
                    report = await dep.publish(snapshots[i], f"v{i}", wait=args.wait)
                    call.update(waited=report.waited, phases=dict(report.phases),
                                engine_phases={e: dict(p) for e, p in report.engine_phases.items()})
                    loaded.append(report.lora_name)
                    served = report.lora_name
                else:
                    async with serial:
                        call["waited"] = time.monotonic() - call["called"]
                        paused = await dep.publish(snapshots[i], f"v{i}")
                    call["pause"] = paused
                    served = FIXED_LORA_NAME
                call["outcome"] = "done"
                call["ended"] = time.monotonic()
                sentinel_tasks.append(asyncio.create_task(first_token(call, served)))
            except PublicationSuperseded as e:
                call.update(outcome="superseded", by=str(e.details.get("by")), waited=e.details.get("waited", 0.0))
            except (CapacityError, PublicationBlocked) as e:  # the wait ran out: the version never landed
                call.update(outcome="deferred", error=e.code, waited=e.details.get("waited", 0.0))
            except LorapubError as e:
                call.update(outcome="failed", error=f"{e.code}: {e.message[:200]}")
            call.setdefault("ended", time.monotonic())

        async def cadence():
            # The trainer publishes every --cadence seconds whatever the last call is doing (a
            # training step does not wait for a publication): every call is its own task.
            tasks = []
            for i in range(1, n_publications + 1):
                await asyncio.sleep(args.cadence)
                tasks.append(asyncio.create_task(one_call(i)))
            await asyncio.gather(*tasks)
            await asyncio.gather(*sentinel_tasks)

        def session(name: str, group: str | None = None):
            sessions.append(dep.session(name, group=group))
            return sessions[-1]

        # The decode probe: one streamed request per engine for the whole run (bench/decode_probe.py).
        probe = DecodeProbe({f"e{i}": u for i, u in enumerate(urls)}, SENTINEL_PROMPT)
        await probe.start()
        # The measured window: no collection pause of this process lands in it.
        gc.collect()
        gc.freeze()
        gc.disable()
        publisher = asyncio.create_task(cadence())
        try:
            result = await run_workload(spec, session)
            await publisher
        finally:
            await probe.stop()
            if not publisher.done():  # the workload raised: no publication outlives its run
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
            for task in sentinel_tasks:
                task.cancel()
            await asyncio.gather(*sentinel_tasks, return_exceptions=True)
            gc.enable()
            gc.unfreeze()
        if enabled:
            await dep.settle()
        if args.engine_url:  # real servers serve every run: unload what this one loaded
            for e in engines.values():
                if enabled:
                    for name in loaded:  # reclaimed ones are gone already: an unload of them is a no-op
                        await retried(lambda: e.reclaim(name, f"bench-end-of-run-{epoch}"))
                elif FIXED_LORA_NAME in await e.loaded_adapters():
                    await e.unload_adapter(FIXED_LORA_NAME)
    finally:
        try:
            if dep is not None:
                await dep.close()  # first: its reconciler would still call the engines
            for e in engines.values():
                await e.close()
        finally:  # the engine processes go whatever closing raised
            await stop_engines(procs)
            shutil.rmtree(stash, ignore_errors=True)
    done = [c for c in calls if c["outcome"] == "done"]
    windows = [(c["called"] + c["waited"], c["ended"]) for c in done]  # the publication itself, after any wait
    stalls = [longest_stall(result, w) for w in windows]
    cached_after = [result.cached_ratio(a, b + 0.1) for a, b in windows]  # turns around each publication
    nan = float("nan")
    lags = result.token_lags() if enabled else [(0, r.tokens) for r in result.ok]  # the old path serves the latest
    first_sent = first_served(result, calls, enabled, sent=True)
    first_tokens = [c["first_token"] for c in done if "first_token" in c]
    # the probe's tokens in seconds since the workload started, those while it ran
    ticks = {e: [round(t - result.started, 5) for t in ts if result.started <= t <= result.ended]
             for e, ts in probe.ticks.items()}
    # the same windows in seconds since the workload started, as the probe's ticks and the call log are
    relative = [(a - result.started, b - result.started) for a, b in windows]
    decode_stalls = [probe_gap(ticks, w) for w in relative]
    # where each publication's slow decode steps went (bench/attribution.py): from the call (after any
    # wait) to FIRST_USE_S after it returned, the new version's first batches included
    logs = dict(zip(probe.ticks, args.engine_log or []))
    records = {e: [dict(r, t=r["t"] - result.started) for r in read_iterations(path, result.started, result.ended)]
               for e, path in logs.items()}  # in seconds since the workload started, as the ticks
    attributed = attribute(ticks, records, [(a, b + FIRST_USE_S) for a, b in relative]) if logs else []
    return {
        "publication_windows": relative,
        "attribution": attributed,
        "_records": records,  # read by derived() for the control's same stretches; not written out
        "gap": longest_stall(result),
        "stall_per_publication": statistics.fmean(stalls) if stalls else nan,
        "decode_gap": probe_gap(ticks),
        "decode_stall_per_publication": statistics.fmean(decode_stalls) if decode_stalls else nan,
        "probe": {"ticks": ticks, **probe.counts},
        "p50": result.latency(50), "p95": result.latency(95), "p99": result.latency(99),
        "failed": sum(1 for r in result.records if not r.ok and r.error != "BINDING_STALE"),
        "stale_cut": sum(1 for r in result.records if r.error == "BINDING_STALE"),
        "requests": len(result.records),
        "duration": result.ended - result.started,
        "resent": sum(getattr(s, "resumed", 0) for s in sessions),
        "mixed": result.mixed_version_sessions(),
        "mixed_groups": result.mixed_version_groups(),
        "rebound": result.rebound_sessions(),
        "cached_after": statistics.fmean([c for c in cached_after if c == c] or [nan]),
        "publication": statistics.fmean([c["ended"] - c["called"] - c["waited"] for c in done]) if done else nan,
        "call_to_commit": statistics.median([c["ended"] - c["called"] for c in done]) if done else nan,
        "waited": statistics.fmean([c["waited"] for c in calls]) if calls else nan,
        "to_first_served": statistics.median(first_served(result, calls, enabled)) if done else nan,
        "to_first_sent": statistics.median(first_sent) if done else nan,
        "to_first_sent_each": first_sent if done else [],
        "to_first_token": statistics.median(first_tokens or [nan]),
        "to_first_token_each": first_tokens,
        "first_token_requests": dict(sentinels),
        "phases": {k: statistics.fmean([c["phases"].get(k, 0.0) for c in done]) for k in ("begin", "transfer", "end", "commit")}
        if done and "phases" in done[0] else {},
        "engine_phases": [c.get("engine_phases", {}) for c in done],
        "calls": len(calls),
        "published": len(done),
        "superseded": sum(c["outcome"] == "superseded" for c in calls),
        "deferred": sum(c["outcome"] == "deferred" for c in calls),
        "failed_calls": sum(c["outcome"] == "failed" for c in calls),
        "lag_p50": weighted_percentile(lags, 50), "lag_p99": weighted_percentile(lags, 99),
        "lag_max": max((lag for lag, n in lags if n), default=nan),
        "call_log": [{k: (v - result.started if k in ("called", "ended") else v) for k, v in c.items()
                      if k not in ("phases", "engine_phases")} for c in calls],
        "timeline": timeline(result, calls),
    }


def weighted_percentile(pairs: list[tuple[int, int]], q: float) -> float:
    """The q-th percentile of values weighted by their counts (token-weighted lag: each request's
    lag counts once per token it generated)."""
    pairs = sorted((v, n) for v, n in pairs if n > 0 and v is not None)
    total = sum(n for _, n in pairs)
    if not total:
        return float("nan")
    seen, cut = 0, q / 100 * total
    for value, n in pairs:
        seen += n
        if seen >= cut:
            return float(value)
    return float(pairs[-1][0])


def first_served(result: WorkloadResult, calls: list[dict], enabled: bool, sent: bool = False) -> list[float]:
    """Per landed publication: from the publish call to the first request the new version served:
    its completion, or with ``sent`` its dispatch (its first token comes one prefill after the
    dispatch; the engine cannot say when: SGLang hands a non-streaming request's tokens to its
    tokenizer manager only when it finishes). The old path: the first request sent after the overwrite."""
    out = []
    for c in calls:
        if c["outcome"] != "done":
            continue
        if enabled:
            served = [r for r in result.ok if r.version_id == c["version"]]
        else:
            served = [r for r in result.ok if r.started >= c["ended"]]
        if served:
            out.append(min(r.started if sent else r.ended for r in served) - c["called"])
    return out or [float("nan")]


def timeline(result: WorkloadResult, calls: list[dict]) -> dict:
    """A run's completions and publish calls in seconds since its workload started: each
    engine's completion instants (sorted), and every publish call: [called, slot taken, ended]
    with its outcome (done, superseded, deferred, failed); for the old path its pause too."""
    t0 = result.started
    completions: dict[str, list[float]] = {}
    for r in result.ok:
        completions.setdefault(r.engine or "?", []).append(r.ended - t0)
    marks = []
    for c in calls:
        mark = {"called": c["called"] - t0, "slot": c["called"] + c["waited"] - t0, "ended": c["ended"] - t0,
                "outcome": c["outcome"], "version": c["version"]}
        if "pause" in c:
            mark["paused"] = [c["ended"] - c["pause"] - t0, c["ended"] - t0]
        marks.append(mark)
    return {"completions": {e: sorted(ts) for e, ts in sorted(completions.items())}, "calls": marks}


def representative_round(rounds: list[dict]) -> int:
    """The index of the median round by the share of the baseline's excess stall that lorapub
    removes (the lower middle one for an even count; rounds without the figure sort last)."""
    order = sorted(range(len(rounds)), key=lambda i: (math.isnan(rounds[i]["derived"]["removed"]),
                                                       rounds[i]["derived"]["removed"]))
    return order[(len(order) - 1) // 2]


def binned(run_timelines: dict[str, dict], bin_s: float = PLOT_BIN) -> dict:
    """Completions per engine per ``bin_s`` bin for each strategy's timeline, over one horizon
    (the last completion of any of them), so the panels share their bins."""
    last = max((ts[-1] for tl in run_timelines.values() for ts in tl["completions"].values() if ts), default=0.0)
    n_bins = max(1, math.floor(last / bin_s) + 1)
    counts = {}
    for strategy, tl in run_timelines.items():
        counts[strategy] = {}
        for engine, ts in tl["completions"].items():
            row = [0] * n_bins
            for t in ts:
                row[min(n_bins - 1, max(0, math.floor(t / bin_s)))] += 1
            counts[strategy][engine] = row
    return {"bin": bin_s, "bins": n_bins, "counts": counts}


STRATEGY_TITLES = {"control": "control (nothing published)", "baseline": "baseline (pause / flush / overwrite)",
                   "lorapub": "lorapub (versions beside the live ones)"}


def write_plot(path: str, plot: dict, title: str) -> None:
    """The timeline as a PNG: a panel per strategy (shared axes), a line per engine of its
    completions per bin, the publications shaded and the old path's pauses hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    bin_s, n_bins = plot["bin"], plot["bins"]
    edges = [i * bin_s for i in range(n_bins + 1)]
    strategies = list(plot["counts"])
    fig, axes = plt.subplots(len(strategies), 1, sharex=True, sharey=True, figsize=(10, 2.3 * len(strategies) + 1.6))
    colors = ("tab:blue", "tab:green", "tab:purple", "tab:brown")
    handles: dict = {}
    for ax, strategy in zip(axes, strategies):
        for (engine, row), color in zip(plot["counts"][strategy].items(), itertools.cycle(colors)):
            handles.setdefault(f"engine {engine}", ax.stairs(row, edges, color=color, linewidth=1.6))
        for call in plot["marks"][strategy]:
            if call["slot"] > call["called"]:
                handles.setdefault("publish call waiting for a slot",
                                   ax.axvspan(call["called"], call["slot"], facecolor="none", edgecolor="0.45",
                                              hatch="...", linewidth=0))
            if call["outcome"] == "done":
                handles.setdefault("publication (slot to commit)",
                                   ax.axvspan(call["slot"], call["ended"], color="0.55", alpha=0.25, linewidth=0))
            else:
                label = {"superseded": "call superseded by a newer one", "deferred": "call deferred (wait ran out)",
                         "failed": "call failed"}[call["outcome"]]
                handles.setdefault(label, ax.axvline(call["ended"], color={"superseded": "tab:orange"}.get(
                    call["outcome"], "tab:red"), linestyle="--", linewidth=1.2))
            handles.setdefault("publish call", ax.plot([call["called"]], [0], marker="v", color="k", markersize=6,
                                                       linestyle="none", clip_on=False)[0])
            if "paused" in call:
                handles.setdefault("generation paused (old path)",
                                   ax.axvspan(*call["paused"], facecolor="none", edgecolor="tab:red", hatch="///",
                                              linewidth=0.8))
        n = sum(sum(row) for row in plot["counts"][strategy].values())
        ax.set_title(f"{STRATEGY_TITLES.get(strategy, strategy)}: {n} requests completed", fontsize=10, loc="left")
        ax.set_ylabel(f"completed / {bin_s * 1e3:g} ms")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time since the workload started (s)")
    last_call = max((c["ended"] for calls in plot["marks"].values() for c in calls), default=0.0)
    axes[-1].set_xlim(0, max(n_bins * bin_s, last_call + bin_s))
    fig.suptitle(title, fontsize=11)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def derived(run: dict[str, dict]) -> dict:
    """One round's figures relative to its control run."""
    c, b, l = run["control"], run["baseline"], run["lorapub"]
    out = {}
    for key in ("gap", "p99"):
        out[f"baseline_excess_{key}"] = b[key] - c[key]
        out[f"lorapub_excess_{key}"] = l[key] - c[key]
    base = out["baseline_excess_gap"]
    out["removed"] = 1 - out["lorapub_excess_gap"] / base if base > 0 else float("nan")
    # the probe's decode stall per publication against the control's over the same stretches of its run
    # (the same seeded workload, so the same phase of it): one decode step's resolution, not one turn's
    for s, figures in (("baseline", b), ("lorapub", l)):
        windows = [tuple(w) for w in figures["publication_windows"]]
        control = [probe_gap(c["probe"]["ticks"], w) for w in windows]
        same = statistics.fmean(control) if control else float("nan")
        out[f"control_decode_stall_{s}_windows"] = same
        out[f"{s}_excess_decode_stall"] = figures["decode_stall_per_publication"] - same
        # decode tokens the probe got while the publications ran, against the control's over the same stretches
        got, control_got = probe_tokens(figures["probe"]["ticks"], windows), probe_tokens(c["probe"]["ticks"], windows)
        out[f"{s}_probe_token_loss"] = 1 - got / control_got if control_got else float("nan")
        # what the control's scheduler did over the same stretches (a server traced with "all" records it)
        if figures.get("attribution") and any(c.get("_records", {}).values()):
            out[f"control_attribution_{s}_windows"] = attribute(
                c["probe"]["ticks"], c["_records"], [(a, b + FIRST_USE_S) for a, b in windows])
        # what a trainer feels: the same workload's rollouts took this much longer than with nothing published
        out[f"{s}_duration_over_control"] = figures["duration"] / c["duration"] - 1 if c["duration"] else float("nan")
    return out


def spread(values: list[float]) -> dict:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict, unit: str) -> str:
    if math.isnan(s["median"]):
        return "—"
    scale, suffix, digits = {"ms": (1000, " ms", 1), "%": (100, " %", 0), "": (1, "", 3), "n": (1, "", 0)}[unit]
    if s["min"] == s["max"]:
        return f"{s['median'] * scale:.{digits}f}{suffix}"
    return f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f}]{suffix}"


ROWS = [  # (figure, key in a run's figures, unit, strategies it applies to)
    ("longest no-progress gap (whole run)", "gap", "ms", STRATEGIES),
    ("stall per publication (mean)", "stall_per_publication", "ms", STRATEGIES[1:]),
    ("longest decode gap, probe stream (whole run)", "decode_gap", "ms", STRATEGIES),
    ("decode stall per publication, probe stream (mean)", "decode_stall_per_publication", "ms", STRATEGIES[1:]),
    ("version lag p50 (token-weighted)", "lag_p50", "n", STRATEGIES),
    ("version lag p99 (token-weighted)", "lag_p99", "n", STRATEGIES),
    ("version lag max", "lag_max", "n", STRATEGIES),
    ("request latency p50", "p50", "ms", STRATEGIES),
    ("request latency p95", "p95", "ms", STRATEGIES),
    ("request latency p99", "p99", "ms", STRATEGIES),
    ("requests done", "requests", "n", STRATEGIES),
    ("workload duration", "duration", "ms", STRATEGIES),
    ("requests failed", "failed", "n", STRATEGIES),
    ("sessions ended by BINDING_STALE (max_lag)", "stale_cut", "n", STRATEGIES),
    ("sessions rebound on purpose (on_stale=rebind)", "rebound", "n", STRATEGIES),
    ("requests aborted and resent", "resent", "n", STRATEGIES),
    ("mixed-version sessions (beyond rebinds)", "mixed", "n", STRATEGIES),
    ("groups spanning two versions", "mixed_groups", "n", STRATEGIES),
    ("cached-token ratio around a publication", "cached_after", "", STRATEGIES[1:]),
    ("publish calls made", "calls", "n", STRATEGIES),
    ("  done (the version landed)", "published", "n", STRATEGIES),
    ("  superseded by a newer call", "superseded", "n", STRATEGIES),
    ("  deferred (its wait ran out)", "deferred", "n", STRATEGIES),
    ("  failed", "failed_calls", "n", STRATEGIES),
    ("waited for a slot, per call (mean)", "waited", "ms", STRATEGIES[1:]),
    ("publication latency (slot to commit)", "publication", "ms", STRATEGIES[1:]),
    ("publish call to commit (median)", "call_to_commit", "ms", STRATEGIES[1:]),
    ("publish call to first request sent on it", "to_first_sent", "ms", STRATEGIES[1:]),
    ("publish call to its first token (one 1-token request per engine)", "to_first_token", "ms", STRATEGIES[1:]),
    ("publish call to first request on it completed", "to_first_served", "ms", STRATEGIES[1:]),
]


def method(args, spec: WorkloadSpec) -> str:
    if args.engine_url:
        engines = (f"the servers at {', '.join(args.engine_url)} (the same servers in every run); lorapub's bytes "
                   + ("over HTTP into the engine's own staging" if args.transport == "http"
                      else "as bucket files in a folder the engines read, into their own staging"))
    else:
        engines = (f"two SGLang contract doubles, each in a process of its own on loopback, fresh for every run: "
                   f"decode {args.decode_delay * 1e3:g} ms a token, prefill {args.prefill_per_token * 1e6:g} µs an "
                   f"uncached prompt token, adapter load {args.load_delay * 1e3:g} ms, "
                   + f"{ENGINE_MODELS[args.engine_model]['text']} (--engine-model {args.engine_model})")
    return "\n".join([
        "method:",
        f"  engines: {engines}; the workload, the publisher and lorapub run in this process.",
        f"  workload: {spec.sessions} sessions arriving every {spec.arrival_interval * 1e3:g} ms, {spec.turns[0]}-{spec.turns[1]} "
        f"tool turns, {spec.max_new_tokens} new tokens a turn, {spec.tool_latency * 1e3:g} ms tool time, seed {spec.seed}"
        + (f", groups of {spec.group_size} sessions binding as one" if spec.group_size > 1 else "") + "; "
        f"{args.publications} publish calls of {adapter_text(args)}, one every {args.cadence:g} s whatever the last is doing.",
        f"  lorapub: capacity {args.capacity}, max_lag {args.max_lag}"
        + ((f" (on_stale={args.on_stale})" if args.on_stale else " (on_stale: lorapub's default)")
           if args.max_lag is not None else " (a session keeps its version for life)")
        + f", each call waits up to {args.wait:g} s for a slot (a newer call supersedes a waiting one).",
        "  every publish call is counted: done, superseded, deferred (its wait ran out) or failed; version lag is",
        "    token-weighted (each request's commits behind the default at dispatch, once per token it generated;",
        "    0 on the old path, which serves the latest after every overwrite).",
        "  control: lorapub on, nothing published. baseline: lorapub's switch off (pause with abort, flush, unload +",
        "    load of the fixed name on every engine at once, continue; the agentic layer resends aborted requests).",
        "    lorapub: a new immutable version loaded, pinned, beside the live ones; sessions keep their version.",
        f"  {args.rounds} round(s), each control -> baseline -> lorapub; a figure is the median [min-max] over the rounds.",
        "  garbage collector: collected, frozen and off in this process during each measured run (workload and",
        "    publications)" + ("." if args.engine_url else "; likewise in each engine process once it serves."),
        "  no-progress gap: per engine, the longest time between two completions while a request was pending (from",
        "    the earliest start among the requests not yet completed when that is later); a run's figure is its",
        "    larger engine's. A stall per publication: the longest such gap overlapping it, averaged over them.",
        "  decode probe: one streamed request per engine for the whole run (the base model, the fixed 64-token",
        "    prompt, 4096 tokens, end token ignored; sent again at once if it ends), counted apart (sent, ended,",
        "    cut at the run's end, failed). Its longest gap between two tokens is one engine's longest decode",
        "    step: a decode stall per publication is the longest such gap overlapping it, and the control's,",
        "    over the same stretches of its run, is what the excess decode stall is measured from. Probe decode",
        "    tokens lost while publishing: 1 - the probe's tokens inside the publications' windows / the control's",
        "    over the same stretches (a sum over every step, so one long prefill of the control's hides nothing).",
        "  excess = figure - the same round's control figure; removed = 1 - lorapub's excess gap / the baseline's.",
        "  workload duration over control: the same seeded workload's duration / the control's - 1 (the rollout",
        "    throughput a trainer feels; rebound sessions prefill their context again).",
        "  publish call to the first request on the new version: sent, and completed (its first token comes",
        "    between the two, one prefill after it was sent); the old path: the first request after the overwrite.",
        "  publish call to its first token: the moment a call lands, one request of one new token (a fixed",
        "    64-token prompt) under the new version's exact name (the old path: the fixed name) goes to every",
        "    engine; the earliest answer. Counted apart from the workload (first-token requests: sent, ok, failed).",
    ] + ([
        "  where the time went (--engine-log; bench/attribution.py): per publication (from the call, after any",
        f"    wait, to {FIRST_USE_S:g} s after it returned) and engine, the probe's slow steps (longer than "
        f"{SLOW:g} x the engine's",
        "    median step, and 5 ms over it), joined on the host's monotonic clock to the server's logged scheduler",
        "    iterations overlapping them, and what those spent (ms): prefill and decode launches, the install,",
        "    slot fills, gc, the scheduler thread waiting (wall - its CPU: the interpreter, the GPU, sockets),",
        "    and the preparing thread's CPU beside it. Causes overlap; they are named, not added up.",
    ] if args.engine_log else []))


def adapter_text(args) -> str:
    if not args.adapter:
        return "a small seeded adapter (2 layers, q/v, r=8)"
    manifest = version_snapshot(args, 0).manifest
    return (f"the adapter in {args.adapter} ({len(manifest.tensors)} tensors, {manifest.total_bytes / 1e6:.0f} MB), "
            "rescaled per version")


async def part1(args, on_round=None) -> tuple[dict, dict]:
    spec = WorkloadSpec(sessions=args.sessions, arrival_interval=args.arrival, turns=tuple(args.turns), seed=args.seed,
                        tool_latency=args.tool_latency, max_new_tokens=args.max_new_tokens, group_size=args.group_size)
    load = os.getloadavg()[0]
    print(f"== online publication: {args.rounds} round(s) of control, baseline, lorapub; "
          f"load average {load:.2f} on {os.cpu_count()} CPUs ==")
    print(method(args, spec))
    rounds = []
    # Real servers outlive this process and keep every cleaned attempt's tombstone (a late begin of
    # it is refused): each invocation's runs take epochs no earlier invocation used on them.
    first_epoch = int(time.time() * 1000) if args.engine_url else 1
    for r in range(args.rounds):
        run = {}
        for i, strategy in enumerate(STRATEGIES):
            run[strategy] = await one_run(strategy, args, spec, epoch=first_epoch + r * len(STRATEGIES) + i)
        run["derived"] = derived(run)
        rounds.append(run)
        d = run["derived"]
        print(f"round {r + 1}: longest gap control {run['control']['gap'] * 1e3:.1f} ms, baseline "
              f"{run['baseline']['gap'] * 1e3:.1f} ms, lorapub {run['lorapub']['gap'] * 1e3:.1f} ms; "
              f"excess baseline {d['baseline_excess_gap'] * 1e3:.1f} ms, lorapub {d['lorapub_excess_gap'] * 1e3:.1f} ms; "
              f"removed {d['removed'] * 100:.0f} %", flush=True)
        firsts = [x for x in run["lorapub"].get("to_first_token_each", []) if x == x]
        print(f"round {r + 1}: excess decode stall per publication (probe) baseline "
              f"{d['baseline_excess_decode_stall'] * 1e3:.1f} ms, lorapub {d['lorapub_excess_decode_stall'] * 1e3:.1f} ms; "
              f"probe tokens lost while publishing baseline {d['baseline_probe_token_loss'] * 100:.0f} %, "
              f"lorapub {d['lorapub_probe_token_loss'] * 100:.0f} %; "
              f"lorapub publish call to first token p50 "
              + (f"{statistics.median(firsts) * 1e3:.0f} ms (n {len(firsts)})" if firsts else "none"), flush=True)
        for strategy in STRATEGIES[1:]:
            for line in summarize(f"round {r + 1} {strategy}", run[strategy].get("attribution") or []):
                print(line, flush=True)
            same = run["derived"].pop(f"control_attribution_{strategy}_windows", None)
            if same:
                run[strategy]["control_attribution"] = same
                for line in summarize(f"round {r + 1} control over {strategy}'s stretches", same):
                    print(line, flush=True)
        for strategy in STRATEGIES:
            run[strategy].pop("_records", None)  # large, and in the servers' logs already
        if on_round:  # what is measured is kept even if a time limit cuts the later rounds
            on_round(rounds)

    summary = {s: {key: spread([run[s][key] for run in rounds]) for _, key, _, _ in ROWS} for s in STRATEGIES}
    summary["derived"] = {key: spread([run["derived"][key] for run in rounds]) for key in rounds[0]["derived"]}
    dv = summary["derived"]
    widths = (27, 29, 29)  # a cell never runs into its neighbour: "[min–max]" of two 5-digit figures fits
    print(f"\n{'figure':42}" + "".join(f" {c:>{w}}" for c, w in zip(("control", "baseline", "lorapub"), widths)))
    for name, key, unit, applies in ROWS:
        cells = [fmt(summary[s][key], unit) if s in applies else "—" for s in STRATEGIES]
        print(f"{name:42}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    for name, key, unit in (("excess no-progress gap over control", "gap", "ms"),
                            ("excess request latency p99 over control", "p99", "ms"),
                            ("excess decode stall per publication (probe; control: same stretches)", "decode_stall", "ms")):
        cells = ["—", fmt(dv[f"baseline_excess_{key}"], unit), fmt(dv[f"lorapub_excess_{key}"], unit)]
        print(f"{name:42}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    cells = ["—", fmt(dv["baseline_probe_token_loss"], "%"), fmt(dv["lorapub_probe_token_loss"], "%")]
    print(f"{'probe decode tokens lost while publishing':42}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    cells = ["—", fmt(dv["baseline_duration_over_control"], "%"), fmt(dv["lorapub_duration_over_control"], "%")]
    print(f"{'workload duration over control (rollouts)':42}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    per_round = ", ".join(f"{run['derived']['removed'] * 100:.0f} %" for run in rounds)
    print(f"\nshare of the baseline's excess stall that lorapub removes: {fmt(dv['removed'], '%')} (per round: {per_round})")
    phases = [run["lorapub"]["phases"] for run in rounds if run["lorapub"]["phases"]]
    if phases:
        print("lorapub phases (median of the rounds' means): " + ", ".join(
            f"{k} {statistics.median(p[k] for p in phases) * 1000:.1f} ms" for k in phases[0]))
    per_engine: dict = {}
    for run in rounds:
        for call in run["lorapub"]["engine_phases"]:
            for engine, ph in call.items():
                for k, v in ph.items():
                    per_engine.setdefault(engine, {}).setdefault(k, []).append(v)
    for engine, ph in sorted(per_engine.items()):
        print(f"  {engine}: " + ", ".join(f"{k} {statistics.median(v) * 1000:.1f} ms (median of {len(v)})"
                                          for k, v in sorted(ph.items())))
    for strategy in STRATEGIES[1:]:  # where each publication's slow steps went, against the control's same stretches
        for label, key in ((strategy, "attribution"), (f"control over {strategy}'s stretches", "control_attribution")):
            cells = [a for run in rounds for pub in run[strategy].get(key) or [] for a in pub.values()]
            if cells:
                print(f"where the time went, {label} (median of {len(cells)} publication-engines): " + ", ".join(
                    f"{text} {statistics.median(c[k] for c in cells):.1f} ms" for k, text in
                    (("excess_ms", "slow steps over the median step"), *CAUSES)))
    for key, what in (("to_first_sent_each", "the first request sent on the new version"),
                      ("to_first_token_each", "the new version's first token")):
        pooled = sorted(x for run in rounds for x in run["lorapub"].get(key, []) if x == x)
        if pooled:  # every landed publication of every round
            print(f"lorapub publish call to {what}, every landed publication of every round: p50 "
                  f"{percentile(pooled, 50) * 1000:.0f} ms, max {pooled[-1] * 1000:.0f} ms (n {len(pooled)}): "
                  + ", ".join(f"{x * 1000:.0f}" for x in pooled))
    for strategy in STRATEGIES:
        counts = [run[strategy]["probe"] for run in rounds]
        print(f"decode probe streams ({strategy}, every round): " + ", ".join(
            f"{k} {sum(c.get(k, 0) for c in counts)}" for k in ("sent", "ended", "cut", "failed")))
    for strategy in STRATEGIES[1:]:
        counts = [run[strategy].get("first_token_requests", {}) for run in rounds]
        print(f"first-token requests ({strategy}, every round): " + ", ".join(
            f"{k} {sum(c.get(k, 0) for c in counts)}" for k in ("sent", "ok", "failed")))
    for run_i, run in enumerate(rounds):
        print(f"round {run_i + 1} publish calls: " + "; ".join(
            f"{c['version']} {c['outcome']}" + (f" after {c['waited']:.2f}s" if c.get("waited") else "")
            + (f" (by {c['by']})" if c.get("by") else "") + (f" ({c['error']})" if c.get("error") else "")
            for c in run["lorapub"]["call_log"]))
    print(f"load average after part 1: {os.getloadavg()[0]:.2f}")
    pooled_first = sorted(x for run in rounds for x in run["lorapub"].get("to_first_token_each", []) if x == x)
    bars = {
        "0 request failures with lorapub, every round": all(run["lorapub"]["failed"] == 0 for run in rounds),
        "0 requests aborted by a publication with lorapub, every round": all(run["lorapub"]["resent"] == 0 for run in rounds),
        "0 mixed-version sessions with lorapub, every round": all(run["lorapub"]["mixed"] == 0 for run in rounds),
        "0 groups spanning two versions with lorapub, every round": all(run["lorapub"]["mixed_groups"] == 0 for run in rounds),
        "every lorapub publish call landed or was superseded by one that landed, every round": all(
            run["lorapub"]["deferred"] == 0 and run["lorapub"]["failed_calls"] == 0 for run in rounds),
        "lorapub's excess stall below the baseline's (median of the rounds)": dv["removed"]["median"] > 0,
        # the serving path's own targets (docs/benchmarks.md, "Bars"): not relative to the baseline
        f"lorapub's excess decode stall per publication <= {args.bar_decode_stall_ms:g} ms (probe, median of the rounds)":
            dv["lorapub_excess_decode_stall"]["median"] <= args.bar_decode_stall_ms / 1e3,
        f"probe tokens lost while lorapub publishes <= {args.bar_token_loss:g} % (median of the rounds)":
            dv["lorapub_probe_token_loss"]["median"] <= args.bar_token_loss / 100,
        f"lorapub publish call to its first token p50 <= {args.bar_first_token_s:g} s (every landed publication)":
            bool(pooled_first) and percentile(pooled_first, 50) <= args.bar_first_token_s,
    }
    if args.on_stale != "error":  # cutting sessions is what on_stale="error" asks for; nothing else may cut one
        bars["0 sessions cut by BINDING_STALE with lorapub, every round (on_stale is not 'error')"] = all(
            run["lorapub"]["stale_cut"] == 0 for run in rounds)
    shown = representative_round(rounds)
    plot = binned({s: rounds[shown][s]["timeline"] for s in STRATEGIES})
    plot["round"] = shown + 1
    plot["marks"] = {s: rounds[shown][s]["timeline"]["calls"] for s in STRATEGIES}
    figures = {"load_average": [load, os.getloadavg()[0]], "rounds": rounds, "summary": summary, "timeline": plot}
    if args.plot:
        title = (f"Completed requests per engine, round {shown + 1} of {args.rounds} (the median by share removed): "
                 f"{spec.sessions} agentic sessions every {spec.arrival_interval * 1e3:g} ms, "
                 f"{spec.turns[0]}-{spec.turns[1]} tool turns, seed {spec.seed}; {args.publications} publication(s), "
                 + ("live SGLang servers" if args.engine_url else f"adapter load {args.load_delay * 1e3:g} ms"))
        write_plot(args.plot, plot, "\n".join(textwrap.wrap(title, 110)))
        print(f"timeline plot (round {shown + 1}): {args.plot}")
    return bars, figures


# -- part 2: control plane -------------------------------------------------------------
def publish_decisions(state, version: str, n_buckets: int):
    """All registry decisions of one publication over every engine; returns (state, count)."""
    from lorapub.testing.fixtures import fake_plan

    digest, plan = fake_plan(version, tensors=n_buckets, cap=64)
    key = VersionKey(state.epoch, version)
    out = R.reserve(state, R.Reserve(key, digest, plan))
    state, token, n = out.state, out.reply.token, 1
    for e, inc in state.engines.items():
        state = R.record_prepared(state, R.RecordPrepared(token, e, inc)).state
        n += 1
    for i in range(len(plan)):
        for p in (SOURCE, *state.engines):
            state = R.record_bucket_done(state, R.RecordBucketDone(token, p, i, state.engines.get(p))).state
            n += 1
    for e, inc in state.engines.items():
        state = R.record_ready(state, R.RecordReady(ReadyLocal(e, token, digest, inc))).state
        n += 1
    state = R.commit(state, R.Commit(key, token, state.default_revision)).state
    return state, n + 1


def part2() -> tuple[dict, dict]:
    print("\n== control plane (registry decisions alone, this machine) ==")
    figures: dict[str, dict] = {}
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
        figures[f"{n_engines} engines"] = {"decisions": decisions // reps, "per_decision": dt / decisions,
                                           "publication": dt / reps}

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
        figures[f"{n} sessions"] = {"bind_first_p50": percentile(binds, 50), "bind_first_p99": results[n],
                                    "close_p99": percentile(closes, 99), "transitions_per_s": rate}
        print(f"{n:9d}{percentile(binds, 50) * 1e6:13.1f} µs{percentile(binds, 99) * 1e6:9.1f} µs"
              f"{percentile(closes, 99) * 1e6:9.1f} µs{rate:16,.0f}")
    return {"registry decision p99 < 1 ms at 10,000 sessions": results[10000] < 1e-3}, figures


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: one small round, bars not judged")
    parser.add_argument("--engine-url", action="append", help="a real (patched) SGLang server; give two")
    parser.add_argument("--stash-dir", help="with real servers: a folder they can read (lorapub's folder transport "
                                            "writes bucket files there, which they read as their LORAPUB_SHM_DIR, and "
                                            "the baseline's old path its adapter; default a local temp folder)")
    parser.add_argument("--engine-log", action="append",
                        help="with --engine-url, in the same order: that server's log; a server started with "
                             "LORAPUB_SGLANG_PREPARE_TRACE=1 logs its scheduler iterations around each load, and each "
                             "publication's slow decode-probe steps are attributed to what those iterations spent")
    parser.add_argument("--transport", choices=("folder", "http"), default="folder",
                        help="how lorapub's bytes reach the engines' own staging: bucket files in a folder they read "
                             "(SharedDir), or HTTP bodies")
    parser.add_argument("--adapter", metavar="DIR",
                        help="publish versions of this PEFT folder (for real servers: it must fit their model)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="new tokens a turn")
    parser.add_argument("--tool-latency", type=float, default=0.005, help="tool time between turns (s)")
    parser.add_argument("--rounds", type=int, help=f"control/baseline/lorapub rounds (default {FULL['rounds']})")
    parser.add_argument("--sessions", type=int, help=f"default {FULL['sessions']}")
    parser.add_argument("--arrival", type=float, help=f"seconds between session arrivals (default {FULL['arrival']})")
    parser.add_argument("--publications", type=int, help=f"default {FULL['publications']}")
    parser.add_argument("--cadence", type=float, help=f"seconds between publications (default {FULL['cadence']})")
    parser.add_argument("--decode-delay", type=float, default=0.002)
    parser.add_argument("--load-delay", type=float,
                        help=f"simulated adapter load + GPU prep in seconds (default {FULL['load_delay']})")
    parser.add_argument("--engine-model", choices=sorted(ENGINE_MODELS),
                        help="how the doubles' adapter load meets decoding: stock SGLang (blocking, the default), "
                             "lorapub's patched SGLang (beside, with the short stops measured live), or no stop at all")
    parser.add_argument("--no-blocking-load", dest="engine_model", action="store_const", const="beside",
                        help="the same as --engine-model beside")
    parser.add_argument("--prefill-per-token", type=float, default=20e-6, help="simulated prefill cost of an uncached token (s)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--turns", type=int, nargs=2, default=[3, 6], metavar=("MIN", "MAX"), help="tool turns a session")
    parser.add_argument("--group-size", type=int, default=1, help="sessions per group binding as one (GRPO)")
    parser.add_argument("--capacity", type=int, default=2, help="lorapub's managed version slots")
    parser.add_argument("--max-lag", type=int, default=None, help="lorapub's bounded staleness (default: none)")
    parser.add_argument("--on-stale", choices=("error", "rebind"),
                        help="what a session past max_lag gets (default: lorapub's own default)")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds a lorapub publish call waits for a slot")
    parser.add_argument("--bar-decode-stall-ms", type=float, default=5.0,
                        help="bar: lorapub's excess decode stall per publication (probe), at most this (ms)")
    parser.add_argument("--bar-token-loss", type=float, default=2.0,
                        help="bar: probe decode tokens lost while lorapub publishes, at most this (percent)")
    parser.add_argument("--bar-first-token-s", type=float, default=0.5,
                        help="bar: lorapub's publish call to its first token, p50 at most this (s)")
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument("--skip-control-plane", action="store_true", help="Part 1 only")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw Part 1's timeline (completions per engine over time, one round) to this PNG; "
                             "needs matplotlib (pip install -e '.[bench]')")
    args = parser.parse_args()
    if args.engine_url and args.engine_model is not None:
        parser.error("--engine-model shapes the doubles; real servers (--engine-url) behave as they do")
    args.engine_model = args.engine_model or "stock"
    if args.engine_log and len(args.engine_log) != len(args.engine_url or []):
        parser.error("--engine-log goes with --engine-url, one log per server, in the same order")
    if args.plot and args.skip_online:
        parser.error("--plot draws Part 1: it cannot go with --skip-online")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)")
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    def write_json(figures: dict, control_figures: dict, bars: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "online": figures, "control_plane": control_figures, "bars": bars},
                          f, indent=1)

    def keep_rounds(rounds: list) -> None:
        write_json({"rounds": rounds, "partial": f"{len(rounds)} of {args.rounds} round(s)"}, {}, {})

    bars, figures = ({}, {}) if args.skip_online else await part1(args, keep_rounds)
    write_json(figures, {}, dict(bars))  # Part 1's figures are kept even if Part 2 never ends (a run's time limit)
    control_bars, control_figures = ({}, {}) if args.skip_control_plane else part2()
    bars.update(control_bars)
    print("\n== performance bars ==" + (" (not judged in --quick)" if args.quick else ""))
    for name, ok in bars.items():
        print(f"  [{'pass' if ok else 'FAIL'}] {name}")
    write_json(figures, control_figures, bars)
    return 0 if args.quick or all(bars.values()) else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
