"""What each scheduler loop iteration spent around a load (trace): one ``lorapub iteration {json}`` line an
iteration, on the host's monotonic clock, which bench/attribution.py joins to a client's slow decode steps.
See docs/sglang-patch.md, "Prepared loads: a load that barely stops decoding (both releases)"."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

__all__ = ["AFTER_INSTALL_S", "IterationRecorder", "active", "note", "parse_line", "thread_cpu_clock"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch

#: How long after an install the iterations stay recorded (an adapter's first batches come in it).
AFTER_INSTALL_S = 2.0
_FIELDS = ("prefill", "decode", "install", "fill", "gc")

#: The recorder of this process's scheduler (one scheduler a process at tp = pp = dp = 1), or None.
active: "IterationRecorder | None" = None


def note(kind: str, seconds: float) -> None:
    """Add ``seconds`` of ``kind`` to the current iteration of this process's recorder, if any."""
    recorder = active
    if recorder is not None:
        recorder.add(kind, seconds)


def thread_cpu_clock() -> Callable[[], float] | None:
    """A reader of the calling thread's CPU clock that any thread may call, or None off Linux."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return lambda: time.clock_gettime(clock)


class IterationRecorder:
    """The scheduler thread's iterations inside publication windows (or all of them), each logged as it ends.

    A record (ms unless named): ``t`` the start (monotonic s), ``wall`` its length, ``cpu`` the scheduler
    thread's own CPU time (``wall - cpu``: waiting for the interpreter, the GPU or sockets), ``prep_cpu``
    the preparing thread's CPU time beside it, ``prefill``/``decode`` time launching batches of that kind,
    ``install``, ``fill`` (pool slot fills), ``gc``, and ``preparing`` while a preparation ran."""

    def __init__(self, emit: Callable[[str], None] | None = None, now: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.thread_time, every: bool = False) -> None:
        self.emit = emit or (lambda line: logger.info("%s", line))
        self.every = every  # a record for every iteration, not only inside publication windows
        self.now, self.cpu = now, cpu
        self.prep_clock: Callable[[], float] | None = None  # set by the preparing thread when it starts
        self.open_windows = 0  # preparations submitted and not installed yet
        self.until = 0.0  # record until then (an install's first batches)
        # add() may come from the preparing thread (a gc there), and from a gc that an allocation under this
        # very lock set off on this thread (the trace's gc callback notes it): reentrant, or that gc deadlocks
        self.lock = threading.RLock()
        self._start(self.now())

    def _start(self, at: float) -> None:
        self.t0, self.cpu0 = at, self.cpu()
        self.prep0 = self._prep()
        self.spent = dict.fromkeys(_FIELDS, 0.0)
        self.preparing = self.open_windows > 0

    def _prep(self) -> float:
        clock = self.prep_clock
        try:
            return clock() if clock is not None else 0.0
        except OSError:  # the preparing thread is gone
            return 0.0

    def add(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.spent[kind] = self.spent.get(kind, 0.0) + seconds

    def submitted(self) -> None:
        """A preparation starts: record from this iteration on."""
        self.open_windows += 1
        self.preparing = True

    def installed(self) -> None:
        """A preparation was installed: record its first batches too."""
        self.open_windows = max(0, self.open_windows - 1)
        self.until = self.now() + AFTER_INSTALL_S

    def boundary(self) -> None:
        """One loop iteration ended (the scheduler thread, at each ``process_input_requests``)."""
        at = self.now()
        with self.lock:
            record = self.spent
            wall, cpu, prep = at - self.t0, self.cpu() - self.cpu0, self._prep() - self.prep0
            inside = self.every or self.preparing or self.open_windows > 0 or self.t0 < self.until
            t0 = self.t0
            self._start(at)
        if inside:
            self.emit("lorapub iteration " + json.dumps(
                {"t": round(t0, 6), "wall": round(1e3 * wall, 3), "cpu": round(1e3 * cpu, 3),
                 "prep_cpu": round(1e3 * max(0.0, prep), 3), "preparing": self.preparing or None,
                 **{k: round(1e3 * v, 3) for k, v in record.items() if v}}, separators=(",", ":")))


def parse_line(line: str) -> dict[str, Any] | None:
    """One logged record back, or None for any other line."""
    at = line.find("lorapub iteration {")
    if at < 0:
        return None
    try:
        record = json.loads(line[at + len("lorapub iteration "):])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None  # a "{...}" that parsed is an object
