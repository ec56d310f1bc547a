"""The decode-gap benchmark's offline parts (bench/live_load_gap): its summary compares a publication
with a control as long as it, and the pooled figures the docs quote are what pool.py prints from the
live runs kept in bench/results/2026-12-03-load-gap."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "live_load_gap")


def run(script, *args):
    done = subprocess.run([sys.executable, os.path.join(BENCH, script), *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_publication_is_compared_with_both_control_windows_not_one(tmp_path):
    # one repetition: control 70 ms then control_b 80 ms (6 s of control), load 78 ms, first use 76 ms
    kinds = [("control", 70.0), ("control_b", 80.0), ("load", 78.0), ("first_use", 76.0), ("unload", 60.0)]
    windows, t = [], 0.0
    for kind, gap in kinds:
        w = {"kind": kind, "variant": "B", "rep": 0, "t0": t, "t1": t + 3.0, "merged_max_gap_ms": gap,
             "itl_p50_ms": 8.5}
        if kind in ("load", "first_use", "unload"):
            w["latency_ms"] = 300.0
        if kind == "first_use":
            w["old_latency_ms"] = 299.0
        windows.append(w)
        t += 3.0
    (tmp_path / "patched.json").write_text(json.dumps({"info": {"streams": 48, "n_errors": 0}, "windows": windows}))
    with gzip.open(tmp_path / "patched_events.txt.gz", "wt") as f:
        for i in range(int(t / 0.005)):
            f.write(f"{i * 0.005:.5f} 0 0\n")
    out = run("summarize.py", tmp_path)
    [line] = [x for x in out.splitlines() if x.startswith("publication B:")]
    # 78 against the longer control's 80, not against the first window's 70 alone (+8.0)
    assert "control over as long [80.0], median 80.0; excess -2.0" in line

    # a server of the run's order that never answered is named in the summary, not silently absent
    (tmp_path / "not_measured.txt").write_text("patched-budget150: it died at boot (its log says why)\n")
    out = run("summarize.py", tmp_path)
    assert "## patched-budget150  NOT MEASURED: it died at boot (its log says why)" in out.splitlines()


def test_the_pooled_live_figures_in_the_docs_are_what_pool_prints():
    out = run("pool.py")
    rows = [x for x in out.splitlines() if x.startswith("| ") and "---" not in x and not x.startswith("| server")]
    servers = {r.split(" | ")[0].lstrip("| ") for r in rows}
    assert {"patched", "patched-ungated", "unpatched"} <= servers
    with open(os.path.join(ROOT, "docs", "gpu-acceptance.md")) as f:
        doc = f.read()
    missing = [r for r in rows if r not in doc]
    assert not missing, "docs/gpu-acceptance.md does not quote: " + "\n".join(missing)


def test_pool_pairs_windows_by_repetition_skips_short_controls_and_reads_an_empty_window_as_a_gap(tmp_path):
    def windows(gaps_by_rep, with_control_b=True):
        out = []
        for rep, (ctl, ctl_b, load, first) in gaps_by_rep.items():
            kinds = [("control", ctl)] + ([("control_b", ctl_b)] if with_control_b else []) + [
                ("load", load), ("first_use", first)]
            for kind, gap in kinds:
                out.append({"variant": "B", "kind": kind, "rep": rep, "t0": 0.0, "t1": 3.0, "merged_max_gap_ms": gap})
        return out[::-1]  # out of order: pairing must go by repetition

    (tmp_path / "run7-patched.json").write_text(json.dumps({"windows": windows({
        0: (70.0, 80.0, 78.0, 76.0),  # 78 - 80 = -2
        1: (60.0, 50.0, None, 65.0),  # a load window without two tokens: a 3000 ms gap -> 2940
        2: (40.0, 40.0, 45.0, 44.0),  # +5
    })}))
    (tmp_path / "run6-patched.json").write_text(json.dumps({"windows": windows({0: (1.0, 0, 900.0, 1.0)}, False)}))
    out = run("pool.py", tmp_path)
    [row] = [x for x in out.splitlines() if x.startswith("| patched | B |")]
    assert row.startswith("| patched | B | 7 | 3 | [-2.0, 5.0, 2940.0] | +5.0 |")  # run 6 (one control) left out


def test_a_median_interval_covers_at_least_what_it_says():
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("pool_for_test", os.path.join(BENCH, "pool.py"))
    pool = importlib.util.module_from_spec(spec)
    saved = sys.argv
    try:
        sys.argv = ["pool.py", os.path.join(ROOT, "bench", "results", "2026-12-03-load-gap")]
        spec.loader.exec_module(pool)
    finally:
        sys.argv = saved
    assert pool.median_interval([1.0, 2.0, 3.0]) is None  # too few for 95 %
    rng = random.Random(3)
    hits = trials = 0
    for _ in range(2000):  # samples of 14 from a distribution with median 0
        x = [rng.gauss(0, 1) for _ in range(14)]
        lo, hi, coverage = pool.median_interval(x)
        assert abs(coverage - 0.987) < 0.001 and lo <= hi
        hits += lo <= 0.0 <= hi
        trials += 1
    assert hits / trials >= 0.97
