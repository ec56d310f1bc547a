"""The preparer: one scheduler's adapter preparations on a background thread of its process,
installed by SGLang's own load path at the start of a loop iteration."""

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

from . import iterations
from .gate import PrefillGate
from .reading import Stepped, read_peft_folder, weight_dicts
from .settings import IMAGE_ENV, gate_budget, gate_scope, switch_interval, trace_setting
from .slot_image import IMAGE_ATTR, build_slot_image, make_resident

__all__ = ["CHUNK_BYTES", "Preparer", "is_extend", "send_reply"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch
_ALIGN = 256  # every tensor's view starts on a 256-byte boundary of the shared buffers
#: Host-to-device copies go through two pinned chunks of this size (double-buffered).
CHUNK_BYTES = 32 << 20


class Preparer:
    """One scheduler's preparations, in the order their loads arrived (one worker thread)."""

    def __init__(self, scheduler: Any, manager: Any) -> None:
        import torch

        self.scheduler = scheduler
        self.manager = manager
        self.device = manager.device
        self.on_cuda = getattr(self.device, "type", self.device) == "cuda"
        # torch's stubs leave the CUDA stream and event constructors unannotated
        self.stream = torch.cuda.Stream(device=self.device) if self.on_cuda else None  # type: ignore[no-untyped-call]
        trace = trace_setting()
        self.trace = trace is not None
        # what each scheduler iteration spent, around every load or always (trace only; docs/sglang-patch.md)
        self.iterations = iterations.IterationRecorder(every=trace == "all") if self.trace else None
        if self.iterations is not None:
            iterations.active = self.iterations
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorapub-prepare",
                                                          initializer=self._preparing_thread_started)
        # (request, its preparation, the stock load, when it was submitted)
        self.pending: list[tuple[Any, concurrent.futures.Future[Any], Callable[..., Any], float]] = []
        self.chunks: list[Any] | None = None
        if self.on_cuda:  # before any batch runs (see _chunks)
            self._chunks()
        self.ticks: collections.deque[float] = collections.deque(maxlen=8192)  # perf_counter at each iteration's end
        if self.trace:
            _trace_gc()
        self.switch_s = switch_interval()
        self.saved_switch: float | None = None
        self.slot_images = os.environ.get(IMAGE_ENV) == "1"
        self.gate_scope = gate_scope()  # "launch", "batch" or "off" (settings.GATE_ENV)
        self.gate = PrefillGate(enabled=self.gate_scope != "off", budget_s=gate_budget())
        self.metrics: Any = None  # lorapub's engine series (--enable-metrics): each load counted and timed

    def tick(self) -> None:
        """One scheduler loop iteration ended (trace only)."""
        self.ticks.append(time.perf_counter())
        if self.iterations is not None:
            self.iterations.boundary()

    def _preparing_thread_started(self) -> None:
        _lower_priority()
        if self.iterations is not None:  # its CPU clock, readable from the scheduler thread
            self.iterations.prep_clock = iterations.thread_cpu_clock()

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
        if self.iterations is not None:
            self.iterations.submitted()
        return True

    def batch_started(self, batch: Any) -> None:
        """The scheduler thread launches ``batch``: a prefill closes the gate while a preparation runs."""
        if self.pending and is_extend(batch):
            self.gate.close()

    def batch_launched(self) -> None:
        """SGLang's run_batch returned: with the overlap scheduler the batch is queued on the GPU and
        its kernels are launched, so the preparation goes on beside it (scope "launch"); scope "batch"
        keeps the gate closed until the next loop iteration (:meth:`poll`)."""
        if self.gate_scope == "launch":
            self.gate.open()

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
            outcome = "prepared"
            try:
                prepared[recv_req.lora_id] = future.result()
            except Exception as e:  # SGLang's own load runs instead and answers with its own error
                outcome = "fallback"
                logger.warning("lorapub: preparing %s failed (%s); loading it on the scheduler thread",
                               recv_req.lora_name, e)
            t_load = time.perf_counter()
            try:
                output = stock(self.scheduler, recv_req)
            finally:
                prepared.pop(recv_req.lora_id, None)
            t_loaded = time.perf_counter()
            # with a slot image, resident before the reply: its first batch copies nothing (the trace counts
            # that copy as a fill, as it would a first batch's: the install's span ends before it)
            slot = make_resident(self.manager, recv_req.lora_id) if _succeeded(output) else None
            t_sent = time.perf_counter()
            if self.iterations is not None:
                self.iterations.add("install", t_loaded - t0)
                self.iterations.installed()
            send_reply(self.scheduler, output, recv_req)
            if self.metrics is not None:
                self.metrics.prepared("failed" if not _succeeded(output) else outcome, t_sent - submitted, t_sent - t0)
            if self.trace:  # where an install's time goes: taking the result, SGLang's own load, the reply
                t1 = time.perf_counter()
                logger.info("lorapub trace: installed %s on the scheduler thread in %.1f ms (result %.1f ms, "
                            "SGLang's load %.1f ms, reply %.1f ms; resident in slot %s) at %.3f", recv_req.lora_name,
                            1e3 * (t1 - t0), 1e3 * (t_load - t0), 1e3 * (t_sent - t_load), 1e3 * (t1 - t_sent),
                            "none" if slot is None else slot, time.time())

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
            type(manager).load_lora_weights_from_tensors(view, ref, Stepped(tensors, step))
        adapter = view.loras[ref.lora_id]
        t1 = time.perf_counter()
        if not self.on_cuda:  # host-only engines (tests): the read is what moves off the scheduler
            logger.info("lorapub: prepared %s off the scheduler thread in %.0f ms (%s)", ref.lora_name,
                        1e3 * (t1 - t0), self.gate.reset())
            return adapter
        host = [dict(d) for d in weight_dicts(adapter)] if self.slot_images else []
        waited_reading = self.gate.waited_s
        moved, queued_s = self._to_device(adapter)
        t2 = time.perf_counter()
        waited_moving = self.gate.waited_s - waited_reading
        image = build_slot_image(manager, adapter, self.stream, self.gate.step) if self.slot_images else None
        if image is not None:  # the image serves every slot fill; the weights stay in host memory, as SGLang keeps them
            for d, h in zip(weight_dicts(adapter), host):
                d.update(h)
            adapter.__dict__[IMAGE_ATTR] = image
        t3 = time.perf_counter()
        # "to device" split three ways: waiting for the GPU work queued before it (a running batch),
        # stepping aside for prefills, and the copies themselves
        logger.info("lorapub: prepared %s off the scheduler thread in %.0f ms (read %.0f ms of which bytes %.0f ms, "
                    "to device %.0f ms of which queued GPU work %.0f ms and prefill waits %.0f ms, "
                    "slot image %.0f ms, %.0f MB; %s) at %.3f", ref.lora_name, 1e3 * (t3 - t0),
                    1e3 * (t1 - t0), 1e3 * (t_bytes - t0), 1e3 * (t2 - t1), 1e3 * queued_s, 1e3 * waited_moving,
                    1e3 * (t3 - t2) if image is not None else float("nan"), moved / 1e6, self.gate.reset(),
                    time.time())
        return adapter

    def _to_device(self, adapter: Any) -> tuple[int, float]:
        """Every tensor of ``adapter`` into one device buffer, through the fixed pinned chunks; returns the
        bytes moved and the seconds spent waiting for the GPU work queued before the copy."""
        import torch

        pool_dtype = getattr(self.manager, "dtype", None)
        slots, spans, total = [], [], 0
        step = self.gate.step
        for d in weight_dicts(adapter):
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
            return 0, 0.0
        stream = self.stream
        if stream is None:  # preparer_of makes preparers on a CUDA device only, each with its stream
            raise RuntimeError("lorapub: a preparation copies to the device on a CUDA stream; this preparer has none")
        # Device blocks freed by an earlier unload return to this stream's pool: wait for every
        # kernel queued before this preparation, so none can still read what this copy overwrites.
        t_queued = time.perf_counter()
        torch.cuda.synchronize(self.device)
        queued_s = time.perf_counter() - t_queued
        with torch.cuda.stream(stream):
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
            with torch.cuda.stream(stream):
                dev[base:end].copy_(chunk[:end - base], non_blocking=True)
                pending[k] = torch.cuda.Event()  # type: ignore[no-untyped-call]  # as Stream
                pending[k].record(stream)
            k = (k + 1) % len(chunks)
        stream.synchronize()
        for (d, name, t), (start, size) in zip(slots, spans):
            d[name] = dev[start:start + size].view(t.dtype).view(t.shape)
        return total, queued_s

    def _chunks(self) -> list[Any]:
        """Two pinned chunks, allocated once per scheduler: pinning host memory stalls the whole
        process's CUDA calls, so it must not happen while batches run."""
        if self.chunks is None:
            import torch

            self.chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self.chunks



def _succeeded(output: Any) -> bool:
    """SGLang's load reply says it loaded (a LoadLoRAAdapterReqOutput; a mapping in tests)."""
    found = output.get("success") if isinstance(output, dict) else getattr(output, "success", True)
    return bool(found)


def is_extend(batch: Any) -> bool:
    mode = getattr(batch, "forward_mode", None)
    try:
        return bool(mode is not None and mode.is_extend())
    except Exception:  # noqa: BLE001 - a mode this release names otherwise: never gate on it
        return False


def _trace_gc() -> None:
    import gc

    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            took = time.perf_counter() - started[0]
            iterations.note("gc", took)
            if took >= 0.005:
                logger.info("lorapub trace: gc generation %s took %.1f ms at %.3f", info.get("generation"),
                            1e3 * took, time.time())

    gc.callbacks.append(callback)



def _lower_priority() -> None:
    try:  # the preparing thread yields the CPU to the scheduler thread (Linux: per-thread nice)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def send_reply(scheduler: Any, output: Any, recv_req: Any) -> None:
    send = getattr(scheduler, "send_control_output", None)  # 0.5.23
    if send is not None:
        send(output, recv_req)
    elif getattr(scheduler, "rust_server", None) is not None:  # 0.5.17, as process_input_requests does
        scheduler.rust_server.push_control_output(recv_req, output)
    else:
        scheduler.ipc_channels.send_to_tokenizer.send_output(output, recv_req)

