"""Adapter loads that (almost) never stop decoding: SGLang's scheduler only swaps in a prepared adapter.

A helper process beside the scheduler reads, processes (SGLang's own code), casts and copies each load
to the device and ships one buffer through a CUDA IPC handle (:mod:`.helper`); a thread of the scheduler
process copies it into its own buffer and builds the adapter; the scheduler installs it through SGLang's
own load path. See docs/sglang-patch.md, "Prepared loads: a load that barely stops decoding (both releases)".
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Literal

from .gate import PrefillGate
from .helper import HelperClient, HelperDied, HelperError, HelperFailed, HelperHung, StaleHandle
from .preparer import CHUNK_BYTES, PreparationFailed, Preparer, is_extend
from .reading import read_peft_folder
from .settings import (ENV, GATE_BUDGET_ENV, GATE_ENV, HELPER_DEADLINE_ENV, HELPER_START_ENV, IMAGE_ENV, MARK, SWITCH_ENV,
                       TRACE_ENV, enabled, slot_images_enabled, trace_setting)
from .slot_image import IMAGE_ATTR, build_slot_image, install_slot_fill, trace_slot_fills

__all__ = ["CHUNK_BYTES", "ENV", "GATE_BUDGET_ENV", "GATE_ENV", "HELPER_DEADLINE_ENV", "HELPER_START_ENV", "IMAGE_ATTR",
           "IMAGE_ENV", "MARK", "SWITCH_ENV", "TRACE_ENV", "HelperClient", "HelperDied", "HelperError", "HelperFailed",
           "HelperHung", "PreparationFailed", "PrefillGate", "Preparer", "StaleHandle", "build_slot_image", "enabled",
           "install", "preparer_of", "read_peft_folder", "route_schedulers", "run_scheduler_process", "will_prepare"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch

# The classes patched here and what their methods take (a scheduler, its requests and batches, the LoRA
# manager and its adapters) are SGLang's own objects: Any to this module.


def preparer_of(scheduler: Any) -> Preparer | None:
    """This scheduler's preparer, or None where the stock load must run."""
    found: Preparer | None | Literal[False] = scheduler.__dict__.get("_lorapub_preparer", False)
    if found is not False:
        return found
    preparer = None
    try:
        manager = getattr(scheduler.tp_worker.model_runner, "lora_manager", None)
        if enabled() and _one_gpu(scheduler.server_args) and manager is not None and getattr(manager.device, "type", manager.device) == "cuda":
            preparer = Preparer(scheduler, manager)
            from lorapub.sglang_patch.metrics import for_scheduler

            preparer.metrics = for_scheduler(scheduler)  # None without --enable-metrics or prometheus_client
    except Exception as e:  # pragma: no cover - depends on the server's shape
        logger.warning("lorapub: adapter loads keep SGLang's own path (%s)", e)
    scheduler.__dict__["_lorapub_preparer"] = preparer
    return preparer


def install(scheduler_cls: Any = None, manager_cls: Any = None, pool_cls: Any = None) -> None:
    """Patch SGLang's Scheduler, LoRAManager and LoRAMemoryPool classes in this process. Idempotent."""
    if scheduler_cls is None:
        from sglang.srt.managers.scheduler import Scheduler

        scheduler_cls = Scheduler
    if manager_cls is None:
        from sglang.srt.lora.lora_manager import LoRAManager

        manager_cls = LoRAManager
    if pool_cls is None:
        from sglang.srt.lora.mem_pool import LoRAMemoryPool

        pool_cls = LoRAMemoryPool
    if not getattr(pool_cls, MARK, False):
        if slot_images_enabled():  # off: SGLang's own fill, untouched
            install_slot_fill(pool_cls)
        if trace_setting() is not None:
            trace_slot_fills(pool_cls)
        setattr(pool_cls, MARK, True)
    if not getattr(manager_cls, MARK, False):
        _install_weights(manager_cls)
    if getattr(scheduler_cls, MARK, False):
        return
    stock_load = scheduler_cls.load_lora_adapter
    stock_process = scheduler_cls.process_input_requests

    def load_lora_adapter(self: Any, recv_req: Any) -> Any:
        preparer = preparer_of(self)
        if preparer is not None and preparer.submit(recv_req, stock_load):
            return None  # answered by poll() once the adapter is ready
        return stock_load(self, recv_req)

    def process_input_requests(self: Any, recv_reqs: Any) -> Any:
        result = stock_process(self, recv_reqs)
        preparer = preparer_of(self)  # made on the first loop iteration, before any batch runs
        if preparer:
            if preparer.trace:
                preparer.tick()
            preparer.poll()
        return result

    for fn, stock in ((load_lora_adapter, stock_load), (process_input_requests, stock_process)):
        setattr(fn, "__wrapped__", stock)
        fn.__doc__ = stock.__doc__
        setattr(scheduler_cls, fn.__name__, fn)
    _wrap_init(scheduler_cls)
    _wrap_run_batch(scheduler_cls)
    _wrap_idle_sleep(scheduler_cls)
    setattr(scheduler_cls, MARK, True)


def _install_weights(manager_cls: Any) -> None:
    stock_weights = manager_cls.load_lora_weights

    def load_lora_weights(self: Any, lora_ref: Any) -> Any:
        """SGLang's weight read, served by a prepared adapter of the same id and config when there is one."""
        adapter = self.__dict__.get("_lorapub_prepared", {}).pop(lora_ref.lora_id, None)
        if isinstance(adapter, BaseException):  # its preparation failed: SGLang's load answers with why
            raise adapter
        config = self.configs.get(lora_ref.lora_id)
        if adapter is None or config is None or config.hf_config != adapter.config.hf_config:
            return stock_weights(self, lora_ref)
        adapter.config = config  # the config object SGLang's own load just built and validated
        self.loras[lora_ref.lora_id] = adapter
        return None

    setattr(load_lora_weights, "__wrapped__", stock_weights)
    manager_cls.load_lora_weights = load_lora_weights
    setattr(manager_cls, MARK, True)


def _wrap_run_batch(scheduler_cls: Any) -> None:
    # A prefill batch closes the preparing thread's gate (PrefillGate) while it is launched (settings.GATE_ENV).
    stock_run = getattr(scheduler_cls, "run_batch", None)
    if stock_run is None:  # pragma: no cover - both supported releases have it
        return

    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        preparer = self.__dict__.get("_lorapub_preparer")
        if not preparer:
            return stock_run(self, batch, *args, **kwargs)
        preparer.batch_started(batch)
        t0 = time.perf_counter()
        try:
            return stock_run(self, batch, *args, **kwargs)
        finally:
            preparer.batch_launched()
            if preparer.iterations is not None:
                preparer.iterations.add("prefill" if is_extend(batch) else "decode", time.perf_counter() - t0)

    setattr(run_batch, "__wrapped__", stock_run)
    run_batch.__doc__ = stock_run.__doc__
    scheduler_cls.run_batch = run_batch


def _wrap_idle_sleep(scheduler_cls: Any) -> None:
    # An idle scheduler sleeps on its sockets (up to 1 s); a finished preparation must not wait.
    stock_sleep = getattr(scheduler_cls, "maybe_sleep_on_idle", None)
    if stock_sleep is None:  # pragma: no cover - both supported releases have it
        return

    def maybe_sleep_on_idle(self: Any) -> Any:
        preparer = self.__dict__.get("_lorapub_preparer")
        if preparer and preparer.pending:  # wake as soon as the oldest preparation ends
            concurrent.futures.wait([preparer.pending[0][1]], timeout=0.005)
            return None
        return stock_sleep(self)

    setattr(maybe_sleep_on_idle, "__wrapped__", stock_sleep)
    scheduler_cls.maybe_sleep_on_idle = maybe_sleep_on_idle


def _one_gpu(server_args: Any) -> bool:
    """No tp, pp or dp above 1: several ranks would have to swap an adapter in on the same iteration."""
    return all(int(getattr(server_args, k, 1) or 1) == 1 for k in ("tp_size", "pp_size", "dp_size"))


def will_prepare(server_args: Any) -> bool:
    """Whether a scheduler with these arguments prepares its loads in a helper (see :func:`preparer_of`,
    which decides for certain once the model exists): LoRA on, one GPU, on CUDA, the patch not switched off."""
    lora = bool(getattr(server_args, "enable_lora", False) or getattr(server_args, "lora_paths", None))
    return enabled() and _one_gpu(server_args) and lora and getattr(server_args, "device", "cuda") in (None, "cuda")


def _wrap_init(scheduler_cls: Any) -> None:
    """Start the helper as the scheduler starts, before SGLang builds its model: the helper's imports run
    beside the model's load, and the first adapter load finds it ready (``helper.prestart``)."""
    stock = scheduler_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            server_args = kwargs.get("server_args", args[0] if args else None)
            if will_prepare(server_args):
                from .helper import prestart

                prestart()
        except Exception as e:  # noqa: BLE001 - the first load starts it instead
            logger.warning("lorapub: the preparing helper starts with the first load (%s)", e)
        stock(self, *args, **kwargs)

    setattr(__init__, "__wrapped__", stock)
    __init__.__doc__ = stock.__doc__
    scheduler_cls.__init__ = __init__


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's scheduler process entry with this patch installed (runtime form; spawn-safe)."""
    from sglang.srt.managers import scheduler

    install(scheduler.Scheduler)
    return scheduler.run_scheduler_process(*args, **kwargs)


def route_schedulers(engine_cls: Any = None, stock_entry: Any = None) -> None:
    """Runtime form, in the server process: start SGLang's schedulers through
    :func:`run_scheduler_process` (SGLang's own entry, unless a caller passed its own)."""
    if engine_cls is None:
        from sglang.srt.entrypoints.engine import Engine

        engine_cls = Engine
    if getattr(engine_cls, MARK, False):
        return
    if stock_entry is None:
        from sglang.srt.managers.scheduler import run_scheduler_process as sglang_entry

        stock_entry = sglang_entry

    stock = engine_cls.__dict__["_launch_subprocesses"].__func__

    def _launch_subprocesses(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("run_scheduler_process_func", stock_entry) is stock_entry:
            kwargs["run_scheduler_process_func"] = run_scheduler_process
        return stock(cls, *args, **kwargs)

    engine_cls._launch_subprocesses = classmethod(_launch_subprocesses)
    setattr(engine_cls, MARK, True)
