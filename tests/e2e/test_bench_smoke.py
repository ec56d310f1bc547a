"""bench/run.py --quick runs end to end, prints every figure it promises and draws its timeline
plot (the figures' values are the benchmark's business, not a test's: no timing is asserted
here). The plot needs matplotlib: the ``bench`` extra, which .ci/install installs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "run.py")


def load_bench():
    """bench/run.py as a module (for its table of figures), leaving sys.path as it was."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("lorapub_bench_run", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


bench = load_bench()


def test_the_quick_benchmark_prints_every_figure_and_draws_its_timeline(tmp_path):
    out, png = tmp_path / "figures.json", tmp_path / "timeline.png"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    for name, _, _, _ in bench.ROWS:
        assert name in text
    for line in ("method:", "excess no-progress gap over control", "excess request latency p99 over control",
                 "share of the baseline's excess stall that lorapub removes", "lorapub phases",
                 "== control plane", "== performance bars =="):
        assert line in text

    figures = json.loads(out.read_text())
    online = figures["online"]
    (round_,) = online["rounds"]  # --quick: one round
    for strategy in bench.STRATEGIES:
        run = round_[strategy]
        for _, key, _, applies in bench.ROWS:
            assert key in run
            if strategy in applies:  # a figure that applies is measured, not NaN
                assert not math.isnan(run[key]), (strategy, key)
                assert not math.isnan(online["summary"][strategy][key]["median"]), (strategy, key)
        assert run["requests"] > 0
    assert round_["baseline"]["published"] == round_["lorapub"]["published"] == 1
    assert set(round_["lorapub"]["phases"]) == {"begin", "transfer", "end", "commit"}
    for key in ("baseline_excess_gap", "lorapub_excess_gap", "baseline_excess_p99", "lorapub_excess_p99", "removed"):
        assert not math.isnan(round_["derived"][key])
        assert set(online["summary"]["derived"][key]) == {"median", "min", "max"}
    assert len(online["load_average"]) == 2
    assert {"2 engines", "64 engines", "10 sessions", "10000 sessions"} <= set(figures["control_plane"])
    assert len(figures["bars"]) == 5

    # The timeline plot: a real PNG, and its data are the run's completions, every one in a bin.
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert len(data) > 20_000  # three panels of lines, labels and a legend, not an empty canvas
    assert "timeline plot (round 1)" in text
    plot = online["timeline"]
    assert plot["round"] == 1 and plot["bin"] == bench.PLOT_BIN
    assert set(plot["counts"]) == set(bench.STRATEGIES)
    for strategy in bench.STRATEGIES:
        run = round_[strategy]
        counts = plot["counts"][strategy]
        assert set(counts) == {"e0", "e1"}  # one line per engine
        assert all(len(row) == plot["bins"] for row in counts.values())
        assert sum(map(sum, counts.values())) == run["requests"] - run["failed"]
        completions = run["timeline"]["completions"]
        assert {e: len(ts) for e, ts in completions.items()} == {e: sum(row) for e, row in counts.items()}
        assert all(0 <= t < plot["bins"] * plot["bin"] for ts in completions.values() for t in ts)
    marks = plot["marks"]
    assert marks["control"] == {"publications": [], "pauses": []}
    assert len(marks["baseline"]["publications"]) == len(marks["baseline"]["pauses"]) == 1
    assert len(marks["lorapub"]["publications"]) == 1 and marks["lorapub"]["pauses"] == []
    (start, end), ((pause_start, pause_end),) = marks["baseline"]["publications"][0], marks["baseline"]["pauses"]
    assert start <= pause_start < pause_end <= end  # the pause lies inside its publication


MEMORY_BENCH = os.path.join(ROOT, "bench", "memory_bench.py")


def test_the_quick_memory_benchmark_prints_every_figure():
    """bench/memory_bench.py --quick runs and prints each scenario's row (no timing asserted)."""
    done = subprocess.run([sys.executable, MEMORY_BENCH, "--quick"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert "per live session" in text and "per tombstone" in text
    for row in ("empty", "pmap ctl", "memory", "sqlite"):
        assert any(line.startswith(row) for line in text.splitlines()), row
    assert "bar at 2,000 live sessions" in text
