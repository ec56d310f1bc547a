"""Adapter loads that (almost) never stop decoding: SGLang's scheduler only swaps in a prepared adapter.

Stock SGLang (0.5.17 and 0.5.23) loads an adapter on the scheduler thread, so a load stops every
running decode twice: once while the scheduler reads the adapter into host memory (tens to hundreds
of ms for an adapter of a few hundred MB) and once at the first batch that uses it, which pins the
host tensors and copies them to the device before the forward pass.

With this patch the scheduler hands a folder load (``load_lora_adapter``, what lorapub's engine-side
staging and SGLang's ``/load_lora_adapter`` route send) to one background thread of its own process,
which

1. reads and normalises the adapter with SGLang's own code (``LoRAManager.load_lora_weights``, run
   against a private view of the manager, so no shared state is touched),
2. packs every tensor into fixed pinned chunks and copies them to one device buffer on a side stream,
3. with ``LORAPUB_SGLANG_SLOT_IMAGE=1``, builds the adapter's slot image from it: what SGLang's own
   per-weight slot fill would write into a memory-pool slot (:class:`SlotImage`); the weights then
   stay in host memory, as SGLang keeps them (a fill the image does not fit then pins them, as
   SGLang does). Opt-in: measured live in one run with the gate below (docs/gpu-acceptance.md).

Between its Python steps the thread waits while the scheduler thread launches a prefill batch
(:class:`PrefillGate`): a prefill's eager kernel launches otherwise wait for the GIL it holds.

The scheduler keeps running batches meanwhile. Each loop iteration it polls; a finished
preparation is installed by SGLang's own load path (config read, validation, bookkeeping, the
release's own follow-up such as 0.5.23's KV-event names), with the weights taken from the prepared
adapter instead of disk, and the stock reply goes to the tokenizer manager then. A batch that needs
the adapter in a slot fills it: from the image with one ``_foreach_copy_`` where there is one, else
with SGLang's own fill (device to device from the prepared weights when images are off).

A preparation that fails (unreadable folder, device memory) changes nothing: SGLang's own load then
runs as before and answers with its own error. Only single-GPU schedulers take this path (tp, pp and
dp of 1): with several ranks every rank would have to swap the adapter in on the same iteration;
they keep SGLang's own blocking load, as do tensor loads (``load_lora_adapter_from_tensors``).
``LORAPUB_SGLANG_PREPARE=0`` turns the path off. The cost: each adapter's weights (or its slot
image, one pool slot) stay on the device until it is unloaded.

Both forms of lorapub's patch install this the same way: the runtime form starts SGLang's
schedulers through :func:`run_scheduler_process`, the diff form calls :func:`install` at the end of
SGLang's ``scheduler.py``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from lorapub.wire.dtypes import SAFETENSORS_DTYPES

logger = logging.getLogger(__name__)

ENV = "LORAPUB_SGLANG_PREPARE"
MARK = "__lorapub_prepared_load__"
_ALIGN = 256  # every tensor's view starts on a 256-byte boundary of the shared buffers
#: Host-to-device copies go through two pinned chunks of this size (double-buffered).
CHUNK_BYTES = 32 << 20
#: "1": log every garbage collection of 5 ms or more, the scheduler's loop iterations while a preparation
#: runs (beside as long a stretch before it), and each memory-pool slot fill, with their times.
TRACE_ENV = "LORAPUB_SGLANG_PREPARE_TRACE"
#: GIL switch interval (microseconds) while a preparation runs; unset: the interpreter's own (5 ms).
#: Measured live as worse than the default; kept to reproduce that measurement.
SWITCH_ENV = "LORAPUB_SGLANG_PREPARE_SWITCH_US"
#: "1": build each adapter's slot image while preparing (off by default: see docs/sglang-patch.md).
IMAGE_ENV = "LORAPUB_SGLANG_SLOT_IMAGE"
#: "0": the preparing thread does not step aside while the scheduler runs a prefill batch (see PrefillGate).
GATE_ENV = "LORAPUB_SGLANG_PREPARE_GATE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class PrefillGate:
    """Keeps the preparing thread's Python off the GIL while the scheduler thread runs a prefill batch.

    A prefill (extend) batch runs eagerly: the scheduler thread launches hundreds of kernels, dropping
    and retaking the GIL around each. A thread running Python beside it takes the GIL at every drop and
    keeps it until its own next blocking call or the switch interval (5 ms), so the prefill's launches
    wait on it: live, the longest scheduler iterations while preparing were 76-100 ms against 61-72 ms
    before, and those long iterations are prefills. Decode batches replay CUDA graphs and leave the
    GIL free while the GPU works, so preparing beside them costs nothing visible.

    The scheduler thread closes the gate when it launches an extend batch and opens it at its next loop
    iteration; the preparing thread calls :meth:`step` between its Python steps (each tensor it reads,
    hands to SGLang's processing, casts or copies) and waits there while the gate is closed. It never
    waits longer than ``max_wait_s`` at a time, and after such a wait runs ``slice_s`` of steps before
    it looks again; once one preparation has waited ``budget_s`` in all it stops waiting, so a
    scheduler that prefills back to back delays a load by at most that much.
    """

    def __init__(self, enabled: bool = True, max_wait_s: float = 0.1, slice_s: float = 0.005,
                 budget_s: float = 1.0) -> None:
        self.enabled = enabled
        self.max_wait_s, self.slice_s, self.budget_s = max_wait_s, slice_s, budget_s
        self._open = threading.Event()
        self._open.set()
        self._free_until = 0.0  # after a wait that timed out: steps run without looking until then
        self.waits = 0  # steps that found the gate closed, this preparation
        self.waited_s = 0.0
        self.timeouts = 0

    # scheduler thread
    def close(self) -> None:
        if self.enabled:
            self._open.clear()

    def open(self) -> None:
        if not self._open.is_set():  # every loop iteration calls this: set() takes the event's lock
            self._open.set()

    # preparing thread
    def step(self) -> None:
        if self._open.is_set() or not self.enabled:
            return
        now = time.perf_counter()
        if now < self._free_until or self.waited_s >= self.budget_s:
            return
        opened = self._open.wait(min(self.max_wait_s, self.budget_s - self.waited_s))
        after = time.perf_counter()
        self.waits += 1
        self.waited_s += after - now
        if not opened:
            self.timeouts += 1
            self._free_until = after + self.slice_s

    def reset(self) -> str:
        """This preparation's waits, for the log line; the counters start again."""
        told = f"{self.waits} waits for prefills, {1e3 * self.waited_s:.0f} ms, {self.timeouts} timed out"
        if self.waited_s >= self.budget_s:
            told += ", budget spent"
        self.waits, self.waited_s, self.timeouts, self._free_until = 0, 0.0, 0, 0.0
        return told


class _Stepped(dict):
    """The tensors handed to SGLang's ``initialize_weights_from_tensors``, which walks ``items()``:
    each tensor is handed over after one step of the gate."""

    def __init__(self, tensors: dict, step: Callable[[], None]) -> None:
        super().__init__(tensors)
        self._step = step

    def items(self):  # type: ignore[override]
        for item in super().items():
            self._step()
            yield item


class Preparer:
    """One scheduler's preparations, in the order their loads arrived (one worker thread)."""

    def __init__(self, scheduler: Any, manager: Any) -> None:
        import torch

        self.scheduler = scheduler
        self.manager = manager
        self.device = manager.device
        self.on_cuda = getattr(self.device, "type", self.device) == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorapub-prepare",
                                                          initializer=_lower_priority)
        # (request, its preparation, the stock load, when it was submitted)
        self.pending: list[tuple[Any, concurrent.futures.Future, Callable[..., Any], float]] = []
        self.chunks: list[Any] | None = None
        if self.on_cuda:  # before any batch runs (see _chunks)
            self._chunks()
        self.trace = os.environ.get(TRACE_ENV) == "1"
        self.ticks: collections.deque = collections.deque(maxlen=8192)  # perf_counter at each iteration's end
        if self.trace:
            _trace_gc()
        self.switch_s = _switch_interval()
        self.saved_switch: float | None = None
        self.slot_images = os.environ.get(IMAGE_ENV) == "1"
        self.gate = PrefillGate(enabled=os.environ.get(GATE_ENV, "1") != "0")

    def tick(self) -> None:
        """One scheduler loop iteration ended (trace only)."""
        self.ticks.append(time.perf_counter())

    # -- scheduler thread ------------------------------------------------------------------------
    def submit(self, recv_req: Any, stock: Callable[..., Any]) -> bool:
        """Take ``recv_req`` (its reply comes later from :meth:`poll`); False: load it the stock way."""
        lora_id = getattr(recv_req, "lora_id", None)
        if lora_id is None or lora_id in self.manager.loras or any(p[0].lora_id == lora_id for p in self.pending):
            return False
        ref = recv_req.to_ref()
        if self.switch_s is not None and self.saved_switch is None:
            self.saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_s)
        self.pending.append((recv_req, self.pool.submit(self._prepare, ref), stock, time.perf_counter()))
        return True

    def batch_started(self, batch: Any) -> None:
        """The scheduler thread launches ``batch``: a prefill closes the gate while a preparation runs."""
        if self.pending and _is_extend(batch):
            self.gate.close()

    def poll(self) -> None:
        """Install every finished preparation, in arrival order, and send its reply."""
        self.gate.open()  # a new loop iteration: the last batch is launched
        while self.pending and self.pending[0][1].done():
            recv_req, future, stock, submitted = self.pending.pop(0)
            if not self.pending and self.saved_switch is not None:
                sys.setswitchinterval(self.saved_switch)
                self.saved_switch = None
            if self.trace:
                self._log_iterations(recv_req.lora_name, submitted)
            t0 = time.perf_counter()
            prepared = self.manager.__dict__.setdefault("_lorapub_prepared", {})
            try:
                prepared[recv_req.lora_id] = future.result()
            except Exception as e:  # SGLang's own load runs instead and answers with its own error
                logger.warning("lorapub: preparing %s failed (%s); loading it on the scheduler thread",
                               recv_req.lora_name, e)
            t_load = time.perf_counter()
            try:
                output = stock(self.scheduler, recv_req)
            finally:
                prepared.pop(recv_req.lora_id, None)
            t_sent = time.perf_counter()
            _send(self.scheduler, output, recv_req)
            if self.trace:  # where an install's time goes: taking the result, SGLang's own load, the reply
                t1 = time.perf_counter()
                logger.info("lorapub trace: installed %s on the scheduler thread in %.1f ms (result %.1f ms, "
                            "SGLang's load %.1f ms, reply %.1f ms) at %.3f", recv_req.lora_name, 1e3 * (t1 - t0),
                            1e3 * (t_load - t0), 1e3 * (t_sent - t_load), 1e3 * (t1 - t_sent), time.time())

    def _log_iterations(self, name: str, since: float) -> None:
        """The scheduler's loop iterations while ``name`` was prepared, beside as long a stretch before."""
        now = time.perf_counter()
        span = now - since

        ends = list(self.ticks)

        def stats(lo: float, hi: float) -> str:  # the iterations that ended in (lo, hi]
            its = sorted(t - prev for prev, t in zip(ends, ends[1:]) if lo < t <= hi)
            if not its:
                return "none"
            return (f"n={len(its)} max {1e3 * its[-1]:.1f} ms p90 {1e3 * its[int(0.9 * (len(its) - 1))]:.1f} ms "
                    f"p50 {1e3 * its[len(its) // 2]:.1f} ms")

        logger.info("lorapub trace: scheduler iterations while preparing %s (%.0f ms): %s; before: %s",
                    name, 1e3 * span, stats(since, now), stats(since - span, since))

    # -- preparing thread --------------------------------------------------------------------------
    def read_config(self, ref: Any) -> Any:
        from sglang.srt.lora.lora_config import LoRAConfig

        return LoRAConfig(ref.lora_path, base_vocab_size=self.manager.base_hf_config.vocab_size)

    def _prepare(self, ref: Any) -> Any:
        self.gate.reset()  # a failed preparation's waits are not the next one's
        t0 = time.perf_counter()
        manager = self.manager
        view = copy.copy(manager)  # SGLang's own reading code, against private dicts
        view.configs = {ref.lora_id: self.read_config(ref)}
        view.loras = {}
        step = self.gate.step
        tensors = read_peft_folder(ref.lora_path, step)
        t_bytes = time.perf_counter()
        if tensors is None:  # not a plain PEFT folder: SGLang's own reader
            type(manager).load_lora_weights.__wrapped__(view, ref)
        else:  # the bytes read with the GIL released, then SGLang's own processing of them, a tensor a step
            type(manager).load_lora_weights_from_tensors(view, ref, _Stepped(tensors, step))
        adapter = view.loras[ref.lora_id]
        t1 = time.perf_counter()
        if not self.on_cuda:  # host-only engines (tests): the read is what moves off the scheduler
            logger.info("lorapub: prepared %s off the scheduler thread in %.0f ms (%s)", ref.lora_name,
                        1e3 * (t1 - t0), self.gate.reset())
            return adapter
        host = [dict(d) for d in _weight_dicts(adapter)] if self.slot_images else []
        moved = self._to_device(adapter)
        t2 = time.perf_counter()
        image = build_slot_image(manager, adapter, self.stream, self.gate.step) if self.slot_images else None
        if image is not None:  # the image serves every slot fill; the weights stay in host memory, as SGLang keeps them
            for d, h in zip(_weight_dicts(adapter), host):
                d.update(h)
            adapter.__dict__[IMAGE_ATTR] = image
        t3 = time.perf_counter()
        logger.info("lorapub: prepared %s off the scheduler thread in %.0f ms (read %.0f ms of which bytes %.0f ms, "
                    "to device %.0f ms, slot image %.0f ms, %.0f MB; %s) at %.3f", ref.lora_name, 1e3 * (t3 - t0),
                    1e3 * (t1 - t0), 1e3 * (t_bytes - t0), 1e3 * (t2 - t1),
                    1e3 * (t3 - t2) if image is not None else float("nan"), moved / 1e6, self.gate.reset(),
                    time.time())
        return adapter

    def _to_device(self, adapter: Any) -> int:
        """Every tensor of ``adapter`` into one device buffer, through the fixed pinned chunks; returns bytes."""
        import torch

        pool_dtype = getattr(self.manager, "dtype", None)
        slots, spans, total = [], [], 0
        step = self.gate.step
        for d in _weight_dicts(adapter):
            for name, t in d.items():
                step()
                if isinstance(pool_dtype, torch.dtype) and t.is_floating_point() and t.dtype != pool_dtype:
                    # the pool holds pool_dtype: cast once here, rounding to nearest even as the device cast would
                    t = t.to(pool_dtype)
                t = t.contiguous()
                size = t.numel() * t.element_size()
                slots.append((d, name, t))
                spans.append((total, size))
                total += -(-size // _ALIGN) * _ALIGN
        if total == 0:
            return 0
        # Device blocks freed by an earlier unload return to this stream's pool: wait for every
        # kernel queued before this preparation, so none can still read what this copy overwrites.
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        chunks = self._chunks()
        pending: list[Any] = [None] * len(chunks)
        k, i = 0, 0
        for base in range(0, total, CHUNK_BYTES):
            end = min(base + CHUNK_BYTES, total)
            if pending[k] is not None:
                pending[k].synchronize()  # the chunk's previous copy has left it
            chunk = chunks[k]
            while i < len(slots) and spans[i][0] < end:  # every tensor byte range overlapping [base, end)
                step()
                start, size = spans[i]
                lo, hi = max(start, base), min(start + size, end)
                if hi > lo:
                    flat = slots[i][2].reshape(-1).view(torch.uint8)
                    chunk[lo - base:hi - base].copy_(flat[lo - start:hi - start])
                if start + size > end:
                    break  # the rest of this tensor goes into the next chunk
                i += 1
            with torch.cuda.stream(self.stream):
                dev[base:end].copy_(chunk[:end - base], non_blocking=True)
                pending[k] = torch.cuda.Event()
                pending[k].record(self.stream)
            k = (k + 1) % len(chunks)
        self.stream.synchronize()
        for (d, name, t), (start, size) in zip(slots, spans):
            d[name] = dev[start:start + size].view(t.dtype).view(t.shape)
        return total

    def _chunks(self) -> list[Any]:
        """Two pinned chunks, allocated once per scheduler: pinning host memory stalls the whole
        process's CUDA calls, so it must not happen while batches run."""
        if self.chunks is None:
            import torch

            self.chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self.chunks


#: The memory pool's per-slot buffers (slot first), as both supported releases name them.
SLOT_BUFFERS = ("A_buffer", "B_buffer", "embedding_A_buffer", "embedding_B_buffer", "lm_head_A_buffer",
                "lm_head_B_buffer", "new_embeddings_buffer")
IMAGE_ATTR = "_lorapub_slot_image"


def _slot_buffers(pool: Any) -> list[Any] | None:
    """Every tensor of ``pool`` that has one row per slot, in a fixed order; None for another layout."""
    import torch

    slots = getattr(pool, "max_loras_per_batch", None)
    found = []
    for attr in SLOT_BUFFERS:
        buffers = getattr(pool, attr, None)
        if not isinstance(buffers, dict):
            return None
        for value in buffers.values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != slots:
                    return None
                found.append(t)
    return found


class SlotImage:
    """What SGLang's first batch writes into a memory-pool slot for one adapter, on the device (zeros
    where that fill leaves the slot's earlier contents: past the rank, and modules a layer lacks).

    Built off the scheduler thread by running SGLang's own ``load_lora_weight_to_buffer`` against a copy
    of the pool whose buffers have a single slot; a fill is then one ``torch._foreach_copy_`` from the
    image into the slot (a few hundred microseconds on the scheduler thread instead of the tens of
    milliseconds SGLang's per-weight Python takes)."""

    def __init__(self, pool: Any, buffers: list[Any], flats: list[Any], sources: list[Any]) -> None:
        self.pool, self.flats, self.sources, self.buffers = pool, flats, sources, buffers
        self.views = [[b[slot] for b in buffers] for slot in range(buffers[0].shape[0])]  # made once, here

    def fits(self, pool: Any, buffer_id: int) -> bool:
        """Still the pool, and every one of the very buffers, this image was made for."""
        if pool is not self.pool or not 0 <= buffer_id < len(self.views):
            return False
        current = _slot_buffers(pool)  # one walk of a few hundred references, at an adapter's first batch
        return current is not None and len(current) == len(self.buffers) and all(
            a is b for a, b in zip(current, self.buffers))

    def fill(self, buffer_id: int) -> None:
        import torch

        torch._foreach_copy_(self.views[buffer_id], self.sources, non_blocking=True)
        if self.flats[0].device.type == "cuda":  # an unload must not hand the image's blocks out while this copy reads them
            stream = torch.cuda.current_stream(self.flats[0].device)
            for flat in self.flats:
                flat.record_stream(stream)


class _SteppedLayers(list):
    """An adapter's layers as SGLang's slot fill walks them: one gate step per layer it takes."""

    def __init__(self, layers: Any, step: Callable[[], None]) -> None:
        super().__init__(layers)
        self._step = step

    def __getitem__(self, index: Any) -> Any:
        self._step()
        return super().__getitem__(index)

    def __iter__(self):  # type: ignore[override]
        for layer in super().__iter__():
            self._step()
            yield layer


class _SteppedAdapter:
    """``adapter`` as SGLang's slot fill reads it, with :class:`_SteppedLayers`; all else is the adapter's."""

    def __init__(self, adapter: Any, step: Callable[[], None]) -> None:
        self._adapter = adapter
        self.layers = _SteppedLayers(adapter.layers, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)


def build_slot_image(manager: Any, adapter: Any, stream: Any = None,
                     step: Callable[[], None] | None = None) -> SlotImage | None:
    """``adapter``'s slot image for ``manager``'s memory pool, or None (the pool's layout is not known,
    or SGLang's own fill refused the adapter: its first batch then runs SGLang's fill, as stock).
    ``step`` is called before each layer SGLang's fill takes, on each of its walks over the layers
    (the preparing thread's gate)."""
    import contextlib

    import torch

    pool = getattr(manager, "memory_pool", None)
    buffers = _slot_buffers(pool) if pool is not None else None
    if not buffers:
        return None
    stock = type(pool).load_lora_weight_to_buffer
    while getattr(stock, MARK, False):  # SGLang's own fill, under lorapub's wrappers
        stock = stock.__wrapped__
    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    try:
        with context:
            by_dtype: dict[Any, list[Any]] = {}
            for b in buffers:
                by_dtype.setdefault(b.dtype, []).append(b)
            flats = {dtype: torch.zeros(sum(b[0].numel() for b in group), dtype=dtype, device=group[0].device)
                     for dtype, group in by_dtype.items()}
            offsets = dict.fromkeys(flats, 0)
            images = []
            for b in buffers:
                n, at = b[0].numel(), offsets[b.dtype]
                images.append(flats[b.dtype][at:at + n].view((1, *b.shape[1:])))
                offsets[b.dtype] = at + n
            scratch = copy.copy(pool)  # SGLang's own fill, writing slot 0 of one-slot buffers
            it = iter(images)
            for attr in SLOT_BUFFERS:
                setattr(scratch, attr, {k: type(v)(next(it) for _ in v) if isinstance(v, (list, tuple)) else next(it)
                                        for k, v in getattr(pool, attr).items()})
            scratch.pin_memory_available = False  # pinning here would stall the scheduler's CUDA calls
            read = adapter if step is None else _SteppedAdapter(adapter, step)
            stock(scratch, adapter.uid, 0, read, manager.lora_modules, getattr(manager, "embed_tokens_module", None),
                  getattr(manager, "lm_head_module", None))
        if stream is not None:
            stream.synchronize()
    except Exception as e:  # noqa: BLE001 - SGLang's own fill at the first batch reports it, as stock
        logger.info("lorapub: no slot image for %s (%s); its first batch fills the slot the stock way",
                    getattr(adapter, "uid", "?"), e)
        return None
    return SlotImage(pool, buffers, list(flats.values()), [im[0] for im in images])


def _install_slot_fill(pool_cls: Any) -> None:
    stock = pool_cls.load_lora_weight_to_buffer

    def load_lora_weight_to_buffer(self, uid, buffer_id, lora_adapter, *args, **kwargs):
        """SGLang's slot fill, served by the adapter's slot image when it has one for this pool."""
        image = getattr(lora_adapter, "__dict__", {}).get(IMAGE_ATTR) if lora_adapter is not None else None
        if image is not None and image.fits(self, buffer_id):
            return image.fill(buffer_id)
        return stock(self, uid, buffer_id, lora_adapter, *args, **kwargs)

    load_lora_weight_to_buffer.__wrapped__ = stock
    setattr(load_lora_weight_to_buffer, MARK, True)
    pool_cls.load_lora_weight_to_buffer = load_lora_weight_to_buffer


#: safetensors code -> torch dtype name, for the dtypes lorapub publishes (another folder's dtype: SGLang's reader)
_SAFETENSORS_DTYPES = {code: name for name, code in SAFETENSORS_DTYPES.items()}


def read_peft_folder(path: Any, step: Callable[[], None] | None = None) -> dict[str, Any] | None:
    """The tensors of a local PEFT folder holding one ``adapter_model.safetensors`` (and no other
    weight file), read into one host buffer with a single ``readinto`` (the GIL is released for the
    whole read; SGLang's reader copies tensor by tensor holding it), as views of that buffer.
    None for any other layout, which SGLang's own reader then handles."""
    import json

    import torch

    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if "adapter_model.safetensors" not in names or any(
            n != "adapter_model.safetensors" and (n.endswith((".safetensors", ".bin", ".pt")) or n.endswith(".index.json"))
            for n in names):
        return None
    with open(os.path.join(path, "adapter_model.safetensors"), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            return None
        header = json.loads(f.read(n))
        data = torch.empty(size - 8 - n, dtype=torch.uint8)
        view, got = memoryview(data.numpy()), 0
        while got < len(view):
            r = f.readinto(view[got:])
            if not r:
                return None
            got += r
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if step is not None:
            step()
        dtype = getattr(torch, _SAFETENSORS_DTYPES.get(meta.get("dtype"), ""), None)
        if not isinstance(dtype, torch.dtype):
            return None
        start, end = meta["data_offsets"]
        shape = meta["shape"]
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - start != count * itemsize or end > len(data):
            return None
        raw = data[start:end] if start % itemsize == 0 else data[start:end].clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors


def _is_extend(batch: Any) -> bool:
    mode = getattr(batch, "forward_mode", None)
    try:
        return bool(mode is not None and mode.is_extend())
    except Exception:  # noqa: BLE001 - a mode this release names otherwise: never gate on it
        return False


def _weight_dicts(adapter: Any) -> list[dict]:
    return [layer.weights for layer in adapter.layers] + [
        d for d in (getattr(adapter, "embedding_layers", None), getattr(adapter, "added_tokens_embeddings", None))
        if d]


def _trace_gc() -> None:
    import gc

    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            took = time.perf_counter() - started[0]
            if took >= 0.005:
                logger.info("lorapub trace: gc generation %s took %.1f ms at %.3f", info.get("generation"),
                            1e3 * took, time.time())

    gc.callbacks.append(callback)


def _trace_slot_fills(pool_cls: Any) -> None:
    """Log how long the scheduler thread spends filling a memory-pool slot (an adapter's first batch)."""
    stock = pool_cls.load_lora_weight_to_buffer

    def load_lora_weight_to_buffer(self, uid, buffer_id, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return stock(self, uid, buffer_id, *args, **kwargs)
        finally:
            logger.info("lorapub trace: slot %s filled with %s in %.1f ms at %.3f", buffer_id, uid,
                        1e3 * (time.perf_counter() - t0), time.time())

    load_lora_weight_to_buffer.__wrapped__ = stock
    setattr(load_lora_weight_to_buffer, MARK, True)
    pool_cls.load_lora_weight_to_buffer = load_lora_weight_to_buffer


def _switch_interval() -> float | None:
    """``SWITCH_ENV`` in seconds; None when unset or not a positive integer (logged)."""
    raw = os.environ.get(SWITCH_ENV)
    if not raw:
        return None
    try:
        us = int(raw)
    except ValueError:
        us = 0
    if us <= 0:
        logger.warning("lorapub: %s=%r is not a positive number of microseconds; ignored", SWITCH_ENV, raw)
        return None
    return us / 1e6


def _lower_priority() -> None:
    try:  # the preparing thread yields the CPU to the scheduler thread (Linux: per-thread nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _send(scheduler: Any, output: Any, recv_req: Any) -> None:
    send = getattr(scheduler, "send_control_output", None)  # 0.5.23
    if send is not None:
        send(output, recv_req)
    elif getattr(scheduler, "rust_server", None) is not None:  # 0.5.17, as process_input_requests does
        scheduler.rust_server.push_control_output(recv_req, output)
    else:
        scheduler.ipc_channels.send_to_tokenizer.send_output(output, recv_req)


def _preparer(scheduler: Any) -> Preparer | None:
    """This scheduler's preparer, or None where the stock load must run."""
    found = scheduler.__dict__.get("_lorapub_preparer", False)
    if found is not False:
        return found
    preparer = None
    try:
        manager = getattr(scheduler.tp_worker.model_runner, "lora_manager", None)
        args = scheduler.server_args
        single = all(int(getattr(args, k, 1) or 1) == 1 for k in ("tp_size", "pp_size", "dp_size"))
        if enabled() and single and manager is not None and getattr(manager.device, "type", manager.device) == "cuda":
            preparer = Preparer(scheduler, manager)
    except Exception as e:  # pragma: no cover - depends on the server's shape
        logger.warning("lorapub: adapter loads keep SGLang's own path (%s)", e)
    scheduler.__dict__["_lorapub_preparer"] = preparer
    return preparer


def install(scheduler_cls: Any = None, manager_cls: Any = None, pool_cls: Any = None) -> None:
    """Patch SGLang's Scheduler, LoRAManager and LoRAMemoryPool classes in this process. Idempotent."""
    if scheduler_cls is None:
        from sglang.srt.managers.scheduler import Scheduler as scheduler_cls
    if manager_cls is None:
        from sglang.srt.lora.lora_manager import LoRAManager as manager_cls
    if pool_cls is None:
        from sglang.srt.lora.mem_pool import LoRAMemoryPool as pool_cls
    if not getattr(pool_cls, MARK, False):  # opt-in: otherwise SGLang's own method, untouched
        if os.environ.get(IMAGE_ENV) == "1":
            _install_slot_fill(pool_cls)
        if os.environ.get(TRACE_ENV) == "1":
            _trace_slot_fills(pool_cls)
        setattr(pool_cls, MARK, True)
    if not getattr(manager_cls, MARK, False):
        _install_weights(manager_cls)
    if getattr(scheduler_cls, MARK, False):
        return
    stock_load = scheduler_cls.load_lora_adapter
    stock_process = scheduler_cls.process_input_requests

    def load_lora_adapter(self, recv_req):
        preparer = _preparer(self)
        if preparer is not None and preparer.submit(recv_req, stock_load):
            return None  # answered by poll() once the adapter is ready
        return stock_load(self, recv_req)

    def process_input_requests(self, recv_reqs):
        result = stock_process(self, recv_reqs)
        preparer = _preparer(self)  # made on the first loop iteration, before any batch runs
        if preparer:
            if preparer.trace:
                preparer.tick()
            preparer.poll()
        return result

    for fn, stock in ((load_lora_adapter, stock_load), (process_input_requests, stock_process)):
        fn.__wrapped__ = stock
        fn.__doc__ = stock.__doc__
        setattr(scheduler_cls, fn.__name__, fn)
    _wrap_run_batch(scheduler_cls)
    _wrap_idle_sleep(scheduler_cls)
    setattr(scheduler_cls, MARK, True)


def _install_weights(manager_cls: Any) -> None:
    stock_weights = manager_cls.load_lora_weights

    def load_lora_weights(self, lora_ref):
        """SGLang's weight read, served by a prepared adapter of the same id and config when there is one."""
        adapter = self.__dict__.get("_lorapub_prepared", {}).pop(lora_ref.lora_id, None)
        config = self.configs.get(lora_ref.lora_id)
        if adapter is None or config is None or config.hf_config != adapter.config.hf_config:
            return stock_weights(self, lora_ref)
        adapter.config = config  # the config object SGLang's own load just built and validated
        self.loras[lora_ref.lora_id] = adapter
        return None

    load_lora_weights.__wrapped__ = stock_weights
    manager_cls.load_lora_weights = load_lora_weights
    setattr(manager_cls, MARK, True)


def _wrap_run_batch(scheduler_cls: Any) -> None:
    # A prefill batch closes the preparing thread's gate (PrefillGate); the next poll opens it.
    stock_run = getattr(scheduler_cls, "run_batch", None)
    if stock_run is None:  # pragma: no cover - both supported releases have it
        return

    def run_batch(self, batch, *args, **kwargs):
        preparer = self.__dict__.get("_lorapub_preparer")
        if preparer:
            preparer.batch_started(batch)
        return stock_run(self, batch, *args, **kwargs)

    run_batch.__wrapped__ = stock_run
    run_batch.__doc__ = stock_run.__doc__
    scheduler_cls.run_batch = run_batch


def _wrap_idle_sleep(scheduler_cls: Any) -> None:
    # An idle scheduler sleeps on its sockets (up to 1 s); a finished preparation must not wait.
    stock_sleep = getattr(scheduler_cls, "maybe_sleep_on_idle", None)
    if stock_sleep is None:  # pragma: no cover - both supported releases have it
        return

    def maybe_sleep_on_idle(self):
        preparer = self.__dict__.get("_lorapub_preparer")
        if preparer and preparer.pending:  # wake as soon as the oldest preparation ends
            concurrent.futures.wait([preparer.pending[0][1]], timeout=0.005)
            return None
        return stock_sleep(self)

    maybe_sleep_on_idle.__wrapped__ = stock_sleep
    scheduler_cls.maybe_sleep_on_idle = maybe_sleep_on_idle


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's scheduler process entry with this patch installed (runtime form; spawn-safe)."""
    from sglang.srt.managers import scheduler

    install(scheduler.Scheduler)
    return scheduler.run_scheduler_process(*args, **kwargs)


def route_schedulers(engine_cls: Any = None, stock_entry: Any = None) -> None:
    """Runtime form, in the server process: start SGLang's schedulers through
    :func:`run_scheduler_process` (SGLang's own entry, unless a caller passed its own)."""
    if engine_cls is None:
        from sglang.srt.entrypoints.engine import Engine as engine_cls
    if getattr(engine_cls, MARK, False):
        return
    if stock_entry is None:
        from sglang.srt.managers.scheduler import run_scheduler_process as stock_entry

    stock = engine_cls.__dict__["_launch_subprocesses"].__func__

    def _launch_subprocesses(cls, *args, **kwargs):
        if kwargs.get("run_scheduler_process_func", stock_entry) is stock_entry:
            kwargs["run_scheduler_process_func"] = run_scheduler_process
        return stock(cls, *args, **kwargs)

    engine_cls._launch_subprocesses = classmethod(_launch_subprocesses)
    setattr(engine_cls, MARK, True)
