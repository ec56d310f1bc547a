"""The preparer: one scheduler's adapter loads, prepared by its helper process (helper.py) and handed
over on a background thread of the scheduler's process, then installed by SGLang's own load path at
the start of a loop iteration."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from . import iterations
from .gate import PrefillGate
from .helper import CHUNK_BYTES, HelperClient, HelperError, kit_for
from .reading import weight_places
from .settings import gate_budget, gate_scope, helper_deadline, helper_start_deadline, slot_images_enabled, switch_interval, trace_setting
from .slot_image import IMAGE_ATTR, build_slot_image, image_from_flats, make_resident

__all__ = ["CHUNK_BYTES", "PreparationFailed", "Preparer", "is_extend", "send_reply"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch


class PreparationFailed(RuntimeError):
    """What SGLang's own load raises, for a load whose preparation failed: it answers with this message."""


class Preparer:
    """One scheduler's preparations, in the order their loads arrived (one worker thread)."""

    def __init__(self, scheduler: Any, manager: Any, helper: Any = None) -> None:
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
        # the helper process that prepares each load (started now, before any batch runs: a load waits
        # only for what is left of its start)
        self.helper = helper if helper is not None else HelperClient(kit_for(manager), helper_deadline(),
                                                                       helper_start_deadline())
        if self.helper.process is None and isinstance(self.helper, HelperClient):
            self.helper.start()
        self.tokens: dict[str, int] = {}  # lora_id -> the helper's token of its load in flight
        self.adapter_cls: Any = None  # SGLang's LoRAAdapter unless set (tests: a release's own, compiled)
        self.ticks: collections.deque[float] = collections.deque(maxlen=8192)  # perf_counter at each iteration's end
        if self.trace:
            _trace_gc()
        self.switch_s = switch_interval()
        self.saved_switch: float | None = None
        self.slot_images = slot_images_enabled()
        self.unlearnable: set[Any] = set()  # layouts whose fill is no replayable gather: imaged here per load
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
            except Exception as e:  # noqa: BLE001 - SGLang's own load answers with it: success false, this message
                outcome = "failed"
                message = str(e) if isinstance(e, HelperError) else f"lorapub could not prepare {recv_req.lora_name}: {e}"
                prepared[recv_req.lora_id] = PreparationFailed(message)
                logger.error("lorapub: the load of %s failed (%s: %s)", recv_req.lora_name, type(e).__name__, e)
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

    # -- preparing thread: the hand-over -----------------------------------------------------------
    def read_config(self, ref: Any) -> Any:
        from sglang.srt.lora.lora_config import LoRAConfig

        return LoRAConfig(ref.lora_path, base_vocab_size=self.manager.base_hf_config.vocab_size)

    def new_adapter(self, ref: Any, config: Any) -> Any:
        """An empty adapter, as the manager's own load makes it (SGLang's ``LoRAAdapter`` with the
        manager's own arguments)."""
        manager = self.manager
        cls = self.adapter_cls
        if cls is None:
            from sglang.srt.lora.lora import LoRAAdapter

            cls = LoRAAdapter
        return cls(ref.lora_id, config, manager.base_hf_config, manager.load_config, manager.lora_backend,
                   base_model=getattr(manager, "base_model", None))

    def _prepare(self, ref: Any) -> Any:
        """The load prepared by the helper process, handed over: its buffer copied device to device into
        one of this process, and the adapter built around views of it."""
        self.gate.reset()  # a failed preparation's waits are not the next one's
        t0 = time.perf_counter()
        helper = self.helper
        job = helper.new_job(ref)
        self.tokens[ref.lora_id] = job.token
        try:
            shipped = helper.prepare(job)  # the helper reads, processes, casts and copies; this thread waits
            t1 = time.perf_counter()
            try:
                config = self.read_config(ref)
                buffer, queued_s = self._take(shipped)
            except BaseException:
                helper.release(shipped.token, opened=False)
                raise
        finally:
            self.tokens.pop(ref.lora_id, None)
        t2 = time.perf_counter()
        adapter = self._build(ref, config, buffer, shipped.entries)
        t3 = time.perf_counter()
        image, made = None, "none"
        if self.slot_images:  # the image serves every slot fill; the adapter keeps its device weights for the rest
            image, made = self._slot_image(adapter, buffer, shipped)
            if image is not None:
                adapter.__dict__[IMAGE_ATTR] = image
        t4 = time.perf_counter()
        timings = shipped.timings
        logger.info("lorapub: prepared %s in the helper process in %.0f ms (SGLang's processing %.0f ms, cast and "
                    "copy to the device %.0f ms; the helper's CPU %.0f ms on %s threads), handed over in %.0f ms (of "
                    "which queued GPU work %.0f ms), adapter built in %.0f ms, slot image %.0f ms (%s), %.0f MB; %s) "
                    "at %.3f", ref.lora_name, 1e3 * (t1 - t0),
                    1e3 * timings.get("process_s", float("nan")), 1e3 * timings.get("pack_s", float("nan")),
                    1e3 * timings.get("cpu_s", float("nan")), timings.get("threads", "?"), 1e3 * (t2 - t1), 1e3 * queued_s, 1e3 * (t3 - t2),
                    1e3 * (t4 - t3) if image is not None else float("nan"), made, shipped.total / 1e6, self.gate.reset(),
                    time.time())
        return adapter

    def _slot_image(self, adapter: Any, buffer: Any, shipped: Any) -> tuple[Any, str]:
        """The adapter's slot image, and how it was made: shipped by the helper (views of ``buffer``,
        no work here), else by SGLang's own fill on this thread, recorded so that the helper makes the
        next one of this layout (image_plan.py)."""
        plans = getattr(self.helper, "plans", {})
        plan = plans.get(shipped.entries) if shipped.image else None
        if plan is not None:
            image = image_from_flats(self.manager.memory_pool, [span.of(buffer) for span in shipped.image], plan,
                                     self.gate.step)
            if image is not None:
                return image, "made by the helper"
        learn = shipped.entries not in self.unlearnable and hasattr(self.helper, "teach")
        image = build_slot_image(self.manager, adapter, self.stream, self.gate.step,
                                 learn_from=(buffer, shipped.entries) if learn else None)
        if learn and (image is None or image.plan is None):
            self.unlearnable.add(shipped.entries)  # this layout is not recorded again
            if image is None:  # never let the recording cost the image: once more, unwatched
                image = build_slot_image(self.manager, adapter, self.stream, self.gate.step)
        if image is None:
            return None, "none: SGLang's fill refused it, or the pool's layout is unknown"
        if image.plan is not None:
            self.helper.teach(image.plan)
            return image, "SGLang's fill here; the helper makes the next ones of this layout"
        return image, "SGLang's fill here"

    def _take(self, shipped: Any) -> tuple[Any, float]:
        """The shipped buffer copied into one of this process (one device-to-device copy on the side
        stream), then released to the helper; returns it and the seconds spent waiting for the GPU
        work queued before the copy."""
        import contextlib

        import torch

        queued_s = 0.0
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        if self.on_cuda:
            # Device blocks freed by an earlier unload return to this stream's pool: wait for every
            # kernel queued before this copy, so none can still read what it overwrites.
            t_queued = time.perf_counter()
            torch.cuda.synchronize(self.device)
            queued_s = time.perf_counter() - t_queued
        opened = False
        try:
            with context:
                source = self.helper.open(shipped)  # torch's rebuild of the handle; refused once stale
                opened = True
                buffer = torch.empty(shipped.total, dtype=torch.uint8, device=self.device)
                buffer.copy_(source, non_blocking=self.on_cuda)
            if self.stream is not None:
                self.stream.synchronize()
            del source  # this process's mapping of the helper's buffer ends here
        finally:
            if opened:
                self.helper.release(shipped.token, opened=True)  # the helper frees its buffer
        return buffer, queued_s

    def _build(self, ref: Any, config: Any, buffer: Any, entries: Any) -> Any:
        """SGLang's adapter object around views of ``buffer``: no copy, no cast, no processing here."""
        import torch

        adapter = self.new_adapter(ref, config)
        dicts = dict(weight_places(adapter))
        step = self.gate.step
        for e in entries:
            step()
            dicts[e.where][e.name] = buffer[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        return adapter

    def abandon(self, lora_id: str) -> bool:
        """Nobody takes ``lora_id``'s preparation any more (its request was answered, its adapter
        unloaded): a buffer the helper ships for it is refused and freed. True if one was in flight."""
        token = self.tokens.get(lora_id)
        if token is None:
            return False
        self.helper.abandon(token)
        return True

    def close(self) -> None:
        """Stop the helper process (the scheduler's process ends)."""
        self.helper.close()


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


_gc_traced = False


def _trace_gc() -> None:
    """Log and note every garbage collection of this process (its callback is registered once)."""
    import gc

    global _gc_traced
    if _gc_traced:
        return
    _gc_traced = True
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

