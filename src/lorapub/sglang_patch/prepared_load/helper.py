"""The preparing helper: a process beside each scheduler that reads a load's folder, runs SGLang's own
processing of its weights, casts them to the pool's dtype and copies them into ONE flat device buffer,
shipped to the scheduler's process as a CUDA IPC handle made by torch's own reductions (a shared host
buffer where the device is the CPU: tests), with each weight's place (:class:`Entry`). It frees a buffer
once the scheduler copied it; one that dies or hangs is killed and restarted, failing its load.
See docs/sglang-patch.md, "Prepared loads: a load that barely stops decoding (both releases)".
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from typing import Any, Callable

from .image_plan import ImagePlan
from .packing import ALIGN, CHUNK_BYTES, Entry, ImageSpan, pack
from .reading import read_peft_folder
from .settings import helper_threads

__all__ = ["ALIGN", "CHUNK_BYTES", "Entry", "HelperClient", "ImageSpan", "HelperDied", "HelperError", "HelperFailed", "HelperHung",
           "Job", "Kit", "Shipped", "StaleHandle", "keep_freed_memory", "keep_plan", "kit_for", "pack", "prestart", "process_with",
           "sglang_process"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch

#: Image plans a helper keeps (one per adapter layout; an RL run has one).
MAX_PLANS = 8
#: The processing the helper runs by default: the release's own LoRAConfig and LoRAAdapter.
SGLANG_PROCESSOR = "lorapub.sglang_patch.prepared_load.helper:sglang_process"


class HelperError(RuntimeError):
    """A load the preparing helper could not hand over; the load fails with this message."""


class HelperDied(HelperError):
    """The helper process ended while it prepared (or before it could prepare) a load."""

    #: whether it had taken the load (a death before that is resent once to the helper that replaces it)
    took_job = True


class HelperHung(HelperError):
    """The helper did not answer within its deadline; it was killed."""


class HelperFailed(HelperError):
    """The helper's preparation raised (a folder SGLang's processing refuses, a bad file): its error."""


class StaleHandle(HelperError):
    """A shipped buffer whose load was already answered or abandoned: it is never opened."""


@dataclasses.dataclass(frozen=True)
class Kit:
    """What a helper needs from its scheduler's LoRA manager, sent once when it starts (picklable)."""

    device: str  # "cuda:0", or "cpu" (tests)
    dtype: str | None  # the memory pool's dtype ("bfloat16"): floating weights are cast to it
    base_hf_config: Any = None
    load_config: Any = None
    base_vocab_size: int | None = None
    #: layer -> whether its MoE is gated (SGLang's ``LoRAAdapter._build_moe_gated_map`` of the base model,
    #: computed once in the scheduler's process: the helper has no model)
    moe_gated: dict[int, bool] = dataclasses.field(default_factory=dict)
    #: "module:function" taking (kit, job) and returning the processed adapter (tests name their own)
    processor: str = SGLANG_PROCESSOR
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: torch's intra-op threads in the helper (settings.HELPER_THREADS_ENV); None: torch's default
    threads: int | None = 1


@dataclasses.dataclass(frozen=True)
class Job:
    token: int
    lora_id: str
    lora_name: str
    lora_path: str


@dataclasses.dataclass(frozen=True)
class Shipped:
    """A prepared load: the handle of its buffer (torch's reduction, pickled), and each weight in it."""

    token: int
    handle: bytes
    entries: tuple[Entry, ...]
    total: int
    timings: dict[str, float]
    #: the adapter's slot image after the weights (made from a plan the scheduler taught), or none
    image: tuple[ImageSpan, ...] = ()


# -- the scheduler's side -----------------------------------------------------------------------------
class HelperClient:
    """The scheduler process's end of its helper: one load at a time, from one thread (the preparer's),
    except :meth:`abandon`, which any thread may call."""

    def __init__(self, kit: Kit, deadline_s: float, start_s: float) -> None:
        self.kit, self.deadline_s, self.start_s = kit, deadline_s, start_s
        self.process: Any = None
        self.conn: Any = None
        self.ready = False
        self.tokens = itertools.count(1)
        self.wanted: set[int] = set()  # shipped or being prepared, and not yet answered nor abandoned
        self.lock = threading.Lock()
        self.plans: dict[tuple[Entry, ...], ImagePlan] = {}  # what this helper (and any that replaces it) was taught

    # lifecycle
    def start(self) -> None:
        """Start a helper, without waiting for it to be ready (the first load waits): the one
        :func:`prestart` began while the scheduler built its model, when there is one, else a new one."""
        process, conn = _take_prestarted()
        how = "took the preparing helper process started with the scheduler"
        if process is None:
            process, conn = _spawn()
            how = "started the preparing helper process"
        try:
            conn.send(("kit", self.kit))
            for plan in self.plans.values():  # a restarted helper makes images as the one before it did
                conn.send(("plan", plan))
        except OSError:
            pass  # it died: the first load's wait says so, and starts another
        self.process, self.conn, self.ready = process, conn, False
        logger.info("lorapub: %s (pid %s) for %s", how, process.pid, self.kit.device)

    def stop(self, why: str = "") -> None:
        """Kill the helper now (its buffers go with it) and forget it."""
        process, conn = self.process, self.conn
        self.process, self.conn, self.ready = None, None, False
        if process is not None:
            if process.is_alive():
                process.kill()
            _wait_for_exit(process, 10.0)
            if why:
                logger.warning("lorapub: the preparing helper process (pid %s) was stopped: %s", process.pid, why)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            if self.process is not None:
                _wait_for_exit(self.process, 5.0)
        self.stop()

    def _restart(self) -> None:
        """A new helper for the next load (a start that fails is logged: the next load tries again)."""
        try:
            self.start()
        except Exception as e:  # noqa: BLE001 - the load that saw the old one end fails with its own error
            logger.error("lorapub: could not start a new preparing helper process (%s); the next load tries again", e)
            self.process, self.conn, self.ready = None, None, False

    def _ensure_ready(self, job: Job) -> None:
        if self.process is not None and not self.process.is_alive():  # it ended between loads: none is lost
            logger.warning("lorapub: the preparing helper process (pid %s) ended while idle (exit code %s); "
                           "starting a new one", self.process.pid, self.process.exitcode)
            self.stop()
        if self.process is None:
            self.start()
        if self.ready:
            return
        deadline = time.monotonic() + self.start_s
        while not self.ready:
            msg = self._receive(deadline, job, starting=True)
            if msg[0] == "ready":
                self.ready = True

    # one load
    def new_job(self, ref: Any) -> Job:
        job = Job(next(self.tokens), ref.lora_id, ref.lora_name, str(ref.lora_path))
        with self.lock:
            self.wanted.add(job.token)
        return job

    def prepare(self, job: Job) -> Shipped:
        """``job`` prepared by the helper (started if there is none): its shipped buffer. Raises a
        :class:`HelperError`; one that died or hung is replaced by a new one for the next load."""
        try:
            try:
                return self._prepare_once(job)
            except HelperDied as e:
                if e.took_job:
                    raise
                # it died before it took this load (killed, or dying, while idle or starting): not this
                # load's doing, so the load goes once to the helper that replaced it
                logger.warning("lorapub: %s; %s goes to the new helper", e, job.lora_name)
                return self._prepare_once(job)
        except BaseException:
            self.abandon(job.token)
            raise

    def _prepare_once(self, job: Job) -> Shipped:
        try:
            self._ensure_ready(job)
        except HelperDied as e:
            e.took_job = False  # it died starting (live: killed before it was ready): it took nothing
            raise
        try:
            self.conn.send(("prepare", job))
        except OSError:
            pass  # it died: the wait below says so
        deadline = time.monotonic() + self.deadline_s
        taken = False
        while True:
            try:
                msg = self._receive(deadline, job)
            except HelperDied as e:
                e.took_job = taken
                raise
            if msg[0] == "taken" and msg[1] == job.token:
                taken = True
            elif msg[0] == "shipped":
                shipped: Shipped = msg[1]
                if shipped.token == job.token:
                    return shipped
                self.release(shipped.token, opened=False)  # an earlier load's, never opened
            elif msg[0] == "failed" and msg[1] == job.token:
                raise HelperFailed(f"lorapub's preparing helper could not prepare {job.lora_name}: {msg[2]}")

    def _receive(self, deadline: float, job: Job, starting: bool = False) -> Any:
        """The helper's next message before ``deadline``; its death or silence is killed, restarted and raised."""
        process, conn = self.process, self.conn
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pid = process.pid
                self.stop()
                self._restart()
                what = "start" if starting else "prepare"
                limit = self.start_s if starting else self.deadline_s
                raise HelperHung(f"lorapub's preparing helper process (pid {pid}) did not {what} {job.lora_name} "
                                 f"within {limit:g} s; it was killed and the load failed; the next load runs on "
                                 f"a restarted helper")
            # Its sentinel and pipe end can outlive it in a process it started (torch's shared-memory manager
            # inherits them), so its exit is also polled.
            ready = multiprocessing.connection.wait([conn, process.sentinel], min(remaining, 0.25))
            if conn in ready:
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    pass  # its end closed: it died
            elif process.sentinel not in ready and process.is_alive():
                continue
            _wait_for_exit(process, 5.0)
            code = process.exitcode
            self.stop()
            self._restart()
            raise HelperDied(f"lorapub's preparing helper process (pid {process.pid}) died (exit code {code}) while "
                             f"preparing {job.lora_name}; the load failed; the next load runs on a restarted helper")

    def open(self, shipped: Shipped) -> Any:
        """The shipped buffer, opened in this process (torch's rebuild of the handle). Refused with
        :class:`StaleHandle` once its load was answered or abandoned."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers torch's reductions for what the handle pickled

        with self.lock:
            if shipped.token not in self.wanted:
                raise StaleHandle(f"lorapub: refused to open a CUDA IPC handle for a reclaimed version (load "
                                  f"{shipped.token} was already answered or abandoned); the helper frees it")
        rebuild, args = ForkingPickler.loads(shipped.handle)
        return rebuild(*args)

    def release(self, token: int, opened: bool) -> None:
        """The helper may free ``token``'s buffer: this process copied it (``opened``) or never will."""
        with self.lock:
            self.wanted.discard(token)
        if self.conn is not None:
            try:
                self.conn.send(("release", token, opened))
            except OSError:  # it died: its buffers went with it
                pass

    def abandon(self, token: int) -> None:
        """Nobody will take ``token``'s buffer: a handle shipped for it is refused, and freed by the helper."""
        with self.lock:
            self.wanted.discard(token)

    def teach(self, plan: ImagePlan) -> None:
        """From now on the helper makes the slot image of every load whose entries are ``plan.key``."""
        keep_plan(self.plans, plan)
        if self.conn is not None:
            try:
                self.conn.send(("plan", plan))
            except OSError:  # it died: its replacement is taught at its start
                pass

    def stats(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The helper's own account (``live``: buffers it still holds), when no load is in flight."""
        self.conn.send(("stats",))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._receive(deadline, Job(0, "", "stats", ""))
            if msg[0] == "stats":
                return dict(msg[1])
            if msg[0] == "ready":
                self.ready = True


def kit_for(manager: Any, processor: str = SGLANG_PROCESSOR, **options: Any) -> Kit:
    """A helper's kit from a scheduler's LoRA manager (SGLang's LoRAManager)."""
    dtype = getattr(manager, "dtype", None)
    moe: dict[int, bool] = {}
    base_model = getattr(manager, "base_model", None)
    if base_model is not None:
        try:  # what SGLang's LoRAAdapter computes from the base model at each load: once here
            from sglang.srt.lora.lora import LoRAAdapter

            build = getattr(LoRAAdapter, "_build_moe_gated_map", None)
            moe = dict(build(base_model)) if build is not None else {}
        except Exception as e:  # noqa: BLE001 - a model without MoE layers needs no map
            logger.info("lorapub: no MoE map for the preparing helper (%s)", e)
    base = getattr(manager, "base_hf_config", None)
    return Kit(device=str(manager.device), dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
               base_hf_config=base, load_config=getattr(manager, "load_config", None),
               base_vocab_size=getattr(base, "vocab_size", None), moe_gated=moe, processor=processor, options=options,
               threads=helper_threads())


def keep_plan(plans: dict[tuple[Entry, ...], ImagePlan], plan: ImagePlan) -> None:
    """``plan`` kept as the newest in ``plans``, by the entries it fits; past ``MAX_PLANS``, the oldest goes
    (the client and its helper keep the same ones, taught in the same order)."""
    plans.pop(plan.key, None)
    plans[plan.key] = plan
    while len(plans) > MAX_PLANS:
        plans.pop(next(iter(plans)))


# -- starting one early ---------------------------------------------------------------------------------
_prestarted: list[tuple[Any, Any]] = []  # (process, our pipe end): at most one, not yet taken by a client
_prestart_lock = threading.Lock()


def _spawn() -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=serve, args=(theirs,), name="lorapub-prepare-helper", daemon=True)
    process.start()
    theirs.close()
    return process, mine


def prestart() -> None:
    """Start this process's helper now, before its kit exists: it imports torch and SGLang's LoRA code
    while the scheduler builds its model, and waits for the kit (the device, the pool's dtype) that the
    first :meth:`HelperClient.start` sends. Live, a helper started once the server was up made the first
    load on it wait 16-17 s (a joining engine's first version, a warm-up), where its loads took 0.13 s."""
    with _prestart_lock:
        if _prestarted:
            return
        try:
            _prestarted.append(_spawn())
        except Exception as e:  # noqa: BLE001 - the first load starts one instead
            logger.warning("lorapub: could not start the preparing helper process early (%s)", e)


def _take_prestarted() -> tuple[Any, Any]:
    with _prestart_lock:
        while _prestarted:
            process, conn = _prestarted.pop()
            if process.is_alive():
                return process, conn
            conn.close()
    return None, None


# -- the helper's side ----------------------------------------------------------------------------------
def sglang_process(kit: Kit, job: Job) -> Any:
    """The release's own reading and processing of ``job``'s folder (the helper's default processor)."""
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig

    return process_with(LoRAAdapter, LoRAConfig, kit, job)


def process_with(adapter_cls: Any, config_cls: Any, kit: Kit, job: Job) -> Any:
    """``job``'s adapter built by ``adapter_cls`` (SGLang's LoRAAdapter) from its folder: a plain PEFT
    folder mapped (:func:`read_peft_folder`) and handed to ``initialize_weights_from_tensors``, any other
    layout read by the adapter's own ``initialize_weights``."""
    config = config_cls(job.lora_path, base_vocab_size=kit.base_vocab_size)
    adapter = adapter_cls(job.lora_id, config, kit.base_hf_config, kit.load_config, None, base_model=None)
    object.__setattr__(adapter, "_moe_is_gated_by_layer", dict(kit.moe_gated))  # as built from the base model
    tensors = read_peft_folder(job.lora_path)
    if tensors is None:
        adapter.initialize_weights()
    else:
        adapter.initialize_weights_from_tensors(tensors)
    return adapter


def _wait_for_exit(process: Any, timeout: float) -> None:
    """``process.join(timeout)`` by polling its exit: join waits on its sentinel, which a process it started
    (torch's shared-memory manager) can hold open long after it ended."""
    end = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < end:
        time.sleep(0.01)


def _resolve(spec: str) -> Callable[[Kit, Job], Any]:
    module, _, name = spec.partition(":")
    found: Callable[[Kit, Job], Any] = getattr(importlib.import_module(module), name)
    return found


def _watch_parent() -> None:
    """End this helper as soon as the scheduler's process ends, however it ended (no orphan)."""
    parent = multiprocessing.parent_process()
    if parent is None:  # pragma: no cover - always started by spawn from the scheduler's process
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="lorapub-helper-parent", daemon=True).start()


def keep_freed_memory() -> bool:
    """Have glibc keep what this process frees in its heap: no trimming, and blocks up to 32 MB taken
    from the heap rather than mappings of their own. A helper frees everything a load allocated once
    it is shipped, and glibc handed that back to the system, so every load touched its memory afresh;
    page faults are what a host charges most for in a virtual machine, and live each 264 MB load took
    seconds there (docs/sglang-patch.md, "Measured live"). Kept, a later load reuses pages already
    touched; the cost is a helper that stays at its largest load's size. False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_trim_threshold, 1 << 30)) and bool(mallopt(m_mmap_threshold, 32 << 20))


def serve(conn: Any) -> None:
    """The helper process's loop: import, take the kit, prepare, ship, free what the scheduler released."""
    _watch_parent()
    heap_kept = keep_freed_memory()
    import torch
    import torch.multiprocessing
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing.reductions import reduce_tensor

    try:  # before the kit: a helper started early imports while the scheduler builds its model
        importlib.import_module("sglang.srt.lora.lora")
        importlib.import_module("sglang.srt.lora.lora_config")
    except Exception:  # noqa: BLE001 - no SGLang here (tests' processors bring their own); the processor's import reports
        pass
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return
    if msg[0] != "kit":
        return
    kit: Kit = msg[1]

    if kit.threads:  # as the scheduler's process has it (settings.HELPER_THREADS_ENV says why)
        torch.set_num_threads(kit.threads)
    threads = torch.get_num_threads()

    # host buffers (tests) shared by name, refcounted: one the scheduler never opens is freed with its tensor
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    device = torch.device(kit.device)
    on_cuda = device.type == "cuda"
    stream, chunks = None, None
    if on_cuda:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dtype = getattr(torch, kit.dtype, None) if kit.dtype else None
    process = _resolve(kit.processor)
    live: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # token -> (buffer, its reduction's arguments)
    plans: dict[tuple[Entry, ...], ImagePlan] = {}  # the scheduler's image plans, by the entries they fit

    def free(token: int, opened: bool) -> None:
        found = live.pop(token, None)
        if found is None:
            return
        buf, args = found
        if not opened:  # balance what shipping took, since no rebuild will
            if on_cuda:
                torch.UntypedStorage._release_ipc_counter(args[11], args[12], device=args[6])  # type: ignore[no-untyped-call]
            else:
                buf.untyped_storage()._shared_decref()
        del buf, found
        if on_cuda:
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
            torch.cuda.empty_cache()

    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "prepare":
            job: Job = msg[1]
            conn.send(("taken", job.token))  # from here a death is this load's (the client resends one before it)
            try:
                t0, cpu0 = time.perf_counter(), time.process_time()
                adapter = process(kit, job)
                t1 = time.perf_counter()
                buf, entries, image = pack(adapter, dtype, device, stream, chunks, plans)
                del adapter
                t2 = time.perf_counter()
                rebuild, args = reduce_tensor(buf)  # type: ignore[no-untyped-call]
                handle = bytes(ForkingPickler.dumps((rebuild, args)))
                live[job.token] = (buf, args)
                shipped = Shipped(job.token, handle, tuple(entries), int(buf.numel()),
                                  {"process_s": t1 - t0, "pack_s": t2 - t1,
                                   # all its threads' CPU time: far above the wall time, threads contend
                                   "cpu_s": time.process_time() - cpu0, "threads": threads}, image)
            except Exception as e:  # noqa: BLE001 - the load fails with it; the helper serves the next
                conn.send(("failed", job.token, f"{type(e).__name__}: {e}"))
                continue
            conn.send(("shipped", shipped))
        elif msg[0] == "plan":  # how to make the slot image of a layout (image_plan.py), learned by the scheduler
            keep_plan(plans, msg[1])
        elif msg[0] == "release":
            free(msg[1], bool(msg[2]))
        elif msg[0] == "stats":
            conn.send(("stats", {"live": len(live), "plans": len(plans), "pid": os.getpid(), "heap_kept": heap_kept,
                                 "threads": threads}))
        elif msg[0] == "stop":
            return
