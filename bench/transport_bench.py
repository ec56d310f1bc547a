"""Transport throughput: adapter bytes into two engines that stage them inside themselves.

    python3 bench/transport_bench.py            # short: 4 of Qwen3-8B's 36 layers (~39 MB), 3 runs
    python3 bench/transport_bench.py --full     # the whole 349 MB adapter (504 bf16 tensors)

The adapter is Qwen3-8B's LoRA at r=64 on all seven linear modules of every layer (q/k/v/o,
gate/up/down: 14 bf16 tensors a layer, 504 for 36 layers, 349,175,808 bytes), seeded tensors.
Two engines (lorapub's contract double running lorapub's engine-side staging, each in a process
of its own: ``python -m lorapub.testing.serve_double``) receive every publication; fresh engines
for each transport. For each transport the figure is adapter bytes / the publication's transfer
phase (first bucket sent to last bucket stored and verified on both engines), median of
``--repeat`` publications, next to the raw limit measured in the same run between the same
processes: the same buckets as plain HTTP POSTs into a discarding route (HTTP bytes), through
/dev/shm files copied by the engines (same-host IPC), as raw gloo broadcasts (torch.distributed).
Beside it, the whole publication: ``Deployment.publish()`` called to its return (the version
committed on READY receipts from both engines: begin, transfer, the engines' verification and load,
commit), median and minimum of the ``--repeat`` publications, with every phase's time.

Publisher side, during every publication: peak RSS growth over the frozen snapshot (copies of the
bytes beyond the snapshot itself; the snapshot is copy 1), bytes run through SHA-256 in this
process from the trainer's tensors to the commit (the snapshot's one pass), how the caller's event
loop fared (its thread's CPU time per publication, the longest single step it ran, wall and CPU,
and a 1 ms sleeper's worst lateness: see ``LoopLag``), and whether every engine freed every stash
of a RECLAIMED version and of a FAILED_CLEAN one. ``http-loop`` is HTTP bytes posted on the
caller's loop (``HTTPBytes(sender="loop")``), beside the default sender thread.
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
sys.path.insert(0, os.path.join(REPO, "src"))

import aiohttp  # noqa: E402

from lorapub.adapters.sglang_wire import HTTPBytes, RawBucket, SameHostIPC, SGLangWireEngine, TorchDistributed  # noqa: E402
from lorapub.runtime.deployment import Deployment  # noqa: E402
from lorapub.runtime.publisher import PublicationFailed  # noqa: E402
from lorapub.runtime.runner import Deadlines  # noqa: E402
from lorapub.runtime.snapshot import Snapshot  # noqa: E402

HIDDEN, INTER, KV, RANK, LAYERS = 4096, 12288, 1024, 64, 36
MODULES = {  # Qwen3-8B: module -> (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}
MB = 1e6


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
class LoopLag:
    """How this event loop fared during a publication:

    * ``worst``: the lateness of a task asking for 1 ms sleeps (wall clock: whatever kept the loop
      from running it, this process's code or the OS running other processes on the machine's
      cores, or another thread holding the GIL), with ``busy``, the CPU time the loop's thread
      spent in that same interval (the kernel's loopback TCP work counts there too);
    * ``step`` / ``step_cpu``: the longest single step the loop ran (one callback or task step:
      the time it held the loop, wall and CPU; asyncio's own slow-callback measure);
    * ``cpu``: all the CPU time the loop's thread spent from the publication's call to its return
      (lorapub's work on the caller's loop, the socket sends it makes there included);
    * ``gc``: the longest garbage-collector pause.
    """

    def __init__(self) -> None:
        self.worst = self.busy = self.gc = self.step = self.step_cpu = self.cpu = 0.0
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
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return run(handle)
            finally:
                lag.step = max(lag.step, time.perf_counter() - wall)
                lag.step_cpu = max(lag.step_cpu, time.thread_time() - cpu)

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
            p for p in (os.path.join(REPO, "src"), os.environ.get("PYTHONPATH")) if p)}
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
    out = {"kind": kind, "mbps": [], "raw": [], "lag": [], "busy": [], "gc": [], "step": [], "step_cpu": [], "loop_cpu": [], "copies": [], "hashed": [], "end": [],
           "e2e": [], "phases": []}
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
                out["mbps"].append(size / report.phases["transfer"] / MB)
                out["end"].append(report.phases.get("end", 0.0))
                out["e2e"].append(e2e)
                out["phases"].append({k: round(v, 3) for k, v in report.phases.items()})
                out["lag"].append(lag.worst)
                out["busy"].append(lag.busy)
                out["gc"].append(lag.gc)
                out["step"].append(lag.step)
                out["step_cpu"].append(lag.step_cpu)
                out["loop_cpu"].append(lag.cpu)
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


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="all 36 layers: the 349 MB adapter")
    parser.add_argument("--layers", type=int, default=4, help="layers of Qwen3-8B in the adapter (default 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64, help="bucket cap in MiB (lorapub's default: 64)")
    parser.add_argument("--transports", default="http,http-loop,shm,shm-dir,gloo")
    args = parser.parse_args()
    layers = LAYERS if args.full else args.layers
    state_dict = await asyncio.to_thread(qwen3_8b_lora, layers, 0)
    size = sum(t.numel() * t.element_size() for t in state_dict.values())
    print(f"adapter: Qwen3-8B LoRA r={RANK}, {layers} layers, {len(state_dict)} bf16 tensors, {size:,} bytes; "
          f"2 engines in their own processes; median of {args.repeat}")
    results = []
    with tempfile.TemporaryDirectory(prefix="lorapub-bench-") as workdir:
        for kind in args.transports.split(","):
            results.append(await bench_transport(kind, state_dict, args, workdir))
    med = statistics.median
    print()
    print("| transport | MB/s | raw limit MB/s | MB/s / raw | source copies (peak) | SHA-256 passes (source) "
          "| publish() to committed READY on both engines s: median / min | end (load) s "
          "| caller's loop: CPU per publication | longest loop step: wall / CPU | 1 ms sleeper late: wall / busy / gc "
          "| stashes left (RECLAIMED, FAILED_CLEAN) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    names = {"http": "HTTP bytes", "http-loop": "HTTP bytes, posted on the caller's loop", "shm": "same-host IPC (/dev/shm, tensor load)",
             "shm-dir": "same-host IPC (/dev/shm, folder load)", "gloo": "torch.distributed (gloo)"}
    for r in results:
        ratio = med(r["mbps"]) / med(r["raw"])
        left = len(r["stashes_left"]) + len(r["shm_left"])
        print(f"| {names[r['kind']]} | {med(r['mbps']):.0f} | {med(r['raw']):.0f} | {ratio:.2f} | "
              f"{max(r['copies']):.2f} | {max(r['hashed']):.2f} | {med(r['e2e']):.2f} / {min(r['e2e']):.2f} | {med(r['end']):.2f} | "
              f"{1000 * med(r['loop_cpu']):.0f} ms | {1000 * max(r['step']):.1f} / {1000 * max(r['step_cpu']):.1f} ms | "
              f"{1000 * max(r['lag']):.1f} / {1000 * max(r['busy']):.1f} / {1000 * max(r['gc']):.1f} ms | {left} ({r['reclaimed']} reclaimed, failed clean: {r['failed_clean']}) |")
    print()
    for r in results:
        print(f"{r['kind']}: MB/s runs {[round(x) for x in r['mbps']]}, raw runs {[round(x) for x in r['raw']]}, "
              f"publish s {[round(x, 2) for x in r['e2e']]}, stalls ms {[round(1000 * x, 1) for x in r['lag']]}, "
              f"busy ms {[round(1000 * x, 1) for x in r['busy']]}, loop CPU ms {[round(1000 * x) for x in r['loop_cpu']]}, "
              f"longest step ms {[round(1000 * x, 1) for x in r['step']]} (CPU {[round(1000 * x, 1) for x in r['step_cpu']]})")
        for i, phases in enumerate(r["phases"]):
            print(f"  {r['kind']} publication {i}: phases s {phases}")


if __name__ == "__main__":
    asyncio.run(main())
