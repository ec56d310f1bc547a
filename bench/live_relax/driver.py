#!/usr/bin/env python3
"""Relax-shaped rollouts with lorapub on, off (Relax's pause/flush/overwrite), and a no-publication control.

    python3 bench/live_relax/driver.py --quick          # a smoke run on two SGLang doubles (CPU)
    python3 bench/live_relax/driver.py                  # 3 interleaved rounds on two SGLang doubles (CPU)
    python3 bench/live_relax/driver.py --engine-url U0 --engine-url U1 --adapter DIR --capacity 3
                                                        # two live patched SGLang servers (run.sh beside it)

The rollouts go through lorapub's Relax integration (``lorapub.integrations.relax``) as Relax's own
code calls it, by way of the stand-ins of ``tests/integrations/relax_harness.py``: an
``AgenticSessionShard`` (``open_group`` at ``start_group``, the wrapped backend's ``generate`` per
turn with Relax's keywords, ``release`` at each session's finish, ``release_group`` when the completed group
is dropped) and a ``DeviceDirectBackend`` whose ``update_weights_for_rollout`` is lorapub's weight
path (``install_weight_path``: each adapter an immutable version, no pause, no flush) or, with
lorapub off, Relax's own (pause, flush, overwrite of ``relax_policy_lora``, continue). Each round
runs a control (lorapub on, nothing published while the rollouts run), lorapub off and lorapub on;
the method is printed with the figures. Without ``--engine-url`` two SGLang contract doubles
(``bench/engine_server.py``) are started for every run, each in a process of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from lorapub import Deadlines, Snapshot  # noqa: E402
from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin  # noqa: E402
from lorapub.adapters.sglang_wire import SGLangWireEngine  # noqa: E402
from lorapub.demo.workload import RequestRecord, WorkloadResult  # noqa: E402
from lorapub.errors import OutcomeUnknown  # noqa: E402
from lorapub.integrations.relax import (
    DEFAULT_NAME_PREFIX,  # noqa: E402
    CONFIG_FLAG,
    ENABLE_FLAG,
    RELAX_ADAPTER_NAME,
    LorapubPublisher,
    add_arguments,
    engine_name,
    validate_args,
)
from lorapub.local_registry import LocalRegistry  # noqa: E402
from lorapub.testing.fixtures import lora_snapshot  # noqa: E402

from tests.integrations import relax_harness as harness  # noqa: E402


def _load_bench_run():
    """bench/run.py as a module: its engine models and its figure formatting are shared."""
    spec = importlib.util.spec_from_file_location("lorapub_bench_run", os.path.join(ROOT, "bench", "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench_run()
ENGINE_SERVER = os.path.join(ROOT, "bench", "engine_server.py")
STRATEGIES = ("control", "overwrite", "lorapub")
TITLES = {"control": "control", "overwrite": "lorapub off", "lorapub": "lorapub on"}
FULL = dict(rounds=3, groups=16, group_size=4, turns=[6, 10], max_new_tokens=32, tool_latency=0.5, arrival=0.25,
            cadence=2.0, load_delay=0.25)
QUICK = dict(rounds=1, groups=6, group_size=2, turns=[2, 4], max_new_tokens=8, tool_latency=0.05, arrival=0.05,
             cadence=0.2, load_delay=0.02)
LIFECYCLE = ("pause", "flush", "continue")
_BATCH_EVENT = {"/pause_generation": "pause", "/flush_cache": "flush", "/continue_generation": "continue"}


# -- versions --------------------------------------------------------------------------------
_VERSIONS: dict[int, Snapshot] = {}


def version_snapshot(args, step: int) -> Snapshot:
    """The trainer's adapter at ``step`` (1: the first sync's). Without ``--adapter`` the seeded
    ``lorapub.testing.lora_snapshot(1000 + step)``; with it, the PEFT folder's tensors scaled by
    ``1 + step/64`` (as bench/run.py's ``version_snapshot`` does), built once per process."""
    if step not in _VERSIONS:
        if not args.adapter:
            _VERSIONS[step] = lora_snapshot(1000 + step)
        else:
            if 0 not in _VERSIONS:
                from tests.gpu.fixtures import adapter_snapshot  # the PEFT folder as lorapub publishes it

                _VERSIONS[0] = adapter_snapshot(args.adapter)
            base = _VERSIONS[0]
            _VERSIONS[step] = Snapshot({n: (base.tensor(n) * (1 + step / 64)).to(base.tensor(n).dtype)
                                        for n in base.tensor_names}, base.serving_config)
    return _VERSIONS[step]


class AdapterSync(harness.LoraAdapterSync):
    """The stand-in's ``LoraAdapterSync`` for any adapter: the serving config is the adapter's own (a
    real PEFT folder's target modules and rank), tensors are taken as they are (torch or numpy), and
    an adapter is unchanged when every tensor is the very one exported last time."""

    def __init__(self, args, model, serving_config):
        super().__init__(args, model)
        self._config = dict(serving_config)

    def config_dict(self):
        return dict(self._config)

    def export_local_adapter(self, all_params):
        self.exports += 1
        return {name: t for name, t in all_params.items() if harness._is_lora_adapter_param(name)}

    def should_skip(self, all_params):
        new_state = {name: t for name, t in all_params.items() if harness._is_lora_adapter_param(name)}
        old = self.prev_state
        same = old is not None and set(old) == set(new_state) and all(old[n] is new_state[n] for n in new_state)
        return same, new_state


class TimedPublisher(LorapubPublisher):
    """lorapub's trainer-side publisher, noting when each publication settled."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.settled_at: dict[str, float] = {}

    def submit(self, snapshot, version_id):
        future = super().submit(snapshot, version_id)
        future.add_done_callback(lambda _: self.settled_at.setdefault(version_id, time.monotonic()))
        return future


class SharedRegistry:
    """Stands in for lorapub's Ray registry actor (one per Relax run): one registry shared by the
    trainer's publication thread and the shard's loop, one command at a time."""

    def __init__(self, inner: LocalRegistry) -> None:
        self.inner = inner
        self.lock = threading.Lock()

    async def handle(self, command):
        with self.lock:
            return self.inner.apply(command)


# -- engines ---------------------------------------------------------------------------------
async def start_doubles(args) -> tuple[list[str], list[asyncio.subprocess.Process]]:
    """Two fresh SGLang doubles, each in a process of its own. Their LoRA slots: lorapub's
    capacity + 1, and one for Relax's fixed adapter, which the first sync loads."""
    flags = ["--decode-delay", str(args.decode_delay), "--load-delay", str(args.load_delay),
             "--prefill-per-token", str(args.prefill_per_token), "--max-loras", str(args.capacity + 2),
             "--managed-prefix", DEFAULT_NAME_PREFIX,  # what the integration names versions (engine_env())
             *bench.ENGINE_MODELS[args.engine_model]["flags"]]
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
        await bench.stop_engines(procs)
        raise
    return urls, procs


async def engine_events(procs) -> list[collections.Counter]:
    """What each double recorded so far, by kind (its own ``events``)."""
    counts = []
    for p in procs:
        p.stdin.write(b"events\n")
        await p.stdin.drain()
        line = (await asyncio.wait_for(p.stdout.readline(), 10)).decode()
        if not line.startswith("EVENTS "):
            raise RuntimeError(f"an engine process answered {line!r} to 'events'")
        counts.append(collections.Counter(json.loads(line[len("EVENTS "):])))
    return counts


async def held_adapters(urls: list[str]) -> dict[str, set[str]]:
    """Every adapter each server holds, from lorapub's state route."""
    held = {}
    for url in urls:
        engine = SGLangWireEngine("probe", url)
        try:
            held[url] = set((await engine.state())["adapters"])
        finally:
            await engine.close()
    return held


async def retried(call, tries: int = 3):
    for attempt in range(tries):
        try:
            return await call()
        except OutcomeUnknown:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.5)


async def leave_as_found(urls: list[str], before: dict[str, set[str]], epoch: int) -> list[str]:
    """Unload what this run loaded: its versions (named ``…@<epoch>-…``, reclaimed as lorapub
    reclaims) and Relax's fixed adapter where it was not there before. What still differs is returned."""
    differs = []
    for url, held in (await held_adapters(urls)).items():
        wire, plain = SGLangWireEngine("cleanup", url), SGLangOverwriteAdmin("cleanup", url)
        try:
            for name in sorted(held - before[url]):
                if name == RELAX_ADAPTER_NAME:
                    await retried(lambda: plain.unload_adapter(name))
                elif "@" in name and name.split("@", 1)[1].startswith(f"{epoch}-"):
                    await retried(lambda: wire.reclaim(name, f"relax-bench-end-{epoch}"))
        finally:
            await wire.close()
            await plain.close()
    for url, held in (await held_adapters(urls)).items():
        differs += [f"{url}: +{n}" for n in sorted(held - before[url])]
        differs += [f"{url}: -{n}" for n in sorted(before[url] - held)]
    return differs


# -- Relax ------------------------------------------------------------------------------------
def relax_args(args, *, enabled: bool, urls: list[str], epoch: int, folder: str) -> argparse.Namespace:
    """Relax's arguments with lorapub's two options (the switch and its config block)."""
    parser = add_arguments(argparse.ArgumentParser())
    argv: list[str] = []
    if enabled:
        path = os.path.join(folder, "lorapub.json")
        with open(path, "w") as f:
            json.dump({"epoch": epoch, "capacity": args.capacity, "max_lag": args.max_lag, "transport": args.transport,
                       "registry": "", "publish_wait": args.wait, "background_publish": True}, f)
        argv = [ENABLE_FLAG, CONFIG_FLAG, path]
    relax = parser.parse_args(argv)
    config = version_snapshot(args, 1).serving_config  # Relax's own LoRA arguments, as the adapter has them
    relax.lora_rank, relax.lora_alpha = int(config["r"]), config.get("lora_alpha", 2 * int(config["r"]))
    relax.lora_dropout, relax.lora_target_modules = 0.0, list(config.get("target_modules") or [])
    relax.lora_adapter_mode, relax.lora_merge_mode = True, False
    relax.worker_urls = list(urls)  # the stand-in router's /workers
    validate_args(relax)
    return relax


def plan_groups(args, seed: int) -> list[list[list[list[int]]]]:
    """Per group, per session, per turn: the observation sent (the prompt, then each tool's output)."""
    rng = random.Random(seed)
    plans = []
    for _ in range(args.groups):
        group = []
        for _ in range(args.group_size):
            turns = [[rng.randrange(1, 1000) for _ in range(rng.randint(16, 48))]]
            turns += [[rng.randrange(1, 1000) for _ in range(rng.randint(4, 12))]
                      for _ in range(rng.randint(*args.turns) - 1)]
            group.append(turns)
        plans.append(group)
    return plans


async def one_run(strategy: str, args, epoch: int) -> dict:
    """One strategy: the first sync, then the rollouts with the trainer publishing beside them."""
    enabled = strategy != "overwrite"
    n_pub = 0 if strategy == "control" else args.publications
    procs: list = []
    urls = list(args.engine_url or [])
    if not urls:
        urls, procs = await start_doubles(args)
    labels = {engine_name(u): f"e{i}" for i, u in enumerate(urls)}
    folder = tempfile.mkdtemp(prefix="relax-live-")
    saved_tmp, tempfile.tempdir = tempfile.tempdir, folder  # the stand-in's push folders land here
    shard = device = path = before = None
    differs: list[str] = ["not checked"]
    try:
        before = await held_adapters(urls)
        relax = relax_args(args, enabled=enabled, urls=urls, epoch=epoch, folder=folder)
        snapshots = {step: version_snapshot(args, step) for step in range(1, n_pub + 2)}
        if enabled:
            incarnations = {}
            for u in urls:
                probe = SGLangWireEngine(engine_name(u), u)
                try:
                    incarnations[engine_name(u)] = await probe.incarnation()
                finally:
                    await probe.close()
            registry = SharedRegistry(LocalRegistry(epoch, incarnations, args.capacity, max_lag=args.max_lag,
                                                    name_prefix=DEFAULT_NAME_PREFIX))
            buckets = {} if args.adapter else {"bucket_cap_bytes": 64 << 10}
            options = {"registry": registry, "deadlines": Deadlines(), **buckets}
            harness.INJECT["shard"] = options
            harness.INJECT["trainer"] = {"background": True,
                                         "publisher": lambda: TimedPublisher(relax, worker_urls=urls, **options)}
        try:
            shard = harness.AgenticSessionShard(relax, None, None, None)
            model = harness.Model(lambda step: {n: snapshots[step].tensor(n) for n in snapshots[step].tensor_names})
            device = harness.DeviceDirectBackend(relax, "nccl", None, [model], model_name="relax-bench",
                                                 quantization_config=None)
        finally:
            harness.INJECT["shard"], harness.INJECT["trainer"] = {}, {}
        device._lora_sync = AdapterSync(relax, device.model, snapshots[1].serving_config)
        path = device._lorapub_path
        # (event, sent, answered, engines, step): the lifecycle calls this driver's path made, each to every
        # engine, and the trainer's step when it made them
        sent: list[tuple[str, float, float, int, int]] = []
        batch_request = device._batch_request

        def counted(endpoint, payload=None, get_rank=False):
            for attempt in range(100):
                t0 = time.monotonic()
                try:
                    return batch_request(endpoint, payload, get_rank)
                except urllib.error.HTTPError as e:
                    # SGLang refuses a flush (400) while aborted requests still drain: ask again, every
                    # 50 ms, as lorapub's SGLangOverwriteAdmin.flush_cache does (the stand-in asks once).
                    if endpoint != "/flush_cache" or e.code != 400 or attempt == 99:
                        raise
                    time.sleep(0.05)
                finally:
                    if endpoint in _BATCH_EVENT:
                        sent.append((_BATCH_EVENT[endpoint], t0, time.monotonic(), len(urls), model.step))

        device._batch_request = counted
        topology = {}
        for i, u in enumerate(urls):
            parts = urllib.parse.urlsplit(u)
            topology[i] = {"ip": parts.hostname, "port": parts.port}
        device.init_process_group_for_rollout(topology)

        async def update(step: int) -> None:
            model.step = step
            if path is None:  # Relax's own method: it takes no rollout id
                await asyncio.to_thread(device.update_weights_for_rollout, True, False)
            else:
                await asyncio.to_thread(device.update_weights_for_rollout, True, False, rollout_id=step)

        # -- the first sync: Relax's own (the base, under pause), then with lorapub on its adapter as step1
        await shard.resume_generation(0)  # the runtime opens the train gate
        marks = await engine_events(procs) if procs else []
        t_boot = time.monotonic()
        await update(1)
        if path is not None:
            first = (await asyncio.to_thread(path.wait, args.wait + 60))[0]
            if first.status != "published":
                raise RuntimeError(f"the first version was not published: {first.status} {first.error!r}")
            await shard._lorapub.start()  # the shard's lorapub starts before the rollouts (first use otherwise)
        boot_s = time.monotonic() - t_boot
        n_sent = len(sent)
        if procs:
            booted = await engine_events(procs)
            boot_events = {kind: sum(n[kind] - m[kind] for n, m in zip(booted, marks)) for kind in LIFECYCLE}
            marks = booted
        else:
            boot_events = {kind: sum(n for e, _, _, n, _ in sent if e == kind) for kind in LIFECYCLE}

        # -- the rollouts, with the trainer publishing beside them
        records: list[RequestRecord] = []
        served: dict[int, set] = {}  # id(record) -> the versions that served the turn
        resent = lost = 0
        calls: list[dict] = []
        current = {"step": 1}

        def engine_of(session_id: str) -> str | None:
            if enabled:
                member = shard._lorapub.member(session_id)
                engine = getattr(member, "engine", None)
                return labels.get(getattr(engine, "name", None))
            return f"e{zlib.crc32(session_id.encode()) % len(urls)}"  # the stand-in router's hashing

        async def agent(group_id: str, session_id: str, turns: list[list[int]]) -> None:
            nonlocal resent, lost
            try:
                for turn, observation in enumerate(turns):
                    for attempt in range(args.retries + 1):
                        t0 = time.monotonic()
                        message = {"role": "tool" if turn else "user", "content": observation}
                        answer = await shard.chat(
                            session_id=session_id, messages=[message], tools=[], chat_template_kwargs={},
                            max_completion_tokens=args.max_new_tokens, stop=None, seed=None)
                        rec = RequestRecord(session_id, turn, t0, time.monotonic(), "error" not in answer,
                                            engine=engine_of(session_id), group=group_id)
                        records.append(rec)
                        if rec.ok:
                            patch = shard._session_records[session_id].forest.leaf_patch  # the export metadata
                            provenance = patch.get("lorapub") or {}
                            rec.version_id, rec.lag = provenance.get("version_id"), provenance.get("lag")
                            rec.rebinds = int(provenance.get("rebinds") or 0)
                            rec.tokens = len(answer["message"]["content"])
                            rec.prompt_tokens = answer["usage"]["prompt_tokens"]
                            resent += patch.get("request_kind") == "resumed"
                            served[id(rec)] = {rec.version_id} if enabled else set()
                            break
                        rec.error = answer["error"]["code"]
                        if answer["_http_status"] < 500:
                            break  # a 4xx is not asked again: the session ends
                    if not rec.ok:
                        lost += 1
                        return
                    await asyncio.sleep(args.tool_latency)
            finally:
                await shard.finish_agent(session_id)  # the agent process exits: the session finalizes

        async def run_group(index: int, plan: list[list[list[int]]]) -> None:
            group_id = f"g{index:03d}"
            session_ids = [f"{group_id}.s{j}" for j in range(len(plan))]
            await shard.start_group("train", group_id, tuple(
                harness.SessionSpec(metadata={}, input_payload=None, sampling_params={"ignore_eos": True},
                                    session_id=sid) for sid in session_ids))
            agents = [asyncio.create_task(agent(group_id, sid, turns)) for sid, turns in zip(session_ids, plan)]
            deadline = time.monotonic() + 60
            while not shard._groups[group_id].first_request_barrier_crossed:  # every member's first turn asked
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{group_id}: its members' first requests never all arrived")
                await asyncio.sleep(0.002)
            await shard.lease_group(group_id, current["step"])
            await asyncio.gather(*agents)
            await shard.take_session_results(group_id, tuple(session_ids))
            await shard.release_group(group_id)  # every member finished: Relax's release_group ends the group

        async def trainer() -> None:
            t0 = time.monotonic()
            for i in range(n_pub):
                step = i + 2
                await asyncio.sleep(max(0.0, t0 + (i + 1) * args.cadence - time.monotonic()))
                call = {"version": f"step{step}", "called": time.monotonic(), "outcome": None}
                calls.append(call)
                try:
                    await update(step)
                    if path is None:
                        call["outcome"] = "done"
                except Exception as e:  # noqa: BLE001 - counted below
                    call["raised"] = f"{type(e).__name__}: {str(e)[:200]}"
                    if path is None:
                        call["outcome"] = "failed"
                call["returned"] = time.monotonic()
                current["step"] = step

        plans = plan_groups(args, args.seed)
        gc.collect()
        gc.freeze()
        gc.disable()
        started = time.monotonic()
        publisher = asyncio.create_task(trainer())
        try:
            groups = []
            for index, plan in enumerate(plans):
                groups.append(asyncio.create_task(run_group(index, plan)))
                await asyncio.sleep(args.arrival)
            results = await asyncio.gather(*groups, return_exceptions=True)
            await publisher
        finally:
            if not publisher.done():
                publisher.cancel()
                await asyncio.gather(publisher, return_exceptions=True)
            gc.enable()
            gc.unfreeze()
        ended = time.monotonic()
        group_errors = [repr(r) for r in results if isinstance(r, BaseException)]
        if procs:
            now = await engine_events(procs)
            events = {kind: sum(n[kind] - m[kind] for n, m in zip(now, marks))
                      for kind in (*LIFECYCLE, "abort_request")}
        else:
            events = {kind: sum(n for e, _, _, n, _ in sent[n_sent:] if e == kind) for kind in LIFECYCLE}

        # -- every publish call's outcome
        if path is not None:
            await asyncio.to_thread(path.wait, args.wait + 60)
            by_version = {o.version_id: o for o in path.outcomes}
            status = {"published": "done", "superseded": "superseded", "deferred": "deferred", "failed": "failed",
                      "pending": "pending"}
            publisher_obj = path.publisher
            for call in calls:
                outcome = by_version.get(call["version"])
                if outcome is None:
                    call["outcome"] = "skipped"  # none recorded (the weight path saw an unchanged adapter)
                    continue
                call["outcome"] = status[outcome.status]
                call["digest_ok"] = outcome.digest == snapshots[int(call["version"][4:])].digest
                if outcome.report is not None:
                    call["waited"] = outcome.report.waited
                    call["lora_name"] = outcome.report.lora_name
                if outcome.error is not None:
                    call["error"] = f"{type(outcome.error).__name__}: {str(outcome.error)[:200]}"
                if call["version"] in publisher_obj.settled_at:
                    call["settled"] = publisher_obj.settled_at[call["version"]]
            first_ok = all(o.digest == snapshots[1].digest for o in path.outcomes if o.version_id == "step1")
        else:
            first_ok = True
            # Relax's overwrite: version k serves from its continue until the next pause
            live, pauses = [], []
            for event, t_sent, t_done, _, step in sent:
                if event == "pause":
                    pauses.append(t_done)
                elif event == "continue":
                    live.append([t_sent, math.inf, step])
            for k, (window_start, _, _) in enumerate(live):
                later = [p for p in pauses if p > window_start]
                live[k][1] = min(later) if later else math.inf
            for rec in records:
                if rec.ok:
                    served[id(rec)] = {f"step{v}" for a, b, v in live if a <= rec.ended and b >= rec.started}
    finally:
        try:
            if shard is not None:
                await shard.shutdown()
        finally:
            try:
                if path is not None:
                    await asyncio.to_thread(path.close)
                if before is not None:
                    differs = await leave_as_found(urls, before, epoch)
            finally:
                await bench.stop_engines(procs)
                tempfile.tempdir = saved_tmp
                shutil.rmtree(folder, ignore_errors=True)
    return figures(enabled, records, served, calls, events, started, ended, resent, lost, boot_events, boot_s,
                   group_errors, differs, first_ok, args)


def figures(enabled, records, served, calls, events, started, ended, resent, lost, boot_events, boot_s,
            group_errors, differs, first_ok, args) -> dict:
    result = WorkloadResult(records, started, ended)
    by_group: dict[str, set] = {}
    by_session: dict[str, set] = {}
    for rec in result.ok:
        by_group.setdefault(rec.group, set()).update(served[id(rec)])
        by_session.setdefault(rec.session, set()).update(served[id(rec)])
    lags = [(rec.lag if enabled else 0, rec.tokens) for rec in result.ok]
    gaps = result.longest_gap()
    codes = collections.Counter(rec.error for rec in records if not rec.ok)
    nan = float("nan")
    out = {
        "mixed_groups": sum(len(v) > 1 for v in by_group.values()),
        "mixed_sessions": sum(len(v) > 1 for v in by_session.values()),
        **{kind: events.get(kind, 0) for kind in LIFECYCLE},
        "aborts_at_engines": events.get("abort_request", nan),
        **{f"boot_{kind}": boot_events[kind] for kind in LIFECYCLE}, "boot_s": boot_s,
        "lag_p50": bench.weighted_percentile(lags, 50), "lag_p99": bench.weighted_percentile(lags, 99),
        "lag_max": max((lag for lag, n in lags if n and lag is not None), default=nan),
        "calls": len(calls),
        **{key: sum(c["outcome"] == outcome for c in calls) for key, outcome in (
            ("done", "done"), ("superseded", "superseded"), ("deferred", "deferred"), ("failed_calls", "failed"),
            ("skipped", "skipped"), ("pending", "pending"))},
        "requests": len(records),
        "failed": sum(codes.values()),
        "failed_by_code": dict(codes),
        "resent": resent,
        "lost": lost,
        "groups": len(by_group),
        "group_errors": group_errors,
        "gap": max(gaps.values(), default=nan),
        **{f"gap_{engine}": gaps.get(engine, nan) for engine in ("e0", "e1")},
        "p50": result.latency(50), "p99": result.latency(99),
        "duration": ended - started,
        "left_as_found": not differs,
        "differs": differs,
        "digests_ok": first_ok and all(c.get("digest_ok", True) for c in calls),
        "call_log": [{k: (v - started if k in ("called", "returned", "settled") else v) for k, v in c.items()}
                     for c in calls],
    }
    return out


# -- the report ---------------------------------------------------------------------------------
ROWS = [  # (figure, key, unit)
    ("mixed-version groups", "mixed_groups", "n"),
    ("mixed-version sessions", "mixed_sessions", "n"),
    ("pause calls reaching the engines", "pause", "n"),
    ("flush calls reaching the engines", "flush", "n"),
    ("continue calls reaching the engines", "continue", "n"),
    ("  pause calls of the first sync (before)", "boot_pause", "n"),
    ("version lag p50 (token-weighted)", "lag_p50", "n"),
    ("version lag p99 (token-weighted)", "lag_p99", "n"),
    ("version lag max", "lag_max", "n"),
    ("publish calls made", "calls", "n"),
    ("  done (the version landed)", "done", "n"),
    ("  superseded by a newer step", "superseded", "n"),
    ("  deferred (its wait ran out)", "deferred", "n"),
    ("  failed", "failed_calls", "n"),
    ("  skipped (no outcome recorded)", "skipped", "n"),
    ("requests sent (turns and resends)", "requests", "n"),
    ("requests failed (answered with an error)", "failed", "n"),
    ("requests aborted and resent by the shard", "resent", "n"),
    ("turns lost (still failing after retries)", "lost", "n"),
    ("groups served", "groups", "n"),
    ("longest no-progress gap (larger engine)", "gap", "ms"),
    ("  engine e0", "gap_e0", "ms"),
    ("  engine e1", "gap_e1", "ms"),
    ("request latency p50", "p50", "ms"),
    ("request latency p99", "p99", "ms"),
    ("rollouts' duration", "duration", "ms"),
]


def method(args) -> str:
    if args.engine_url:
        engines = (f"the servers at {', '.join(args.engine_url)}, the same in every run; each run is a deployment "
                   "epoch of its own and unloads what it loaded at its end")
        counted = ("the calls this driver's path made, each sent to both servers (the stand-in "
                   "DeviceDirectBackend._batch_request; live SGLang keeps no count of them); lorapub's path makes none "
                   "after the first sync")
    else:
        engines = (f"two SGLang contract doubles (lorapub.testing.SGLangDouble), each in a process of its own, fresh "
                   f"for every run: decode {args.decode_delay * 1e3:g} ms a token, prefill "
                   f"{args.prefill_per_token * 1e6:g} µs a prompt token, adapter load {args.load_delay * 1e3:g} ms, "
                   f"{bench.ENGINE_MODELS[args.engine_model]['text']} (--engine-model {args.engine_model}); "
                   f"{args.capacity + 2} LoRA slots (lorapub's capacity + 1, and one for Relax's fixed adapter)")
        counted = "each engine's own event log (the double's events), summed over both engines"
    adapter = (f"the adapter in {args.adapter} rescaled by 1 + step/64" if args.adapter
               else "lorapub.testing.lora_snapshot(1000 + step)")
    items = [
        f"engines: {engines}. lorapub's bytes go over {args.transport}. Relax's shard, its trainer and lorapub run in "
        "this process: the trainer's updates on a thread, lorapub's publisher on an event loop of its own.",
        "Relax: the stand-ins of tests/integrations/relax_harness.py with lorapub's hooks in place: "
        "AgenticSessionShard (start_group -> open_group; every turn through the wrapped backend's generate, with "
        "Relax's keywords; _finish_session_once -> release; _drop_group -> release_group) and DeviceDirectBackend, "
        "whose update_weights_for_rollout is lorapub's weight path (install_weight_path) when lorapub is on. The "
        "shard and the trainer share one in-process registry (in Relax: lorapub's Ray registry actor).",
        f"rollouts: {args.groups} groups of {args.group_size} sessions, a group every {args.arrival * 1e3:g} ms; each "
        f"session {args.turns[0]}-{args.turns[1]} turns of {args.max_new_tokens} new tokens (ignore_eos) with "
        f"{args.tool_latency * 1e3:g} ms of tool time between them, seed {args.seed}. A group starts with "
        "start_group, every member's first turn is asked, then lease_group; an agent exits after its last turn "
        "(finish_agent); the group is released (dropped) once every member has finished. A turn answered with a "
        f"5xx is asked again at once, up to {args.retries} times (an OpenAI client resends a 5xx); a 4xx ends the "
        "session.",
        "trainer: the first weight update runs before the rollouts: Relax's own first sync (pause, flush, the base, "
        "relax_policy_lora loaded, continue); with lorapub on, its adapter then becomes version step1. While the "
        f"rollouts run, {args.publications} more updates (step2 on), one every {args.cadence:g} s (an update still "
        f"running delays the next, as a training step would), each adapter {adapter}. lorapub on: "
        "LorapubWeightPath publishes a Snapshot of the tensors in the background, with no pause and no flush "
        f"(capacity {args.capacity}, max_lag {args.max_lag}, publish_wait {args.wait:g} s). lorapub off: the "
        "stand-in of Relax's update_weights_for_rollout: pause, flush (asked again while the engine refuses it), "
        "unload + load of relax_policy_lora on every engine (from a folder, where Relax broadcasts over NCCL), "
        "continue. control: lorapub on, the first sync only: nothing is published while the rollouts run.",
        f"pause/flush/continue reaching the engines, from the rollouts' start to their end: counted from {counted}. "
        "The first sync's are shown apart.",
        "mixed-version groups (sessions): served by more than one version. lorapub: each turn's version as the "
        "export metadata the integration writes names it (metadata['lorapub']['version_id']); lorapub off: the "
        "versions on the engines while the turn ran (step k from its update's continue to the next pause).",
        "version lag: token-weighted p50/p99/max of the export metadata's lag (commits behind the default, as the "
        "shard last saw the default), each turn counted once per new token; 0 on the old path, which overwrites "
        "in place.",
        "publish calls: each update's outcome: done, superseded, deferred (its wait ran out), failed, or skipped "
        "(no outcome recorded); every published digest is checked against its step's Snapshot.",
        "requests failed: turn attempts answered with an error (on the doubles a request running at a pause comes "
        "back as a 503); aborted and resent: turns the shard resent after an abort (request_kind 'resumed').",
        "no-progress gap: lorapub.demo.workload.WorkloadResult.longest_gap per engine (the longest stretch with no "
        "request completing while one was pending); a run's figure is its larger engine's; excess = the figure "
        "minus the same round's control figure.",
        f"{args.rounds} round(s), each control -> lorapub off -> lorapub on; a figure is the median [min-max] over "
        "the rounds. The garbage collector is collected, frozen and off in this process while the rollouts run.",
    ]
    return "method:\n" + "\n".join(textwrap.fill(item, 112, initial_indent="  ", subsequent_indent="    ")
                                     for item in items)


def call_text(call: dict) -> str:
    text = f"{call['version']} {call['outcome']}"
    if call.get("settled") is not None:
        text += f" (call to settled {call['settled'] - call['called']:.2f} s"
        text += f", waited {call['waited']:.2f} s)" if call.get("waited") else ")"
    elif call.get("returned") is not None and call["outcome"] == "done":
        text += f" (call returned after {call['returned'] - call['called']:.2f} s)"
    if call.get("error"):
        text += f" ({call['error']})"
    if call.get("raised"):
        text += f" [the update raised {call['raised']}]"
    return text


async def main_async(args) -> int:
    load = os.getloadavg()[0]
    print(f"== Relax-shaped rollouts: {args.rounds} round(s) of control, lorapub off, lorapub on; "
          f"load average {load:.2f} on {os.cpu_count()} CPUs ==")
    print(method(args), flush=True)
    rounds = []
    # Real servers keep every cleaned attempt's tombstone: each run takes an epoch no earlier one used.
    first_epoch = int(time.time() * 1000) if args.engine_url else 1
    for r in range(args.rounds):
        run = {}
        for i, strategy in enumerate(STRATEGIES):
            run[strategy] = await one_run(strategy, args, epoch=first_epoch + r * len(STRATEGIES) + i)
        control = run["control"]
        run["derived"] = {f"{s}_excess_gap": run[s]["gap"] - control["gap"] for s in ("overwrite", "lorapub")}
        rounds.append(run)
        print(f"round {r + 1}: longest gap control {control['gap'] * 1e3:.1f} ms, lorapub off "
              f"{run['overwrite']['gap'] * 1e3:.1f} ms, lorapub on {run['lorapub']['gap'] * 1e3:.1f} ms; "
              f"pause/flush lorapub off {run['overwrite']['pause']}/{run['overwrite']['flush']}, lorapub on "
              f"{run['lorapub']['pause']}/{run['lorapub']['flush']}; mixed-version groups lorapub off "
              f"{run['overwrite']['mixed_groups']}, lorapub on {run['lorapub']['mixed_groups']}", flush=True)

    summary = {s: {key: bench.spread([run[s][key] for run in rounds]) for _, key, _ in ROWS} for s in STRATEGIES}
    summary["derived"] = {key: bench.spread([run["derived"][key] for run in rounds]) for key in rounds[0]["derived"]}
    widths = (24, 26, 26)
    print(f"\n{'figure':44}" + "".join(f" {TITLES[s]:>{w}}" for s, w in zip(STRATEGIES, widths)))
    for name, key, unit in ROWS:
        print(f"{name:44}" + "".join(f" {bench.fmt(summary[s][key], unit):>{w}}" for s, w in zip(STRATEGIES, widths)))
    cells = ["—", bench.fmt(summary["derived"]["overwrite_excess_gap"], "ms"),
             bench.fmt(summary["derived"]["lorapub_excess_gap"], "ms")]
    print(f"{'excess no-progress gap over control':44}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    print()
    for r, run in enumerate(rounds):
        for s in ("overwrite", "lorapub"):
            print(f"round {r + 1} {TITLES[s]} publish calls: " + "; ".join(call_text(c) for c in run[s]["call_log"]))
        for s in STRATEGIES:
            if run[s]["failed_by_code"] or run[s]["group_errors"]:
                print(f"round {r + 1} {TITLES[s]}: requests failed by code {run[s]['failed_by_code']}"
                      + (f"; groups that raised: {run[s]['group_errors']}" if run[s]["group_errors"] else ""))
    left = [f"round {r + 1} {TITLES[s]}: {d}" for r, run in enumerate(rounds) for s in STRATEGIES
            for d in run[s]["differs"]]
    print("servers left as found after every run" if not left else "servers NOT left as found: " + "; ".join(left))
    print(f"load average after the runs: {os.getloadavg()[0]:.2f}")

    lor = [run["lorapub"] for run in rounds]
    checks = {
        "0 mixed-version groups with lorapub, every round": all(x["mixed_groups"] == 0 for x in lor),
        "0 pause / flush calls reached the engines with lorapub while the rollouts ran, every round": all(
            x["pause"] == 0 and x["flush"] == 0 for x in lor),
        "every lorapub publish call has its outcome (done, superseded, deferred or failed), every round": all(
            x["calls"] == args.publications and x["skipped"] == 0 and x["pending"] == 0 for x in lor),
        "every published version's digest is its step's Snapshot's": all(x["digests_ok"] for x in lor),
        "0 requests failed with lorapub, every round": all(x["failed"] == 0 for x in lor),
        "every group ran to its end, every run": all(not run[s]["group_errors"] for run in rounds for s in STRATEGIES),
        "the servers were left as found after every run": not left,
    }
    print("\n== checks ==")
    for name, ok in checks.items():
        print(f"  [{'pass' if ok else 'FAIL'}] {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "method": method(args),
                       "counted_from": "driver" if args.engine_url else "engines",
                       "load_average": [load, os.getloadavg()[0]], "rounds": rounds, "summary": summary,
                       "checks": checks}, f, indent=1, default=str)
    return 0 if all(checks.values()) else 1


class _Once(logging.Filter):
    """Lets each distinct message through once (every run starts lorapub afresh and says the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        fresh = message not in self.seen
        self.seen.add(message)
        return fresh


def main() -> int:
    logging.getLogger("lorapub.integrations.relax").addFilter(_Once())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: one small round")
    parser.add_argument("--engine-url", action="append", help="a live patched SGLang server; give two")
    parser.add_argument("--adapter", metavar="DIR", help="publish versions of this PEFT folder (it must fit the servers)")
    parser.add_argument("--transport", choices=("http", "ipc"), default="http",
                        help="how lorapub's bytes reach the engines (ipc: same host)")
    parser.add_argument("--capacity", type=int, default=2, help="lorapub's managed version slots")
    parser.add_argument("--max-lag", type=int, default=None, help="lorapub's bounded staleness (default: none)")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds a publication waits for a slot (publish_wait)")
    parser.add_argument("--cadence", type=float,
                        help=f"seconds between weight updates (default {FULL['cadence']})")
    parser.add_argument("--publications", type=int, default=4, help="weight updates while the rollouts run")
    parser.add_argument("--rounds", type=int, help=f"control/off/on rounds (default {FULL['rounds']})")
    parser.add_argument("--groups", type=int, help=f"default {FULL['groups']}")
    parser.add_argument("--group-size", type=int, help=f"sessions per group (default {FULL['group_size']})")
    parser.add_argument("--turns", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help=f"turns a session (default {FULL['turns'][0]} {FULL['turns'][1]})")
    parser.add_argument("--max-new-tokens", type=int, help=f"new tokens a turn (default {FULL['max_new_tokens']})")
    parser.add_argument("--tool-latency", type=float,
                        help=f"tool time between turns, s (default {FULL['tool_latency']})")
    parser.add_argument("--arrival", type=float,
                        help=f"seconds between group starts (default {FULL['arrival']})")
    parser.add_argument("--retries", type=int, default=2, help="times an agent asks a turn again after a 5xx")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--decode-delay", type=float, default=0.002, help="the doubles' decode time a token, s")
    parser.add_argument("--load-delay", type=float,
                        help=f"the doubles' adapter load, s (default {FULL['load_delay']})")
    parser.add_argument("--prefill-per-token", type=float, default=20e-6,
                        help="the doubles' prefill time per uncached prompt token, s")
    parser.add_argument("--engine-model", choices=sorted(bench.ENGINE_MODELS),
                        help="how the doubles' loads meet decoding (bench/run.py's models; default patched)")
    parser.add_argument("--json", help="also write every figure to this file")
    args = parser.parse_args()
    if args.engine_url and len(args.engine_url) != 2:
        parser.error("give two --engine-url (or none: two SGLang doubles are started)")
    if args.engine_url and args.engine_model is not None:
        parser.error("--engine-model shapes the doubles; live servers (--engine-url) behave as they do")
    args.engine_model = args.engine_model or "patched"
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.group_size < 1 or args.groups < 1 or not 1 <= args.turns[0] <= args.turns[1]:
        parser.error("--groups and --group-size must be >= 1 and --turns MIN MAX with 1 <= MIN <= MAX")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
