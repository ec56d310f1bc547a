"""bench/live_relax/driver.py --quick runs end to end against two SGLang doubles (no GPU): the
Relax-shaped rollouts through lorapub's Relax integration, lorapub off (Relax's pause, flush and
overwrite) and the no-publication control. It prints every figure and its method; lorapub serves no
group from two versions and sends no pause or flush, every publish call is counted, and Relax's own
path reaches the engines with its pauses and flushes. Timings are the benchmark's business, not a
test's: none is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "live_relax", "driver.py")


def load_driver():
    """driver.py as a module (for its table of figures), leaving sys.path as it was."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("lorapub_live_relax_driver", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


driver = load_driver()


def test_the_quick_relax_run_prints_every_figure_and_lorapub_never_pauses(tmp_path):
    out = tmp_path / "relax.json"
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    for name, _, _ in driver.ROWS:
        assert name in text, name
    for line in ("method:", "excess no-progress gap over control", "servers left as found after every run",
                 "lorapub off publish calls:", "lorapub on publish calls:", "== checks =="):
        assert line in text, line
    assert "[FAIL]" not in text and text.count("[pass]") == 7

    figures = json.loads(out.read_text())
    assert figures["counted_from"] == "engines"  # the doubles' own event logs
    (round_,) = figures["rounds"]  # --quick: one round
    on, off, control = round_["lorapub"], round_["overwrite"], round_["control"]
    quick = driver.QUICK
    for run in (on, off, control):
        assert run["groups"] == quick["groups"] and not run["group_errors"]
        assert run["requests"] > 0 and run["lost"] == 0
        assert run["left_as_found"] and run["differs"] == []
        assert run["boot_pause"] == run["boot_flush"] == 2  # the first sync is Relax's own, on both engines

    assert on["mixed_groups"] == 0 and on["mixed_sessions"] == 0
    assert on["pause"] == on["flush"] == on["continue"] == 0
    assert on["failed"] == 0 and on["digests_ok"]
    outcomes = [c["outcome"] for c in on["call_log"]]
    assert len(outcomes) == on["calls"] == 4
    assert set(outcomes) <= {"done", "superseded", "deferred", "failed"}
    assert on["done"] + on["superseded"] + on["deferred"] + on["failed_calls"] == 4
    assert on["done"] >= 1 and on["skipped"] == on["pending"] == 0
    assert on["lag_max"] == on["lag_max"]  # measured (not NaN)

    assert off["pause"] == off["flush"] == off["continue"] == 2 * 4  # every update, on both engines
    assert [c["outcome"] for c in off["call_log"]] == ["done"] * 4
    assert control["calls"] == 0 and control["pause"] == control["flush"] == 0
    for key in ("overwrite_excess_gap", "lorapub_excess_gap"):
        assert round_["derived"][key] == round_["derived"][key]
    assert all(figures["checks"].values())
