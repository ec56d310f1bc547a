"""Transport throughput: adapter bytes into two engines that stage them inside themselves.

    python3 bench/transport_bench.py            # short: 4 of Qwen3-8B's 36 layers (~39 MB), 3 runs
    python3 bench/transport_bench.py --full     # the whole 349 MB adapter (504 bf16 tensors)
    python3 bench/transport_bench.py --layers 7 --src OTHER/src --label before --json before.json
    python3 bench/transport_bench.py --side-by-side before*.json after*.json   # per transport, per label

The adapter is Qwen3-8B's LoRA at r=64 on all seven linear modules of every layer (q/k/v/o,
gate/up/down: 14 bf16 tensors a layer, 504 for 36 layers, 349,175,808 bytes), seeded tensors.
Two engines (lorapub's contract double running lorapub's engine-side staging, each in a process
of its own: ``python -m lorapub.testing.serve_double``) receive every publication; fresh engines
for each transport. ``--src`` measures another checkout's lorapub (its engines too) with this same
bench, so a before and an after can be run alternately on one machine and put side by side.

Per publication (``--repeat`` of them, each transport):

* ``publish()`` wall time: the call to its return (the version committed on READY receipts from
  both engines: begin, transfer, the engines' verification and load, commit), with every phase's
  time and each engine's share of ``end`` (its wait for its SHA-256 checks, its load);
* the engines' load (the slower engine's: they load at once) is the engine's own work, SGLang's in
  production and the contract double's here, so the table also gives ``publish()`` less it: what
  the transport and lorapub's staging cost. (The double's tensor load reads every tensor as float64
  for its stand-in numeric model, one tensor at a time since 2026-12-07; before, a float64 copy of
  the whole adapter, 1.4 GB per engine at 349 MB, made that load the slowest part of a same-host row.)
* MB/s: adapter bytes / the transfer phase (first bucket sent to last bucket stored on both
  engines), next to the raw limit measured in the same run between the same processes: the same
  buckets as plain HTTP POSTs into a discarding route (HTTP bytes), through /dev/shm files copied
  by the engines (same-host IPC), as raw gloo broadcasts (torch.distributed); nothing verified.

Publisher side, during every publication: peak RSS growth over the frozen snapshot (copies of the
bytes beyond the snapshot itself; the snapshot is copy 1), bytes run through SHA-256 in this
process from the trainer's tensors to the commit (the snapshot's one pass), and the caller's event
loop (see ``LoopLag``): its longest single step, wall clock and CPU, what that step ran (the task
and the lines it began and ended at), how many steps took longer than 5 ms, and a 1 ms sleeper's
worst lateness. The control for the loop: the same monitor on the same loop, as long again, with
no publication running (on a machine shared with other work, its wall figures show the noise the
publication's include; the CPU figures do not carry it). Last, whether every engine freed every
stash of a RECLAIMED version and of a FAILED_CLEAN one, and every shared-memory file went.
``http-loop`` is HTTP bytes posted on the caller's loop (``HTTPBytes(sender="loop")``), beside the
default sender thread.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _src_arg(argv: list[str]) -> str:
    """``--src DIR``: the lorapub source this bench and its engines import (another checkout's ``src``,
    to measure a before and an after with the same bench); read before lorapub is imported."""
    for i, arg in enumerate(argv):
        if arg == "--src" and i + 1 < len(argv):
            return os.path.abspath(argv[i + 1])
        if arg.startswith("--src="):
            return os.path.abspath(arg.split("=", 1)[1])
    return os.path.join(REPO, "src")


SRC = _src_arg(sys.argv)
sys.path.insert(0, SRC)

import aiohttp  # noqa: E402

from lorapub.adapters.sglang_wire import HTTPBytes, RawBucket, SameHostIPC, SGLangWireEngine, TorchDistributed  # noqa: E402
from lorapub.runtime.deployment import Deployment  # noqa: E402
from lorapub.runtime.publisher import PublicationFailed  # noqa: E402
from lorapub.runtime.runner import Deadlines  # noqa: E402
from lorapub.snapshot import Snapshot  # noqa: E402

HIDDEN, INTER, KV, RANK, LAYERS = 4096, 12288, 1024, 64, 36
MODULES = {  # Qwen3-8B: module -> (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}
MB = 1e6
#: Each engine's share of ``end``, as its receipt tells it: waiting for its SHA-256 checks, then the
#: engine's load (SGLang's own work; the contract double's here).
ENGINE_PHASES = ("end.verify_wait", "end.load")


def qwen3_8b_lora(layers: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in MODULES.items():
            p = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{p}.lora_A.weight"] = (torch.randn(RANK, fan_in, generator=g) * 0.01).to(torch.bfloat16)
            out[f"{p}.lora_B.weight"] = (torch.randn(fan_out, RANK, generator=g) * 0.01).to(torch.bfloat16)
    return out


def config(tag: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
            "target_modules": [m.split(".")[-1] for m in MODULES], "bias": "none", "base_model_name_or_path": "Qwen/Qwen3-8B",
            "revision": tag}


# -- publisher-side probes ----------------------------------------------------------------------------
#: The bars (issue 44, item 4; on 16 cores at 349 MB): no single step of the caller's loop longer than
#: STEP_BAR (wall clock), and publish() to the commit on both engines within PUBLISH_BAR.
STEP_BAR = 0.005
PUBLISH_BAR = 0.4


def _where(handle) -> tuple:
    """What a loop step is about to run: a task's innermost coroutine and the line it resumes at, or
    the callback's name (kept raw; :func:`_describe` formats it only for the longest step)."""
    callback = handle._callback
    task = getattr(callback, "__self__", None)
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    if coro is None:
        return (getattr(callback, "__qualname__", None) or repr(callback), None, 0)
    inner = coro
    while getattr(inner, "cr_await", None) is not None and getattr(inner.cr_await, "cr_frame", None) is not None:
        inner = inner.cr_await
    frame = getattr(inner, "cr_frame", None)
    return (getattr(coro, "__qualname__", repr(coro)), frame.f_code if frame is not None else None,
            frame.f_lineno if frame is not None else 0)


def _describe(where: tuple) -> str:
    name, code, line = where
    if code is None:
        return str(name)
    return f"{name} @ {code.co_qualname} ({os.path.basename(code.co_filename)}:{line})"


class LoopLag:
    """How this event loop fared during a publication (or, for the control, while it idled):

    * ``worst``: the lateness of a task asking for 1 ms sleeps (wall clock: whatever kept the loop
      from running it, this process's code or the OS running other processes on the machine's
      cores, or another thread holding the GIL), with ``busy``, the CPU time the loop's thread
      spent in that same interval (the kernel's loopback TCP work counts there too);
    * ``step`` / ``step_cpu``: the longest single step the loop ran (one callback or task step:
      the time it held the loop, wall and CPU; asyncio's own slow-callback measure), ``step_what``
      / ``step_cpu_what``: what those steps ran (a task's coroutine and the line it resumed at);
    * ``over`` / ``over_cpu``: how many steps took longer than ``STEP_BAR`` (wall / CPU);
    * ``cpu``: all the CPU time the loop's thread spent from the publication's call to its return
      (lorapub's work on the caller's loop, the socket sends it makes there included);
    * ``gc``: the longest garbage-collector pause.
    """

    def __init__(self) -> None:
        self.worst = self.busy = self.gc = self.step = self.step_cpu = self.cpu = 0.0
        self.over = self.over_cpu = self.steps = 0
        self.step_what = self.step_cpu_what = ""
        self._task = None
        self._gc_started = 0.0
        self._run_step = asyncio.events.Handle._run

    def _gc(self, phase, info) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc = max(self.gc, time.perf_counter() - self._gc_started)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(0.001)
            late = loop.time() - t - 0.001
            if late > self.worst:
                self.worst = late
            self.busy = max(self.busy, time.thread_time() - cpu)

    def _timed_steps(self):
        lag, run, loop_thread = self, self._run_step, threading.current_thread()

        def _run(handle):
            if threading.current_thread() is not loop_thread:  # another thread's loop (lorapub's sender)
                return run(handle)
            where = _where(handle)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return run(handle)
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                lag.steps += 1
                lag.over += wall > STEP_BAR
                lag.over_cpu += cpu > STEP_BAR
                if wall > lag.step or cpu > lag.step_cpu:
                    what = f"{_describe(where)} -> {_describe(_where(handle))}"  # where it began -> ended
                    if wall > lag.step:
                        lag.step, lag.step_what = wall, what
                    if cpu > lag.step_cpu:
                        lag.step_cpu, lag.step_cpu_what = cpu, what

        return _run

    def __enter__(self):
        import gc

        gc.callbacks.append(self._gc)
        asyncio.events.Handle._run = self._timed_steps()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._cpu0 = time.thread_time()
        return self

    def __exit__(self, *exc):
        import gc

        self.cpu = time.thread_time() - self._cpu0
        asyncio.events.Handle._run = self._run_step
        gc.callbacks.remove(self._gc)
        self._task.cancel()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class HashCounter:
    """Counts the bytes this process runs through SHA-256 (hashlib.sha256, as lorapub calls it)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._real = hashlib.sha256

    def __enter__(self):
        counter, real = self, self._real

        def sha256(data=b"", **kw):
            counter.bytes += len(memoryview(data).cast("B")) if data else 0
            h = real(**kw)
            if data:
                h.update(data)
            return _Counted(h, counter)

        hashlib.sha256 = sha256
        return self

    def __exit__(self, *exc):
        hashlib.sha256 = self._real


class _Counted:
    def __init__(self, h, counter) -> None:
        self._h, self._c = h, counter

    def update(self, data) -> None:
        self._c.bytes += len(memoryview(data).cast("B"))
        self._h.update(data)

    def __getattr__(self, name):
        return getattr(self._h, name)


# -- engines in their own processes ----------------------------------------------------------------------
class EngineProcess:
    def __init__(self, name: str, stash: str, shm: str) -> None:
        # lorapub's source first, then whatever the caller's path already holds (a bundle's packages)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "lorapub.testing.serve_double", name, stash, shm],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "URL":
            raise RuntimeError(f"engine {name} did not start: {line}")
        self.url, self.control = line[1], line[2]

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def post(http, url: str, **kw) -> dict:
    async with http.post(url, **kw) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {text[:200]}")
        return json.loads(text)


# -- raw controls (same processes, same buckets) --------------------------------------------------------
async def raw_http(http, procs, blobs) -> float:
    t = time.perf_counter()
    for blob in blobs:
        await asyncio.gather(*(post(http, p.control + "/sink/http", data=blob) for p in procs))
    return time.perf_counter() - t


async def raw_shm(http, procs, blobs, shm: str) -> float:
    t = time.perf_counter()
    for i, blob in enumerate(blobs):
        path = os.path.join(shm, f"lorapub-raw-{os.getpid()}-{i}")

        def write():
            with open(path, "wb") as f:
                f.write(blob)

        await asyncio.to_thread(write)
        await asyncio.gather(*(post(http, p.control + "/sink/shm", json={"path": path}) for p in procs))
        os.unlink(path)
    return time.perf_counter() - t


async def raw_gloo(http, procs, blobs, rep: int) -> float:
    import datetime

    import torch
    import torch.distributed as dist

    span = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=span, wait_for_workers=False)
    prefix = f"raw-{rep}"
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    body = {"host": "127.0.0.1", "port": store.port, "world_size": 1 + len(procs), "sizes": [len(b) for b in blobs],
            "timeout": 120, "prefix": prefix}

    def send() -> float:
        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 0, 1 + len(procs), span)
        t = time.perf_counter()
        for tensor in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            pg.broadcast([tensor], opts).wait()
        return time.perf_counter() - t

    sinks = [post(http, p.control + "/sink/gloo", json={**body, "rank": i + 1}) for i, p in enumerate(procs)]
    seconds, *_ = await asyncio.gather(asyncio.to_thread(send), *sinks)
    return seconds


# -- one transport -----------------------------------------------------------------------------------------
async def bench_transport(kind: str, state_dict: dict, args, workdir: str) -> dict:
    shm = tempfile.mkdtemp(prefix="lorapub-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    procs = [EngineProcess(f"e{i}", os.path.join(workdir, f"{kind}-e{i}"), shm) for i in range(2)]
    transport = {"http": lambda: HTTPBytes(), "http-loop": lambda: HTTPBytes(sender="loop"), "shm": lambda: SameHostIPC(shm_dir=shm),
                 "shm-dir": lambda: SameHostIPC(shm_dir=shm, load="dir"),
                 "gloo": lambda: TorchDistributed(timeout=120.0)}[kind]()
    engines = {f"e{i}": SGLangWireEngine(f"e{i}", p.url, probe_timeout=300) for i, p in enumerate(procs)}
    deadlines = Deadlines(begin=60, bucket=300, end=600, cleanup=120, commit=10, reclaim=300)
    dep = await Deployment(engines, epoch=1, deadlines=deadlines, bucket_cap_bytes=args.bucket_mb << 20,
                           reconcile_interval=None, transport=transport).start()
    out = {"kind": kind, "mbps": [], "raw": [], "lag": [], "busy": [], "gc": [], "step": [], "step_cpu": [], "loop_cpu": [],
           "copies": [], "hashed": [], "end": [], "e2e": [], "transfer": [], "phases": [], "engine_phases": [],
           "step_what": [], "step_cpu_what": [], "over": [], "over_cpu": [], "steps": [],
           "idle_step": [], "idle_step_cpu": [], "idle_lag": [], "idle_over": []}
    try:
        async with aiohttp.ClientSession() as http:
            snapshot = None
            for rep in range(args.repeat):
                with HashCounter() as hashed:
                    snapshot = await asyncio.to_thread(Snapshot, state_dict, config(f"{kind}-{rep}"))
                    size = snapshot.manifest.total_bytes
                    base = _status("VmRSS")
                    reset_peak_rss()
                    with LoopLag() as lag:
                        started = time.perf_counter()
                        # a task of its own, so that its first step is timed too
                        report = await asyncio.ensure_future(dep.publish(snapshot, f"v{rep}"))  # returns once committed
                        e2e = time.perf_counter() - started
                    peak = _status("VmHWM")
                await dep.settle()
                # the control: the same loop, the same monitor, as long again, with no publication
                with LoopLag() as idle:
                    await asyncio.sleep(e2e)
                out["mbps"].append(size / report.phases["transfer"] / MB)
                out["transfer"].append(report.phases["transfer"])
                out["end"].append(report.phases.get("end", 0.0))
                out["e2e"].append(e2e)
                out["phases"].append({k: round(v, 3) for k, v in report.phases.items()})
                out["engine_phases"].append({e: {k: round(v, 3) for k, v in p.items() if k in ENGINE_PHASES}
                                             for e, p in sorted(report.engine_phases.items())})
                out["lag"].append(lag.worst)
                out["busy"].append(lag.busy)
                out["gc"].append(lag.gc)
                out["step"].append(lag.step)
                out["step_cpu"].append(lag.step_cpu)
                out["step_what"].append(lag.step_what)
                out["step_cpu_what"].append(lag.step_cpu_what)
                out["over"].append(lag.over)
                out["over_cpu"].append(lag.over_cpu)
                out["steps"].append(lag.steps)
                out["loop_cpu"].append(lag.cpu)
                out["idle_step"].append(idle.step)
                out["idle_step_cpu"].append(idle.step_cpu)
                out["idle_lag"].append(idle.worst)
                out["idle_over"].append(idle.over)
                out["copies"].append(1 + max(0, peak - base) / size)
                out["hashed"].append(hashed.bytes / size)
            plan = snapshot.plan(args.bucket_mb << 20)
            blobs = [b"".join(bytes(v) for v in RawBucket(snapshot, b).views()) for b in plan.buckets]
            for rep in range(args.repeat):
                if kind.startswith("http"):
                    seconds = await raw_http(http, procs, blobs)
                elif kind.startswith("shm"):
                    seconds = await raw_shm(http, procs, blobs, shm)
                else:
                    seconds = await raw_gloo(http, procs, blobs, rep)
                out["raw"].append(size / seconds / MB)
            del blobs
            # stashes: the reclaimed versions and a failed publication leave nothing on any engine
            state = await dep.state()
            reclaimed = {v.lora_name for v in state.versions.values() if v.state.value == "RECLAIMED"}
            await post(http, procs[1].control + "/inject", json={"op": "bucket", "mode": "error"})
            failed = await asyncio.to_thread(Snapshot, state_dict, config(f"{kind}-fail"))
            try:
                await dep.publish(failed, "failed")
                out["failed_clean"] = False
            except PublicationFailed:
                final = (await dep.state()).versions
                out["failed_clean"] = any(v.state.value == "FAILED_CLEAN" for v in final.values())
            stashes = []
            for e in engines.values():
                staging = (await e.state())["staging"]
                stashes += [a["lora_name"] for a in staging["attempts"].values() if a["lora_name"] in reclaimed
                            or "-failed-" in a["lora_name"]]
            out["reclaimed"] = len(reclaimed)
            out["stashes_left"] = stashes
            await asyncio.sleep(0.5)  # bucket files are removed off the event loop
            out["shm_left"] = [n for n in os.listdir(shm) if n.startswith("lorapub-")]
    finally:
        await dep.close()
        for e in engines.values():
            await e.close()
        for p in procs:
            p.stop()
        for n in os.listdir(shm):
            os.unlink(os.path.join(shm, n))
        os.rmdir(shm)
    return out


NAMES = {"http": "HTTP bytes", "http-loop": "HTTP bytes, posted on the caller's loop",
         "shm": "same-host IPC (/dev/shm, tensor load)", "shm-dir": "same-host IPC (/dev/shm, folder load)",
         "gloo": "torch.distributed (gloo)"}


def _ms(values, agg=max) -> str:
    return f"{1000 * agg(values):.1f}"


def print_results(results: list[dict], label: str = "") -> None:
    med = statistics.median
    print()
    print("| transport | MB/s | raw limit MB/s | MB/s / raw | source copies (peak) | SHA-256 passes (source) "
          "| publish() to committed READY on both engines s: median / min / max | transfer s: median "
          "| end (load) s | engines' load s | publish() less the engines' load s | caller's loop: CPU per publication | longest loop step: wall / CPU "
          "| steps > 5 ms: wall / CPU | control (idle loop, as long): longest step wall / CPU "
          "| 1 ms sleeper late: wall / busy / gc | stashes left (RECLAIMED, FAILED_CLEAN) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | --- |")
    for r in results:
        ratio = med(r["mbps"]) / med(r["raw"])
        left = len(r["stashes_left"]) + len(r["shm_left"])
        print(f"| {label}{NAMES[r['kind']]} | {med(r['mbps']):.0f} | {med(r['raw']):.0f} | {ratio:.2f} | "
              f"{max(r['copies']):.2f} | {max(r['hashed']):.2f} | {med(r['e2e']):.2f} / {min(r['e2e']):.2f} / "
              f"{max(r['e2e']):.2f} | {med(r['transfer']):.3f} | {med(r['end']):.2f} | {med(engines_load(r)):.2f} | "
              f"{med([e - load for e, load in zip(r['e2e'], engines_load(r))]):.2f} | "
              f"{1000 * med(r['loop_cpu']):.0f} ms | {_ms(r['step'])} / {_ms(r['step_cpu'])} ms | "
              f"{sum(r['over'])} / {sum(r['over_cpu'])} | {_ms(r['idle_step'])} / {_ms(r['idle_step_cpu'])} ms | "
              f"{_ms(r['lag'])} / {_ms(r['busy'])} / {_ms(r['gc'])} ms | "
              f"{left} ({r['reclaimed']} reclaimed, failed clean: {r['failed_clean']}) |")
    print()
    print(f"Bars (issue 44, item 4; they apply to --full on 16 cores): publish() <= {PUBLISH_BAR} s, "
          f"longest loop step <= {1000 * STEP_BAR:.0f} ms (wall)")
    for r in results:
        e2e, step = med(r["e2e"]), max(r["step"])
        print(f"  {NAMES[r['kind']]}: publish() median {e2e:.3f} s, max {max(r['e2e']):.3f} s: "
              f"{'met' if e2e <= PUBLISH_BAR else 'NOT met'}; longest step {1000 * step:.1f} ms "
              f"(CPU {1000 * max(r['step_cpu']):.1f} ms): {'met' if step <= STEP_BAR else 'NOT met'}")
    print()
    for r in results:
        print(f"{label}{r['kind']}: MB/s runs {[round(x) for x in r['mbps']]}, raw runs {[round(x) for x in r['raw']]}, "
              f"publish s {[round(x, 3) for x in r['e2e']]}, stalls ms {[round(1000 * x, 1) for x in r['lag']]}, "
              f"busy ms {[round(1000 * x, 1) for x in r['busy']]}, loop CPU ms {[round(1000 * x) for x in r['loop_cpu']]}, "
              f"longest step ms {[round(1000 * x, 1) for x in r['step']]} (CPU {[round(1000 * x, 1) for x in r['step_cpu']]}), "
              f"idle control's longest step ms {[round(1000 * x, 1) for x in r['idle_step']]}")
        for i, phases in enumerate(r["phases"]):
            print(f"  {r['kind']} publication {i}: phases s {phases}; engines {r['engine_phases'][i]}")
            print(f"    longest step {1000 * r['step'][i]:.1f} ms: {r['step_what'][i]}")
            print(f"    longest CPU step {1000 * r['step_cpu'][i]:.1f} ms: {r['step_cpu_what'][i]}")


def engines_load(r: dict) -> list[float]:
    """Each publication's slowest engine load (the engines load at once): the engine's own work,
    SGLang's in production, the contract double's here."""
    return [max((p.get("end.load", 0.0) for p in phases.values()), default=0.0) for phases in r["engine_phases"]]


def side_by_side(paths: list[str]) -> None:
    """Per transport, one row per label: the publications of every run file with that ``--label``
    together (run them alternately, so that both labels meet the same machine)."""
    merged: dict[str, dict[str, dict]] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for r in run["results"]:
            into = merged.setdefault(run["label"], {}).setdefault(r["kind"], {"stashes_left": [], "shm_left": []})
            for key, value in r.items():
                if isinstance(value, list):
                    into.setdefault(key, []).extend(value)
    med = statistics.median
    labels = list(merged)
    kinds = list(dict.fromkeys(k for label in labels for k in merged[label]))
    print("| transport | run | publications | publish() s: median / min / max | transfer s: median "
          "| end s: median | engines' load s: median | publish() less the engines' load s: median / max "
          "| longest loop step ms: wall / CPU | steps > 5 ms: wall / CPU | control (idle loop): longest step ms "
          "| stashes and files left |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        for label in labels:
            r = merged[label].get(kind)
            if r is None:
                continue
            rest = [e - load for e, load in zip(r["e2e"], engines_load(r))]
            print(f"| {NAMES[kind]} | {label} | {len(r['e2e'])} | {med(r['e2e']):.3f} / {min(r['e2e']):.3f} / "
                  f"{max(r['e2e']):.3f} | {med(r['transfer']):.3f} | {med(r['end']):.3f} | "
                  f"{med(engines_load(r)):.3f} | {med(rest):.3f} / {max(rest):.3f} | "
                  f"{_ms(r['step'])} / {_ms(r['step_cpu'])} | {sum(r['over'])} / {sum(r['over_cpu'])} | "
                  f"{_ms(r['idle_step'])} | {len(r['stashes_left']) + len(r['shm_left'])} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="all 36 layers: the 349 MB adapter")
    parser.add_argument("--layers", type=int, default=4, help="layers of Qwen3-8B in the adapter (default 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket cap in MiB (lorapub's default: 64)")
    parser.add_argument("--transports", default="http,http-loop,shm,shm-dir,gloo")
    parser.add_argument("--src", default=SRC, help="the lorapub source to measure (default: this checkout's src)")
    parser.add_argument("--label", default="", help="names this run in --json and --side-by-side")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--side-by-side", nargs="+", metavar="JSON", help="print the runs of these --json files "
                        "side by side, transport by transport, and exit")
    args = parser.parse_args()
    if args.side_by_side:
        side_by_side(args.side_by_side)
        return
    layers = LAYERS if args.full else args.layers
    state_dict = await asyncio.to_thread(qwen3_8b_lora, layers, 0)
    size = sum(t.numel() * t.element_size() for t in state_dict.values())
    print(f"adapter: Qwen3-8B LoRA r={RANK}, {layers} layers, {len(state_dict)} bf16 tensors, {size:,} bytes; "
          f"2 engines in their own processes; median of {args.repeat}; lorapub from {args.src}; "
          f"{os.cpu_count()} CPUs")
    results = []
    with tempfile.TemporaryDirectory(prefix="lorapub-bench-") as workdir:
        for kind in args.transports.split(","):
            results.append(await bench_transport(kind, state_dict, args, workdir))
    print_results(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label or args.src, "src": args.src, "bytes": size, "layers": layers,
                       "repeat": args.repeat, "cpus": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
