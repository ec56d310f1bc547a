"""The prepared load's switches, read from the server's environment."""

from __future__ import annotations

import logging
import os

from lorapub.sglang_patch.env import env_number

__all__ = ["DEFAULT_GATE_BUDGET_S", "DEFAULT_HELPER_DEADLINE_S", "DEFAULT_HELPER_START_S", "ENV", "GATE_BUDGET_ENV",
           "GATE_ENV", "HELPER_DEADLINE_ENV", "HELPER_START_ENV", "HELPER_THREADS_ENV", "IMAGE_ENV", "MARK", "SWITCH_ENV", "TRACE_ENV",
           "enabled", "gate_budget", "gate_scope", "helper_deadline", "helper_start_deadline", "helper_threads",
           "slot_images_enabled", "switch_interval", "trace_setting"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch

ENV = "LORAPUB_SGLANG_PREPARE"
MARK = "__lorapub_prepared_load__"
#: "1": log every garbage collection of 5 ms or more, the scheduler's loop iterations while a preparation
#: runs (beside as long a stretch before it), and each memory-pool slot fill, with their times, and each
#: scheduler iteration of a publication's window as a ``lorapub iteration`` record (iterations.py); "all":
#: the same, with a record for every iteration (a run's control, which publishes nothing, is then
#: attributed over the same stretches).
TRACE_ENV = "LORAPUB_SGLANG_PREPARE_TRACE"
#: GIL switch interval (microseconds) while a preparation runs; unset: the interpreter's own (5 ms).
#: Measured live as worse than the default; kept to reproduce that measurement.
SWITCH_ENV = "LORAPUB_SGLANG_PREPARE_SWITCH_US"
#: "0": no slot images (each adapter's first batch fills its pool slot the stock way). Unset or anything
#: else: each adapter gets a slot image while it is prepared and is resident at its install
#: (docs/sglang-patch.md, "Slot images").
IMAGE_ENV = "LORAPUB_SGLANG_SLOT_IMAGE"
#: When the preparing thread steps aside for a prefill batch (see PrefillGate): unset or "launch", while the
#: scheduler thread launches it (the gate opens as SGLang's run_batch returns); "batch", until the
#: scheduler's next loop iteration (the earlier rule, kept to reproduce its measurements); "0" or "off", never.
GATE_ENV = "LORAPUB_SGLANG_PREPARE_GATE"
#: Milliseconds one preparation waits for prefills in all before it stops stepping aside (default
#: 150): a lower cap bounds a load's latency under back-to-back prefills, at the GIL cost the gate saves.
GATE_BUDGET_ENV = "LORAPUB_SGLANG_PREPARE_GATE_BUDGET_MS"
#: 150 ms, not the earlier 1 s: live, a load's decode gaps stayed within a few ms of the control with
#: either (docs/benchmarks.md, Part 5: pooled medians +1.6 and +0.1 ms), and in the online runs so far
#: only 150 ms brought a new version's first token under 0.75 s (1 s: 1.8 s, its loads waiting up to
#: the whole second behind prefills).
DEFAULT_GATE_BUDGET_S = 0.15
#: Seconds the preparing helper process has for one load (read, SGLang's processing, cast, copy to the
#: device) before it is killed and restarted and the load fails (default 60: a 264 MB adapter took
#: 0.12-0.22 s live with one thread, 4.6-12.1 s with torch's default: docs/sglang-patch.md, "Measured live";
#: the margin is for a loaded host).
HELPER_DEADLINE_ENV = "LORAPUB_SGLANG_PREPARE_HELPER_DEADLINE_S"
DEFAULT_HELPER_DEADLINE_S = 60.0
#: Seconds a newly started helper has to be ready (import torch and SGLang's LoRA code, make its CUDA
#: context) before a load that waits for it fails and it is restarted (default 300).
HELPER_START_ENV = "LORAPUB_SGLANG_PREPARE_HELPER_START_S"
DEFAULT_HELPER_START_S = 300.0
#: torch's intra-op thread count in the helper (default 1). SGLang's scheduler process runs with one
#: (``ModelRunner.load_model`` sets it), so the preparation ran with one before the helper existed; a
#: spawned helper would otherwise take torch's default, one per core, and each of the ~500 weights' casts
#: and copies would wait for the slowest of as many threads on a host whose cores the servers keep busy.
HELPER_THREADS_ENV = "LORAPUB_SGLANG_PREPARE_HELPER_THREADS"
DEFAULT_HELPER_THREADS = 1


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def gate_scope() -> str:
    """``GATE_ENV`` as "launch", "batch" or "off"; an unknown value is logged and "launch" holds."""
    raw = os.environ.get(GATE_ENV, "").strip().lower()
    if raw in ("", "1", "launch"):
        return "launch"
    if raw == "batch":
        return "batch"
    if raw in ("0", "off", "false", "no"):
        return "off"
    logger.warning("lorapub: %s=%r is not launch, batch or 0; launch holds", GATE_ENV, raw)
    return "launch"


def switch_interval() -> float | None:
    """``SWITCH_ENV`` in seconds; None when unset or not a positive integer (logged)."""
    us = env_number(SWITCH_ENV, int, lambda n: n > 0, "a positive number of microseconds", "ignored", logger)
    return None if us is None else us / 1e6


def gate_budget(default_s: float = DEFAULT_GATE_BUDGET_S) -> float:
    """``GATE_BUDGET_ENV`` in seconds; ``default_s`` when unset or not a number >= 0 (logged)."""
    ms = env_number(GATE_BUDGET_ENV, float, lambda n: n >= 0, "a number of milliseconds >= 0",
                    f"the default {1e3 * default_s:g} ms holds", logger)
    return default_s if ms is None else ms / 1e3


def helper_deadline(default_s: float = DEFAULT_HELPER_DEADLINE_S) -> float:
    """``HELPER_DEADLINE_ENV`` in seconds; ``default_s`` when unset or not a number > 0 (logged)."""
    s = env_number(HELPER_DEADLINE_ENV, float, lambda n: n > 0, "a number of seconds > 0",
                   f"the default {default_s:g} s holds", logger)
    return default_s if s is None else s


def helper_start_deadline(default_s: float = DEFAULT_HELPER_START_S) -> float:
    """``HELPER_START_ENV`` in seconds; ``default_s`` when unset or not a number > 0 (logged)."""
    s = env_number(HELPER_START_ENV, float, lambda n: n > 0, "a number of seconds > 0",
                   f"the default {default_s:g} s holds", logger)
    return default_s if s is None else s


def helper_threads(default: int = DEFAULT_HELPER_THREADS) -> int:
    """``HELPER_THREADS_ENV``; ``default`` when unset or not an integer > 0 (logged)."""
    n = env_number(HELPER_THREADS_ENV, int, lambda v: v > 0, "an integer > 0", f"the default {default} holds", logger)
    return default if n is None else int(n)


def slot_images_enabled() -> bool:
    """Slot images are on unless ``IMAGE_ENV`` is "0" (or "off")."""
    import os

    return os.environ.get(IMAGE_ENV, "").strip().lower() not in ("0", "off")


def trace_setting() -> str | None:
    """The server's trace: None (off), "1" (around loads) or "all" (every scheduler iteration)."""
    import os

    raw = os.environ.get(TRACE_ENV, "").strip().lower()
    return raw if raw in ("1", "all") else None
