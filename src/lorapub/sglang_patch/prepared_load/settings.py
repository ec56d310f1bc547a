"""The prepared load's switches, read from the server's environment."""

from __future__ import annotations

import logging
import os

__all__ = ["ENV", "GATE_BUDGET_ENV", "GATE_ENV", "IMAGE_ENV", "MARK", "SWITCH_ENV", "TRACE_ENV", "enabled", "gate_budget",
           "switch_interval"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch

ENV = "LORAPUB_SGLANG_PREPARE"
MARK = "__lorapub_prepared_load__"
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
#: Milliseconds one preparation waits for prefills in all before it stops stepping aside (default
#: 1000): a lower cap bounds a load's latency under back-to-back prefills, at the GIL cost the gate saves.
GATE_BUDGET_ENV = "LORAPUB_SGLANG_PREPARE_GATE_BUDGET_MS"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"



def switch_interval() -> float | None:
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


def gate_budget(default_s: float = 1.0) -> float:
    """``GATE_BUDGET_ENV`` in seconds; ``default_s`` when unset or not a number >= 0 (logged)."""
    raw = os.environ.get(GATE_BUDGET_ENV)
    if not raw:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms >= 0:
        logger.warning("lorapub: %s=%r is not a number of milliseconds >= 0; the default %g ms holds",
                       GATE_BUDGET_ENV, raw, 1e3 * default_s)
        return default_s
    return ms / 1e3
