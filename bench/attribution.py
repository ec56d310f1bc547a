"""Where a publication's decode stall went: the decode probe's slow steps joined to the scheduler's iterations.

A patched server started with ``LORAPUB_SGLANG_PREPARE_TRACE=1`` logs every scheduler iteration inside a
publication's window as ``lorapub iteration {json}`` (``lorapub.sglang_patch.prepared_load.iterations``),
stamped with ``time.monotonic()``: on one host, the clock the bench's decode probe stamps its tokens with.
For each publication and engine this module takes the probe's slow steps inside the publication's window
(a gap between two tokens longer than ``SLOW`` times the engine's median step over the whole run, and at
least ``MIN_EXCESS_S`` over it), finds the iterations of that engine overlapping each, and sums what they
spent: launching prefills and decode batches, the install, slot fills, collections, the scheduler thread's
own CPU time and its waiting (``wall - cpu``: for the interpreter, the GPU or its sockets), and the
preparing thread's CPU time beside it. Causes overlap (a fill happens inside a launch; the preparing
thread's CPU runs while the scheduler waits), so they are named side by side, never added up.
"""

from __future__ import annotations

import statistics
from typing import Iterable

from lorapub.sglang_patch.prepared_load.iterations import parse_line

__all__ = ["CAUSES", "MIN_EXCESS_S", "SLOW", "attribute", "read_iterations", "summarize"]

SLOW = 1.5
MIN_EXCESS_S = 0.005
#: A record's fields (ms) as named in the bench's output, in order.
CAUSES = (("prefill", "prefill launches"), ("decode", "decode launches"), ("install", "install"),
          ("fill", "slot fills"), ("gc", "gc"), ("wait", "scheduler waiting"),
          ("prep_cpu", "preparing thread's CPU"))


def read_iterations(path: str, lo: float, hi: float) -> list[dict]:
    """The records of ``path`` whose iteration started in [lo, hi] (monotonic seconds)."""
    found = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if "lorapub iteration " not in line:
                    continue
                record = parse_line(line)
                if record is not None and lo <= record["t"] <= hi:
                    found.append(record)
    except OSError:
        return []
    return found


def _median_step(ticks: list[float]) -> float:
    steps = [b - a for a, b in zip(ticks, ticks[1:])]
    return statistics.median(steps) if steps else float("nan")


def attribute(ticks: dict[str, list[float]], records: dict[str, list[dict]],
              windows: Iterable[tuple[float, float]]) -> list[dict]:
    """Per window (absolute monotonic, as ``ticks`` and ``records``): per engine, its slow probe steps,
    their excess over the engine's median step, and what the overlapping iterations spent (ms)."""
    medians = {e: _median_step(ts) for e, ts in ticks.items()}
    out = []
    for lo, hi in windows:
        per_engine = {}
        for engine, ts in ticks.items():
            median = medians[engine]
            slow = [(a, b) for a, b in zip(ts, ts[1:]) if not (b < lo or a > hi)
                    and b - a > max(SLOW * median, median + MIN_EXCESS_S)]
            spent = dict.fromkeys((k for k, _ in CAUSES), 0.0)
            seen = set()
            for a, b in slow:
                for i, r in enumerate(records.get(engine, ())):
                    start, end = r["t"], r["t"] + r["wall"] / 1e3
                    if i in seen or end < a or start > b:
                        continue
                    seen.add(i)
                    for key in spent:
                        spent[key] += max(0.0, r["wall"] - r["cpu"]) if key == "wait" else r.get(key, 0.0)
            per_engine[engine] = {"slow_steps": len(slow), "excess_ms": round(sum(b - a - median for a, b in slow) * 1e3, 1),
                                  "longest_ms": round(max((b - a for a, b in slow), default=0.0) * 1e3, 1),
                                  "iterations": len(seen), "recorded": bool(records.get(engine)),
                                  **{k: round(v, 1) for k, v in spent.items()}}
        out.append(per_engine)
    return out


def summarize(label: str, attributed: list[dict]) -> list[str]:
    """One line per publication and engine."""
    lines = []
    for n, per_engine in enumerate(attributed, 1):
        for engine, a in sorted(per_engine.items()):
            if not a["slow_steps"]:
                lines.append(f"  {label} publication {n} {engine}: no slow probe step")
                continue
            causes = ", ".join(f"{text} {a[key]:.1f}" for key, text in CAUSES if a[key] >= 0.05)
            where = (f"{a['iterations']} scheduler iteration(s): {causes or 'nothing recorded'}" if a["recorded"]
                     else "no iteration records (the server's trace was off or its log unreadable)")
            lines.append(f"  {label} publication {n} {engine}: {a['slow_steps']} slow probe step(s), "
                         f"+{a['excess_ms']:.1f} ms over its median step (longest {a['longest_ms']:.1f} ms); {where}")
    return lines
