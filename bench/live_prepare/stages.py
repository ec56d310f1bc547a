"""Where a preparation of a 264 MB adapter spends its time, in the helper process and beside it.

Live, the preparing helper process (docs/sglang-patch.md, "Prepared loads") took 4.6-12.1 s for the
4B shape's 264 MB bf16 r=64 adapter, about evenly between SGLang's processing and the cast and copy to
the device, where the same work took 123-386 ms (median 164) on the scheduler's preparing thread before the helper
existed (bench/results/2026-12-07-live-acceptance-elastic-areal-2). This bench takes the servers away
and times the same steps on an idle GPU, in this process and in a process spawned as the helper is,
so that the cause has a name:

* probes of the host: touching 264 MB of fresh memory (page faults), copying 264 MB already touched,
  touching the adapter's file through a copy-on-write mapping (what the helper's reader does), and
  264 MB host to device from pageable memory and through two pinned 32 MiB chunks (the helper's way);
* the helper's own steps, with SGLang's own LoRAConfig and LoRAAdapter: read (mapped, the helper's
  reader; or read into memory, safetensors' reader), SGLang's processing, pack (cast, copy to the
  device through the pinned chunks), each with torch's default thread count and with one thread, and
  last with glibc keeping freed memory in the heap (``helper.keep_freed_memory``, which the helper does
  at its start since this bench was written: a later load then reuses pages already touched);
* the helper itself (``HelperClient``: spawn, ready, prepare, open the handle, release), end to end;
* the adapter's slot image (``--only image``), for a pool of the shape's buffers: SGLang's own slot fill on
  this thread (the control: every load's image before 2026-12-07), the same fill recorded (a layout's first
  load since), the recorded plan's replay (what the helper now does for every later load) and the views the
  scheduler's process builds around the image the helper shipped, each plan-made image checked equal to the
  fill's;
* the publisher's side: ``lorapub.Snapshot`` of the adapter's torch tensors against the per-tensor copy and
  finiteness check on torch's intra-op pool it did before 2026-12-07 (live, a rollout process spent about
  24 s so beside two busy servers), with torch's default thread count and with one, on an idle host and
  (``--busy N``) beside N spinning cores.

Each variant runs ``--reps`` times (the first is cold); medians and every repetition are printed and
written to $OUT/stages.json with the process's CPU affinity, thread count and nice value. Run it through
run.sh on a GPU machine (the SGLang bundle in .sgl/, lorapub's wheels in .whl/)."""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from typing import Any

MB = 1 << 20
SHAPES = {  # the 4B shape of bench/live_online (264 MB), and a tiny one for the CPU test of this bench
    "4b": {"layers": 36, "hidden": 2560, "intermediate": 9728, "q": 4096, "kv": 1024, "rank": 64, "vocab": 151936},
    "tiny": {"layers": 2, "hidden": 64, "intermediate": 128, "q": 64, "kv": 32, "rank": 4, "vocab": 256},
}
SHAPE = dict(SHAPES["4b"])
#: "sglang": the installed release's LoRA classes; "tests:<root>": the SGLang tree at <root> compiled by the
#: tests' kit (tests/sglang_patch/sglang_lora.py), for the CPU test of this bench
CLASSES = os.environ.get("LORAPUB_STAGES_CLASSES", "sglang")


def sglang_classes() -> tuple[Any, Any]:
    """SGLang's LoRAAdapter and LoRAConfig (see CLASSES)."""
    if CLASSES.startswith("tests:"):
        from tests.sglang_patch import sglang_lora

        real = sglang_lora.release(CLASSES.removeprefix("tests:"))
        return real.LoRAAdapter, real.LoRAConfig
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    return LoRAAdapter, LoRAConfig
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(folder: str, seed: int = 0) -> str:
    """The 4B shape's r=64 bf16 PEFT adapter on every linear module (264 MB), seeded, never downloaded."""
    import torch
    from safetensors.torch import save_file

    s = SHAPE
    dims = {"q_proj": (s["hidden"], s["q"]), "k_proj": (s["hidden"], s["kv"]), "v_proj": (s["hidden"], s["kv"]),
            "o_proj": (s["q"], s["hidden"]), "gate_proj": (s["hidden"], s["intermediate"]),
            "up_proj": (s["hidden"], s["intermediate"]), "down_proj": (s["intermediate"], s["hidden"])}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(s["layers"]):
        for m in MODULES:
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{m}"
            fan_in, fan_out = dims[m]
            tensors[f"{key}.lora_A.weight"] = (torch.randn(s["rank"], fan_in, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, s["rank"], generator=g) * 0.01).to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": s["rank"], "lora_alpha": 2 * s["rank"], "target_modules": list(MODULES),
                   "bias": "none", "task_type": "CAUSAL_LM"}, f)
    return folder


def make_kit(device: str) -> Any:
    from lorapub.sglang_patch.prepared_load.helper import SGLANG_PROCESSOR, Kit

    s = SHAPE
    config = BaseConfig(s["layers"], s["hidden"], s["vocab"])
    if CLASSES.startswith("tests:"):
        return Kit(device=device, dtype="bfloat16", base_hf_config=config, base_vocab_size=s["vocab"],
                   processor="tests.sglang_patch.sglang_lora:process", options={"root": CLASSES.removeprefix("tests:")})
    from sglang.srt.configs.load_config import LoadConfig

    return Kit(device=device, dtype="bfloat16", base_hf_config=config, load_config=LoadConfig(),
               base_vocab_size=s["vocab"], processor=SGLANG_PROCESSOR)


class BaseConfig:
    """What SGLang's LoRAAdapter reads of the base model's config (picklable: the helper gets it)."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        self.num_hidden_layers, self.hidden_size, self.vocab_size = layers, hidden, vocab


def where() -> dict[str, Any]:
    import torch

    return {"pid": os.getpid(), "affinity": len(os.sched_getaffinity(0)), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "nice": os.nice(0)}


def ms(t0: float) -> float:
    return round(1e3 * (time.perf_counter() - t0), 1)


def probes(folder: str, device: str) -> dict[str, float]:
    """The host's costs, each on 264 MB (the adapter's size)."""
    import torch

    size = os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    fresh = torch.empty(size, dtype=torch.uint8)
    fresh.fill_(1)
    out["touch fresh memory"] = ms(t0)
    other = torch.empty_like(fresh)
    other.fill_(0)
    t0 = time.perf_counter()
    other.copy_(fresh)
    out["copy touched memory"] = ms(t0)
    with open(os.path.join(folder, "adapter_model.safetensors"), "rb", buffering=0) as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    t0 = time.perf_counter()
    other.copy_(torch.frombuffer(mapped, dtype=torch.uint8))
    out["copy from the mapped file"] = ms(t0)
    t0 = time.perf_counter()
    with open(os.path.join(folder, "adapter_model.safetensors"), "rb", buffering=0) as f:
        f.readinto(memoryview(other.numpy()))
    out["read the file into touched memory"] = ms(t0)
    if device.startswith("cuda"):
        dev = torch.device(device)
        on_device = torch.empty(size, dtype=torch.uint8, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        on_device.copy_(fresh)
        torch.cuda.synchronize()
        out["to device, pageable"] = ms(t0)
        chunks = [torch.empty(32 * MB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = torch.cuda.Stream(device=dev)
        t0 = time.perf_counter()
        events: list[Any] = [None, None]
        for k, base in enumerate(range(0, size, 32 * MB)):
            end = min(base + 32 * MB, size)
            if events[k % 2] is not None:
                events[k % 2].synchronize()
            chunks[k % 2][:end - base].copy_(fresh[base:end])
            with torch.cuda.stream(stream):
                on_device[base:end].copy_(chunks[k % 2][:end - base], non_blocking=True)
                events[k % 2] = torch.cuda.Event()
                events[k % 2].record(stream)
        stream.synchronize()
        out["to device, two pinned chunks"] = ms(t0)
        t0 = time.perf_counter()
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out["pin 264 MB"] = ms(t0)
        pinned.copy_(fresh)
        t0 = time.perf_counter()
        on_device.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        out["to device, from one pinned buffer"] = ms(t0)
    mapped.close()
    return out


def steps(folder: str, kit: Any, reader: str, threads: int | None) -> dict[str, float]:
    """The helper's preparation, step by step (SGLang's LoRAConfig and LoRAAdapter)."""
    import torch
    from safetensors.torch import load_file

    from lorapub.sglang_patch.prepared_load import helper
    from lorapub.sglang_patch.prepared_load.reading import read_peft_folder

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dev = torch.device(kit.device)
        chunks = stream = None
        if dev.type == "cuda":
            stream = torch.cuda.Stream(device=dev)
            chunks = [torch.empty(helper.CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        t0 = time.perf_counter()
        path = os.path.join(folder, "adapter_model.safetensors")
        tensors = read_peft_folder(folder) if reader == "mapped" else load_file(path)
        out = {"read": ms(t0)}
        LoRAAdapter, LoRAConfig = sglang_classes()
        t0 = time.perf_counter()
        config = LoRAConfig(folder, base_vocab_size=kit.base_vocab_size)
        adapter = LoRAAdapter("bench", config, kit.base_hf_config, kit.load_config, None, base_model=None)
        adapter.initialize_weights_from_tensors(tensors)
        out["SGLang's processing"] = ms(t0)
        t0 = time.perf_counter()
        buf, _, _ = helper.pack(adapter, torch.bfloat16, dev, stream, chunks)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out["cast and copy to the device"] = ms(t0)
        out["total"] = round(sum(out.values()), 1)
        del buf, adapter, tensors
        return out
    finally:
        torch.set_num_threads(before)


VARIANTS = (("mapped", None), ("mapped", 1), ("read", None), ("read", 1))


def measure(folder: str, device: str, reps: int) -> dict[str, Any]:
    """Everything above, in the calling process."""
    kit = make_kit(device)
    result: dict[str, Any] = {"where": where(), "probes": [], "steps": {}}
    tag = f"[pid {os.getpid()}]"  # each line as it is measured: a run stopped at its budget keeps what it did
    print(f"{tag} {result['where']}", flush=True)
    for _ in range(reps):
        result["probes"].append(probes(folder, device))
        print(f"{tag} probes: {result['probes'][-1]}", flush=True)
    for reader, threads in VARIANTS:
        name = f"reader {reader}, threads {threads or 'default'}"
        result["steps"][name] = []
        for _ in range(reps):
            result["steps"][name].append(steps(folder, kit, reader, threads))
            print(f"{tag} {name}: {result['steps'][name][-1]}", flush=True)
    from lorapub.sglang_patch.prepared_load.helper import keep_freed_memory

    if keep_freed_memory():  # last: it holds for the rest of the process (the helper does it at its start)
        name = "reader mapped, threads default, freed memory kept"
        result["steps"][name] = []
        for _ in range(reps):
            result["steps"][name].append(steps(folder, kit, "mapped", None))
            print(f"{tag} {name}: {result['steps'][name][-1]}", flush=True)
        result["probes, freed memory kept"] = []
        for _ in range(reps):
            result["probes, freed memory kept"].append(probes(folder, device))
            print(f"{tag} probes, freed memory kept: {result['probes, freed memory kept'][-1]}", flush=True)
    return result


def torch_pool_snapshot(tensors: dict[str, Any]) -> None:
    """The control: what ``Snapshot`` did per tensor until 2026-12-07, on torch's intra-op pool (a copy,
    a finiteness check), beside the same SHA-256 pass."""
    import hashlib

    import torch

    for t in tensors.values():
        frozen = torch.empty(tuple(t.shape), dtype=t.dtype).copy_(t)
        bool(torch.isfinite(frozen).all())
        hashlib.sha256(frozen.reshape(-1).view(torch.uint8).numpy().data).hexdigest()


def snapshots(folder: str, reps: int, threads_list: tuple[int | None, ...] = (None, 1)) -> dict[str, list[float]]:
    """The publisher's side: ``lorapub.Snapshot`` of the adapter's torch tensors against the control above,
    with torch's default thread count and with one (a trainer's process has whatever its framework set)."""
    import torch
    from safetensors.torch import load_file

    from lorapub.snapshot import Snapshot

    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    out: dict[str, list[float]] = {}
    before = torch.get_num_threads()
    try:
        for threads in threads_list:
            torch.set_num_threads(threads or before)
            for name, run in (("lorapub.Snapshot", lambda: Snapshot(tensors, config)),
                              ("control: per-tensor copy and check on torch's pool", lambda: torch_pool_snapshot(tensors))):
                key = f"{name}, threads {threads or 'default'}"
                out[key] = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    run()
                    out[key].append(ms(t0))
                print(f"[snapshot] {key}: {out[key]} ms", flush=True)
    finally:
        torch.set_num_threads(before)
    return out


def _spin() -> None:  # pragma: no cover - a busy core, until killed
    while True:
        pass


def busy_host(folder: str, device: str, reps: int, spinners: int) -> dict[str, Any]:
    """The helper's steps in this process while ``spinners`` processes keep as many cores busy, as a
    host serving decode batches has them (each scheduler thread, its tokenizer, the clients): torch's
    default thread count (one per core) against one thread, the scheduler process's count."""
    kit = make_kit(device)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, daemon=True) for _ in range(spinners)]
    for proc in procs:
        proc.start()
    result: dict[str, Any] = {"spinners": spinners, "where": where(), "steps": {}}
    try:
        time.sleep(1.0)  # the spinners running
        result["snapshots"] = snapshots(folder, reps)
        for threads in (None, 1):
            name = f"reader mapped, threads {threads or 'default'}, {spinners} cores busy"
            result["steps"][name] = []
            for _ in range(reps):
                result["steps"][name].append(steps(folder, kit, "mapped", threads))
                print(f"[busy] {name}: {result['steps'][name][-1]}", flush=True)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join(5)
    return result


def _child(conn: Any, folder: str, device: str, reps: int) -> None:
    try:
        conn.send(("ok", measure(folder, device, reps)))
    except Exception as e:  # noqa: BLE001 - reported by the parent
        conn.send(("failed", f"{type(e).__name__}: {e}"))


def spawned(folder: str, device: str, reps: int) -> dict[str, Any]:
    """``measure`` in a process started with ``spawn``, as the helper is."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=_child, args=(theirs, folder, device, reps), daemon=True)
    process.start()
    status, value = mine.recv()
    process.join(30)
    if status != "ok":
        raise RuntimeError(f"the spawned measurement failed: {value}")
    return value


def helper_end_to_end(folder: str, device: str, reps: int) -> dict[str, Any]:
    """The real helper: started, ready, then ``reps`` preparations, each opened and released."""
    from lorapub.sglang_patch.prepared_load.helper import HelperClient

    client = HelperClient(make_kit(device), deadline_s=120.0, start_s=300.0)
    t0 = time.perf_counter()
    client.start()
    prepared: list[dict[str, float]] = []
    try:
        for i in range(reps):
            job = client.new_job(type("Ref", (), {"lora_id": f"bench{i}", "lora_name": f"bench{i}",
                                                   "lora_path": folder})())
            t1 = time.perf_counter()
            shipped = client.prepare(job)
            waited = ms(t1)
            t2 = time.perf_counter()
            opened = client.open(shipped)
            del opened
            client.release(shipped.token, True)
            prepared.append({"prepare (as the scheduler waits)": waited, "open and release": ms(t2),
                             "helper: processing": round(1e3 * shipped.timings["process_s"], 1),
                             "helper: pack": round(1e3 * shipped.timings["pack_s"], 1),
                             "helper: CPU": round(1e3 * shipped.timings.get("cpu_s", float("nan")), 1),
                             "helper: threads": shipped.timings.get("threads", 0)})
            if i == 0:
                prepared[0]["start to first shipped"] = ms(t0)
            print(f"[helper] {prepared[-1]}", flush=True)
    finally:
        client.close()
    return {"prepared": prepared}


def sglang_pool_class() -> Any:
    """SGLang's LoRAMemoryPool (see CLASSES), whose slot fill the image part runs; its instances here get
    their buffers and attributes from :func:`shape_pool`, not from SGLang's constructor (no model)."""
    if CLASSES.startswith("tests:"):
        from tests.sglang_patch import sglang_lora

        return sglang_lora.pool_class(CLASSES.removeprefix("tests:"))
    from sglang.srt.lora.mem_pool import LoRAMemoryPool

    return LoRAMemoryPool


def shape_pool(device: Any, slots: int = 4) -> tuple[Any, list[dict[str, Any]]]:
    """A memory pool of the shape's buffers (max rank = the adapter's, bf16, ``slots`` slots) and the
    layers' LoRA modules, as SGLang's fill sees them for the adapter of :func:`build_adapter` (made by the
    tests' SGLang kit, which also serves the tests' pools)."""
    from tests.sglang_patch.sglang_lora import shaped_pool

    s = SHAPE
    modules = {"qkv_proj": (s["hidden"], s["q"] + 2 * s["kv"], 3), "o_proj": (s["q"], s["hidden"], 1),
               "gate_up_proj": (s["hidden"], 2 * s["intermediate"], 2), "down_proj": (s["intermediate"], s["hidden"], 1)}
    pool, lora_modules = shaped_pool(sglang_pool_class(), modules, layers=s["layers"], max_r=s["rank"], slots=slots,
                                     vocab=s["vocab"], device=device)
    return pool, lora_modules


def images(folder: str, device: str, reps: int) -> dict[str, list[dict[str, float]]]:
    """The adapter's slot image, made each way on this thread (wall and this thread's CPU time, ms):
    SGLang's own fill into a one-slot copy of the pool (the control: what every load ran on the
    scheduler's preparing thread before 2026-12-07), the same fill recorded (a layout's first load since),
    and from the plan: its replay (in the helper process, since) and the views the scheduler's process
    builds around the image the helper shipped (every later load; the first of them also makes the
    pool's slot views, cached after). Each plan-made image is checked equal to the fill's."""
    import torch

    from lorapub.sglang_patch.prepared_load import helper, slot_image
    from lorapub.sglang_patch.prepared_load.image_plan import replay
    from lorapub.sglang_patch.prepared_load.reading import read_peft_folder, weight_places

    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    kit = make_kit(device)
    LoRAAdapter, LoRAConfig = sglang_classes()
    config = LoRAConfig(folder, base_vocab_size=kit.base_vocab_size)
    adapter = LoRAAdapter("bench", config, kit.base_hf_config, kit.load_config, None, base_model=None)
    adapter.initialize_weights_from_tensors(read_peft_folder(folder))
    chunks = [torch.empty(helper.CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)] if on_cuda else None
    stream = torch.cuda.Stream(device=dev) if on_cuda else None

    def shipped(plans: Any = None) -> tuple[Any, Any, Any]:  # the hand-over: weights as views of one buffer
        buf, entries, spans = helper.pack(adapter, torch.bfloat16, dev, stream, chunks, plans)
        held = LoRAAdapter("bench", config, kit.base_hf_config, kit.load_config, None, base_model=None)
        places = dict(weight_places(held))
        for e in entries:
            places[e.where][e.name] = buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        return held, (buf, tuple(entries)), spans

    pool, modules = shape_pool(dev)
    manager = type("Manager", (), {"memory_pool": pool, "lora_modules": modules})()
    held, source, _ = shipped()
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in (
        "SGLang's fill (control)", "SGLang's fill, recorded", "the plan's replay (helper)", "views of the shipped image (scheduler)")}

    def timed(name: str, make: Any) -> Any:
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = make()
        sync()
        rows[name].append({"wall": ms(t0), "CPU": round(1e3 * (time.thread_time() - c0), 1)})
        return out

    plan = None
    for _ in range(reps):
        want = timed("SGLang's fill (control)", lambda: slot_image.build_slot_image(manager, held, stream))
        learned = timed("SGLang's fill, recorded", lambda: slot_image.build_slot_image(manager, held, stream, learn_from=source))
        plan = learned.plan
        if plan is None:
            raise SystemExit("no image plan was learned from SGLang's fill: the helper cannot make this layout's images")
        flats = [torch.zeros(n, dtype=getattr(torch, d), device=dev) for d, n in plan.flats]
        timed("the plan's replay (helper)", lambda: replay(plan, source[0], flats))
        _, (later, _), spans = shipped({plan.key: plan})
        made = timed("views of the shipped image (scheduler)",
                     lambda: slot_image.image_from_flats(pool, [span.of(later) for span in spans], plan))
        same = all(torch.equal(a, b) for a, b in zip(made.sources, want.sources))
        rows["views of the shipped image (scheduler)"][-1]["equal to the fill's"] = float(same)
        print(f"[image] {({k: v[-1] for k, v in rows.items()})}", flush=True)
    rows["plan"] = [{"ops": float(len(plan.ops)) if plan else 0.0, "image MB": round(sum(
        n * getattr(torch, d).itemsize for d, n in plan.flats) / 1e6, 1) if plan else 0.0}]
    return rows


def median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys()
    return {k: round(statistics.median(r[k] for r in rows if k in r), 1) for k in keys}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="4b")
    parser.add_argument("--folder", default=None, help="an adapter folder (default: build --shape's)")
    parser.add_argument("--busy", type=int, default=0,
                        help="also time the steps with this many cores kept busy by spinning processes")
    parser.add_argument("--only", default="",
                        help="comma-separated parts to run: snapshot,helper,image,this,busy,spawned (default all)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "stages.json"))
    args = parser.parse_args()
    SHAPE.update(SHAPES[args.shape])
    folder = args.folder or build_adapter(tempfile.mkdtemp(prefix="lorapub-stages-"))
    report: dict[str, Any] = {"folder": folder, "bytes": os.path.getsize(os.path.join(folder, "adapter_model.safetensors")),
                              "reps": args.reps, "device": args.device}
    print(f"adapter {report['bytes'] / 1e6:.0f} MB at {folder}; {args.reps} repetitions each (the first cold)", flush=True)
    parts = set(args.only.split(",")) if args.only else {"this", "spawned", "busy", "helper", "snapshot", "image"}
    if "snapshot" in parts:  # the publisher's side, on an idle host (``busy`` repeats it beside spinning cores)
        report["snapshots"] = snapshots(folder, args.reps)
    if "helper" in parts:  # first: the real helper as a server runs it, before anything else warms the host
        report["helper"] = helper_end_to_end(folder, args.device, args.reps)
    if "image" in parts:
        report["images"] = images(folder, args.device, args.reps)
    if "this" in parts:
        report["this process"] = measure(folder, args.device, args.reps)
    if "busy" in parts and args.busy:
        report["busy host"] = busy_host(folder, args.device, args.reps, args.busy)
    if "spawned" in parts:
        report["spawned"] = spawned(folder, args.device, args.reps)
    for place in ("this process", "busy host", "spawned"):
        if place not in report:
            continue
        r = report[place]
        print(f"\n== {place}: {r['where']}")
        for probe_set in ("probes", "probes, freed memory kept"):
            if probe_set in r:
                print(f"  -- {probe_set}")
                for k, v in median_rows(r[probe_set]).items():
                    print(f"  {k:<36} {v:>9.1f} ms   (each: {[p[k] for p in r[probe_set]]})")
        for name, rows in r["steps"].items():
            med = median_rows(rows)
            print(f"  {name:<36} " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()) + " ms (medians)")
            print(f"  {'':<36} totals: {[row['total'] for row in rows]}")
    for place, table in (("idle", report.get("snapshots", {})), ("busy", report.get("busy host", {}).get("snapshots", {}))):
        if table:
            print(f"\n== the publisher's snapshot of the adapter, {place} host (ms, each repetition):")
            for key, runs in table.items():
                print(f"  {key:<72} median {statistics.median(runs):>8.1f}   {runs}")
    if "images" in report:
        print("\n== the adapter's slot image, each way (ms on this thread: wall / CPU, each repetition):")
        for name, runs in report["images"].items():
            print(f"  {name:<44} " + "; ".join(", ".join(f"{k} {v:g}" for k, v in run.items()) for run in runs))
    print("\n== the helper (HelperClient), each preparation:")
    for row in report.get("helper", {}).get("prepared", []):
        print("  " + ", ".join(f"{k} {v:.0f} ms" for k, v in row.items()))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
