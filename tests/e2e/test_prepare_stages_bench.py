"""bench/live_prepare/stages.py, the live bench that times a preparation's steps, runs on the CPU with a
tiny adapter and the SGLang release's own LoRA code (the tests' compiled copy): every step of every
variant, the real helper's end-to-end preparation and each way of making the slot image are reported (no
timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests import sglang_real

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "live_prepare", "stages.py")


def test_the_stages_bench_reports_every_step_in_both_places_and_through_the_helper(tmp_path):
    root = sglang_real.release_root("0.5.17")
    if root is None:
        pytest.skip("no SGLang 0.5.17 tree for the release's LoRA code")
    out = tmp_path / "stages.json"
    env = {**os.environ, "LORAPUB_STAGES_CLASSES": f"tests:{root}",
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, SCRIPT, "--shape", "tiny", "--device", "cpu", "--reps", "1",
                           "--busy", "1", "--json", str(out)], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    for place in ("this process", "spawned"):
        assert report[place]["where"]["pid"] > 0
        assert len(report[place]["probes"]) == 1
        assert set(report[place]["steps"]) >= {"reader mapped, threads default", "reader mapped, threads 1",
                                               "reader read, threads default", "reader read, threads 1"}
        if sys.platform == "linux":  # glibc: the freed-memory variant runs too
            assert "reader mapped, threads default, freed memory kept" in report[place]["steps"]
            assert len(report[place]["probes, freed memory kept"]) == 1
        for rows in report[place]["steps"].values():
            assert len(rows) == 1 and all(set(r) == {"read", "SGLang's processing", "cast and copy to the device",
                                                     "total"} for r in rows)
    assert report["spawned"]["where"]["pid"] != report["this process"]["where"]["pid"]
    helper = report["helper"]["prepared"]
    assert len(helper) == 1 and "start to first shipped" in helper[0]
    assert all(r["helper: processing"] >= 0 and r["helper: pack"] >= 0 and r["helper: CPU"] >= 0 for r in helper)
    assert helper[0]["helper: threads"] == 1  # as the scheduler's process runs
    busy = report["busy host"]
    assert busy["spinners"] == 1 and set(busy["steps"]) == {"reader mapped, threads default, 1 cores busy",
                                                            "reader mapped, threads 1, 1 cores busy"}
    assert all(len(rows) == 1 for rows in busy["steps"].values())
    kinds = {"lorapub.Snapshot", "control: per-tensor copy and check on torch's pool"}
    for table in (report["snapshots"], busy["snapshots"]):  # idle and busy: each way, each thread count
        assert set(table) == {f"{k}, threads {t}" for k in kinds for t in ("default", 1)}
        assert all(len(runs) == 1 and runs[0] > 0 for runs in table.values())
    images = report["images"]  # each way of making the slot image, the plan-made one equal to the fill's
    assert set(images) == {"SGLang's fill (control)", "SGLang's fill, recorded", "the plan's replay (helper)",
                           "views of the shipped image (scheduler)", "plan"}
    assert all(len(rows) == 1 and rows[0]["wall"] >= 0 and rows[0]["CPU"] >= 0
               for name, rows in images.items() if name != "plan")
    assert images["views of the shipped image (scheduler)"][0]["equal to the fill's"] == 1.0
    assert images["plan"][0]["ops"] > 0
    assert "== the adapter's slot image, each way" in done.stdout
    assert "== the publisher's snapshot of the adapter, busy host" in done.stdout
    assert "== the helper (HelperClient)" in done.stdout
