"""The decode-gap benchmark's offline parts (bench/live_load_gap): its summary compares a publication
with a control as long as it, and the pooled figures the docs quote are what pool.py prints from the
live runs kept in docs/gpu/load-gap."""

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


def test_the_pooled_live_figures_in_the_docs_are_what_pool_prints():
    out = run("pool.py")
    rows = [x for x in out.splitlines() if x.startswith("| ") and "---" not in x and not x.startswith("| server")]
    servers = {r.split(" | ")[0].lstrip("| ") for r in rows}
    assert {"patched", "patched-ungated", "unpatched"} <= servers
    with open(os.path.join(ROOT, "docs", "gpu-acceptance.md")) as f:
        doc = f.read()
    missing = [r for r in rows if r not in doc]
    assert not missing, "docs/gpu-acceptance.md does not quote: " + "\n".join(missing)
