"""The prefill gate: the preparing thread steps aside while the scheduler launches a prefill."""

from __future__ import annotations

import threading
import time

from .settings import DEFAULT_GATE_BUDGET_S

__all__ = ["PrefillGate"]


class PrefillGate:
    """Keeps the preparing thread's Python off the GIL while the scheduler thread runs a prefill batch.

    A prefill (extend) batch runs eagerly: the scheduler thread launches hundreds of kernels, dropping
    and retaking the GIL around each. A thread running Python beside it takes the GIL at every drop and
    keeps it until its own next blocking call or the switch interval (5 ms), so the prefill's launches
    wait on it: live, the longest scheduler iterations while preparing were 76-100 ms against 61-72 ms
    before, and those long iterations are prefills. Decode batches replay CUDA graphs and leave the
    GIL free while the GPU works, so preparing beside them costs nothing visible.

    The scheduler thread closes the gate when it starts launching an extend batch and opens it once the
    launch returned (with the overlap scheduler the batch then runs on the GPU while the thread goes
    on; ``LORAPUB_SGLANG_PREPARE_GATE=batch``: at its next loop iteration instead); the preparing
    thread calls :meth:`step` between its Python steps (each tensor it reads, hands to SGLang's
    processing, casts or copies) and waits there while the gate is closed. It never
    waits longer than ``max_wait_s`` at a time, and after such a wait runs ``slice_s`` of steps before
    it looks again; once one preparation has waited ``budget_s`` in all it stops waiting, so a
    scheduler that prefills back to back delays a load by at most that much.
    """

    def __init__(self, enabled: bool = True, max_wait_s: float = 0.1, slice_s: float = 0.005,
                 budget_s: float = DEFAULT_GATE_BUDGET_S) -> None:
        self.enabled = enabled
        self.max_wait_s, self.slice_s, self.budget_s = max_wait_s, slice_s, budget_s
        self._open = threading.Event()
        self._open.set()
        self._free_until = 0.0  # after a wait that timed out: steps run without looking until then
        self.waits = 0  # steps that found the gate closed, this preparation
        self.waited_s = 0.0
        self.timeouts = 0

    # scheduler thread
    @property
    def is_open(self) -> bool:
        """No prefill is being launched now: a preparation's steps go on."""
        return self._open.is_set()

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


