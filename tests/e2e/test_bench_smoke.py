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
import time

import pytest

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
                 "excess decode stall per publication (probe; control: same stretches)",
                 "decode probe streams (control, every round)",
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
    for strategy in ("baseline", "lorapub"):  # the first request on the new version: sent before it completed
        run = round_[strategy]
        assert 0 < run["to_first_sent"] <= run["to_first_served"], strategy
    assert round_["lorapub"]["to_first_sent_each"] and "lorapub publish call to the first request sent" in text
    for strategy in ("baseline", "lorapub"):  # the first-token requests: one per engine per landed call, all answered
        run = round_[strategy]
        assert run["first_token_requests"] == {"sent": 2, "ok": 2, "failed": 0}, strategy
        assert run["call_to_commit"] <= run["to_first_token"] < run["call_to_commit"] + 5, strategy
    assert "first-token requests (lorapub, every round): sent 2, ok 2, failed 0" in text
    for key in ("baseline_excess_gap", "lorapub_excess_gap", "baseline_excess_p99", "lorapub_excess_p99", "removed"):
        assert not math.isnan(round_["derived"][key])
        assert set(online["summary"]["derived"][key]) == {"median", "min", "max"}
    assert len(online["load_average"]) == 2
    assert {"2 engines", "64 engines", "10 sessions", "10000 sessions"} <= set(figures["control_plane"])
    assert len(figures["bars"]) == 11  # on_stale is lorapub's default here: no session may be cut
    for bar in ("lorapub's excess decode stall per publication <= 5 ms", "probe tokens lost while lorapub publishes <= 2 %",
                "lorapub publish call to its first token p50 <= 0.5 s", "0 sessions cut by BINDING_STALE with lorapub"):
        assert any(name.startswith(bar) for name in figures["bars"]), bar
    assert "workload duration over control (rollouts)" in text
    calls = round_["lorapub"]["call_log"]  # every publish call counted, with how it ended
    assert [c["outcome"] for c in calls] == ["done"] and round_["lorapub"]["calls"] == 1

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
    marks = plot["marks"]  # every publish call: called, slot taken, ended, its outcome (and the old path's pause)
    assert marks["control"] == []
    (base,), (lp,) = marks["baseline"], marks["lorapub"]
    assert base["outcome"] == lp["outcome"] == "done"
    assert base["called"] <= base["paused"][0] < base["paused"][1] <= base["ended"]  # the pause lies inside its call
    assert "paused" not in lp and lp["called"] <= lp["slot"] <= lp["ended"]


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


def test_the_quick_benchmark_against_real_servers_publishes_a_peft_folder_over_http_and_cleans_up(tmp_path):
    """The --engine-url path (what runs against live SGLang), here against two contract doubles in
    processes of their own: versions of a PEFT folder over HTTP into the engines' staging, the old
    path beside it, and every run leaves the servers as it found them."""
    import torch
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file({f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight":
               torch.randn((8, 64) if ab == "A" else (64, 8), generator=g).to(torch.bfloat16)
               for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"}, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"],
         "base_model_name_or_path": "/somewhere/base"}))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    servers = [subprocess.Popen([sys.executable, "-m", "lorapub.testing.serve_double", f"e{i}", str(tmp_path / f"stash{i}")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for i in range(2)]
    try:
        urls = [s.stdout.readline().split()[1] for s in servers]
        out = tmp_path / "figures.json"
        # twice on the same servers, as a driver runs several workloads: the servers keep every
        # cleaned attempt's tombstone, so the second invocation must not reuse the first's epochs
        # the second time with the servers' logs: a server traced with "all" logs every scheduler iteration
        # (here made up: one every 20 ms, the decode launch taking half of it), and the bench attributes
        # each publication's slow probe steps, and the control's over the same stretches, to them
        logs = [tmp_path / f"server-e{i}.log" for i in range(2)]
        now = time.monotonic()
        for log in logs:
            log.write_text("".join(f'x lorapub iteration {{"t":{now + 0.02 * k:.3f},"wall":20.0,"cpu":12.0,'
                                   f'"prep_cpu":1.0,"decode":10.0}}\n' for k in range(15000)))
        for with_logs in (False, True):
            done = subprocess.run(
                [sys.executable, SCRIPT, "--quick", "--rounds", "2", "--engine-url", urls[0], "--engine-url", urls[1],
                 "--transport", "http", "--adapter", str(adapter), "--json", str(out),
                 *(a for log in logs for a in ("--engine-log", str(log)) if with_logs)],
                capture_output=True, text=True, timeout=300,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert ("where the time went (--engine-log" in done.stdout) == with_logs
            if with_logs:
                assert "where the time went, lorapub (median of 4 publication-engines)" in done.stdout
                assert "where the time went, control over lorapub's stretches (median of 4" in done.stdout
                assert "round 1 lorapub publication 1 e0:" in done.stdout
                kept = json.loads(out.read_text())["online"]["rounds"][0]
                assert len(kept["lorapub"]["attribution"]) == 1 and "_records" not in kept["control"]
            assert "lorapub's bytes over HTTP into the engine's own staging" in done.stdout
            assert "(8 tensors, 0 MB)" in done.stdout
            rounds = json.loads(out.read_text())["online"]["rounds"]
            assert len(rounds) == 2 and all(r["lorapub"]["published"] == r["baseline"]["published"] == 1 for r in rounds)
            assert all(r[s]["failed"] == 0 for r in rounds for s in bench.STRATEGIES)
        import urllib.request

        for url in urls:  # every run unloaded what it loaded: the servers serve no adapter now
            with urllib.request.urlopen(url + "/v1/models") as r:
                models = [m["id"] for m in json.loads(r.read())["data"]]
            assert models == ["lorapub-tiny-qwen3"], models
    finally:
        for s in servers:
            s.stdin.close()
        for s in servers:
            s.wait(timeout=30)
    for i in range(2):  # each server freed its stash as it stopped: no folder, no claim
        assert os.listdir(tmp_path / f"stash{i}") == [], os.listdir(tmp_path / f"stash{i}")


def test_the_transport_benchmark_runs_every_transport_and_prints_the_callers_loop_figures(tmp_path):
    """bench/transport_bench.py on one layer of the adapter: every transport publishes, fails
    clean and leaves no stash; each row carries the loop figures the bar is judged on, each
    publication names its longest loop step, and its figures come back side by side."""
    bench = os.path.join(ROOT, "bench", "transport_bench.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    figures = str(tmp_path / "run.json")
    done = subprocess.run(
        [sys.executable, bench, "--layers", "1", "--repeat", "2", "--label", "now", "--json", figures],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert "longest loop step: wall / CPU" in rows[0] and "caller's loop: CPU per publication" in rows[0]
    assert "steps > 5 ms: wall / CPU" in rows[0] and "control (idle loop, as long)" in rows[0]
    assert "publish() less the engines' load s" in rows[0]
    names = ["HTTP bytes", "HTTP bytes, posted on the caller's loop", "same-host IPC (/dev/shm, tensor load)",
             "same-host IPC (/dev/shm, folder load)", "torch.distributed (gloo)"]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows[1:]] == names
    for row in rows[1:]:
        assert row.endswith("| 0 (1 reclaimed, failed clean: True) |"), row  # no stash left, failure cleaned
    named = [line for line in done.stdout.splitlines() if line.strip().startswith("longest step ")]
    assert len(named) == 2 * len(names) and all(" ms: " in line and " -> " in line for line in named)
    assert sum(line.strip().startswith(tuple(f"{n}: publish() median" for n in names))
               for line in done.stdout.splitlines()) == len(names)  # a bar verdict per transport
    side = subprocess.run([sys.executable, bench, "--side-by-side", figures], capture_output=True, text=True,
                          timeout=60, env=env)
    assert side.returncode == 0, side.stderr
    assert [line.split(" | ")[:3] for line in side.stdout.splitlines()[2:]] == [[f"| {n}", "now", "2"] for n in names]


@pytest.mark.ray  # registry_bench.py starts a local Ray cluster
def test_the_ray_registry_benchmark_prints_a_row_per_caller_count_and_size(tmp_path):
    """bench/registry_bench.py, small: callers 1 and 100 at one size, then 100 callers at a larger
    one (with the actor-freeze control); every row prints, the control makes one actor call per
    command and the batched runs fewer, and the actor's own apply and collections are timed."""
    out = tmp_path / "registry.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "registry_bench.py"), "--callers", "1,100", "--live", "50,200",
         "--transitions", "200", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    control, batched, unfrozen = "one call per command (control)", "batched", "batched, actor not frozen (control)"
    assert [(r["live_sessions"], r["callers"], r["strategy"]) for r in rows] == [
        (50, 1, control), (50, 1, batched), (50, 100, control), (50, 100, batched), (50, 100, unfrozen),
        (200, 100, control), (200, 100, batched), (200, 100, unfrozen)]
    calls = {(r["live_sessions"], r["callers"], r["strategy"]): r["runs"][0]["calls"] for r in rows}
    assert calls[(50, 100, control)] == 200 and calls[(50, 100, batched)] < 20
    assert all(r["runs"][0]["apply_max"] > 0 for r in rows)  # timed inside the actor
    printed = [line for line in done.stdout.splitlines() if "actor not frozen (control)" in line]
    assert len(printed) == 2


def test_the_decode_probe_counts_every_stream_and_the_gaps_overlapping_a_window():
    from bench.decode_probe import probe_gap

    ticks = {"e0": [0.0, 0.02, 0.04, 0.30, 0.32], "e1": [0.0, 0.05, 0.10]}
    assert probe_gap(ticks) == pytest.approx(0.26)  # e0's 0.04 -> 0.30
    assert probe_gap(ticks, (0.05, 0.08)) == pytest.approx(0.26)  # the gap over the window counts
    assert probe_gap(ticks, (0.29, 0.5)) == pytest.approx(0.26)  # ... and one that ends inside it
    assert probe_gap(ticks, (0.31, 0.5)) == pytest.approx(0.02)  # not one that ended before it
    assert probe_gap(ticks, (0.0, 0.01)) == pytest.approx(0.05)  # e1's first step
    assert math.isnan(probe_gap({"e0": [1.0]}))  # one token: no gap measured, never 0


def test_the_decode_probe_counts_the_tokens_inside_windows_once():
    from bench.decode_probe import probe_tokens

    ticks = {"e0": [0.0, 0.02, 0.04, 0.30, 0.32], "e1": [0.0, 0.05, 0.10]}
    assert probe_tokens(ticks, [(0.01, 0.05)]) == 3  # e0's 0.02 and 0.04, e1's 0.05
    assert probe_tokens(ticks, [(0.01, 0.05), (0.03, 0.31)]) == 5  # 0.04 and 0.05 in both: once each
    assert probe_tokens(ticks, [(0.0, 0.0)]) == 0  # a token at a window's start is before it
    assert probe_tokens(ticks, []) == 0


def test_the_quick_benchmark_measures_the_probe_in_every_run(tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--skip-control-plane", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (round_,) = json.loads(out.read_text())["online"]["rounds"]
    for strategy in bench.STRATEGIES:
        probe = round_[strategy]["probe"]
        assert probe["failed"] == 0 and probe["sent"] == probe["ended"] + probe["cut"] >= 2
        assert all(len(ts) > 10 for ts in probe["ticks"].values())  # a token at every decode step of each engine
    derived = round_["derived"]
    assert not math.isnan(derived["lorapub_excess_decode_stall"])
    assert not math.isnan(derived["control_decode_stall_lorapub_windows"])
    assert 0 <= derived["baseline_probe_token_loss"] <= 1  # stock loads stop decoding: tokens are lost
    assert derived["lorapub_probe_token_loss"] <= 1


def test_the_attribution_names_what_the_scheduler_did_in_each_slow_probe_step(tmp_path):
    """A slow probe step inside a publication's window is joined, on the shared monotonic clock, to the
    logged iterations overlapping it; steps at the engine's usual pace and iterations outside are not."""
    from bench.attribution import attribute, read_iterations, summarize

    ticks = {"e0": [10.0 + 0.02 * i for i in range(50)], "e1": [10.0 + 0.02 * i for i in range(50)]}
    ticks["e0"] = [t if t < 10.5 else t + 0.06 for t in ticks["e0"]]  # one 80 ms step on e0 at 10.48-10.56
    log = tmp_path / "server-e0.log"
    log.write_text("\n".join([
        "[2026-12-07] INFO something else",
        '[2026-12-07] lorapub iteration {"t":10.46,"wall":20.0,"cpu":19.0,"prep_cpu":1.0,"decode":5.0}',
        '[2026-12-07] lorapub iteration {"t":10.48,"wall":80.0,"cpu":20.0,"prep_cpu":55.0,"decode":6.0,"fill":12.5}',
        '[2026-12-07] lorapub iteration {"t":12.0,"wall":30.0,"cpu":30.0,"prep_cpu":0.0,"install":2.0}',
        "[2026-12-07] lorapub iteration {not json",
    ]))
    records = {"e0": read_iterations(str(log), 9.0, 11.5), "e1": []}
    assert [r["t"] for r in records["e0"]] == [10.46, 10.48]  # the one at 12.0 is outside the run
    [window] = attribute(ticks, records, [(10.3, 10.7)])
    e0 = window["e0"]
    assert e0["slow_steps"] == 1 and e0["longest_ms"] == pytest.approx(80.0, abs=0.5)
    assert e0["excess_ms"] == pytest.approx(60.0, abs=0.5)
    # the 80 ms iteration, and the one before it that ended inside the step, are the two overlapping it
    assert e0["iterations"] == 2
    assert e0["fill"] == pytest.approx(12.5) and e0["prep_cpu"] == pytest.approx(56.0)
    assert e0["wait"] == pytest.approx(61.0)  # 80 - 20 and 20 - 19: the scheduler waited
    assert window["e1"]["slow_steps"] == 0
    lines = summarize("round 1 lorapub", [window])
    assert "e0: 1 slow probe step(s), +60.0 ms" in lines[0] and "slot fills 12.5" in lines[0]
    assert "preparing thread's CPU 56.0" in lines[0] and "no slow probe step" in lines[1]
    [outside] = attribute(ticks, records, [(11.0, 11.2)])  # no slow step in another window
    assert outside["e0"]["slow_steps"] == 0
