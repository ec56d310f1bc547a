#!/usr/bin/env python3
"""Capacity, max_lag and on_stale against stall, lag and cut work: one workload, several settings.

    python3 bench/freshness_sweep.py [--out DIR] [--plot PATH] [--quick]

Runs ``bench/run.py`` once per setting (each run: the control, the baseline and lorapub on fresh
engine processes, side by side), on the same seeded workload of long trajectories in GRPO groups
while a trainer publishes at a fixed cadence, and prints one row per setting: lorapub's excess stall
over the control (and the baseline's, same run), the token-weighted version lag, the sessions ended
by BINDING_STALE (the trajectories cut: aborted work), the rebinds, and what became of every publish
call. With ``--plot`` it draws lag p99 against cut sessions, a point per setting, labelled with its
excess stall. The engines are the SGLang contract doubles with lorapub's patched load (``--engine-model
patched``); live figures for two settings are in docs/freshness.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOAD = ["--sessions", "64", "--arrival", "0.04", "--turns", "6", "10", "--group-size", "4",
            "--tool-latency", "0.05", "--max-new-tokens", "8", "--publications", "8", "--cadence", "0.2",
            "--load-delay", "0.1", "--engine-model", "patched", "--seed", "5"]
QUICK = ["--sessions", "16", "--turns", "3", "5", "--publications", "4", "--cadence", "0.1"]
#: (label, lorapub's settings)
SETTINGS = [
    ("capacity 2, no max_lag (the RFC)", ["--capacity", "2"]),
    ("capacity 4, no max_lag", ["--capacity", "4"]),
    ("capacity 4, max_lag 2, error", ["--capacity", "4", "--max-lag", "2"]),
    ("capacity 4, max_lag 2, rebind", ["--capacity", "4", "--max-lag", "2", "--on-stale", "rebind"]),
    ("capacity 4, max_lag 1, error", ["--capacity", "4", "--max-lag", "1"]),
    ("capacity 6, max_lag 4, error", ["--capacity", "6", "--max-lag", "4"]),
]


def run(label: str, settings: list[str], out: str, quick: bool, rounds: int) -> list[dict]:
    path = os.path.join(out, "".join(c if c.isalnum() else "_" for c in label).strip("_") + ".json")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "run.py"), "--rounds", str(rounds), "--skip-control-plane",
           *WORKLOAD, *(QUICK if quick else []), *settings, "--wait", "30", "--json", path]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    if rc not in (0, 1) or not os.path.exists(path):  # 1: a bar failed, which the table shows
        raise SystemExit(f"bench/run.py failed ({rc}) for {label}")
    with open(path) as f:
        return json.load(f)["online"]["rounds"]


def row(label: str, rounds: list[dict]) -> dict:
    """The median over the rounds of each figure (each round is control, baseline, lorapub side by side)."""
    rows = [one_round(label, r) for r in rounds]
    return {k: (statistics.median(r[k] for r in rows) if isinstance(v, (int, float)) else v) for k, v in rows[0].items()}


def one_round(label: str, rnd: dict) -> dict:
    lp, base = rnd["lorapub"], rnd["baseline"]
    return {
        "setting": label,
        "excess_gap_ms": (lp["gap"] - rnd["control"]["gap"]) * 1e3,
        "baseline_excess_gap_ms": (base["gap"] - rnd["control"]["gap"]) * 1e3,
        "lag_p50": lp["lag_p50"], "lag_p99": lp["lag_p99"], "lag_max": lp["lag_max"],
        "stale_cut": lp["stale_cut"], "rebound": lp["rebound"], "mixed": lp["mixed"], "mixed_groups": lp["mixed_groups"],
        "calls": lp["calls"], "done": lp["published"], "superseded": lp["superseded"], "deferred": lp["deferred"],
        "failed_calls": lp["failed_calls"], "waited_ms": lp["waited"] * 1e3,
        "requests": lp["requests"], "baseline_resent": base["resent"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="keep every run's JSON here (default: a temporary folder)")
    parser.add_argument("--plot", help="draw the trade-off to this PNG (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per setting; a figure is their median")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="lorapub-sweep-")
    os.makedirs(out, exist_ok=True)
    rows = [row(label, run(label, settings, out, args.quick, args.rounds)) for label, settings in SETTINGS]
    print(f"\nmethod: bench/run.py, {args.rounds} round(s) per setting (each: control, baseline, lorapub on fresh engine "
          "processes, side by side); a figure is the median over the rounds,"
          f"\n  {' '.join(WORKLOAD + (QUICK if args.quick else []))}; every publish call waits up to 30 s.")
    head = (f"{'setting':34}{'excess stall':>13}{'baseline':>10}{'lag p50':>8}{'p99':>5}{'max':>5}"
            f"{'cut':>5}{'rebound':>8}{'calls':>6}{'done':>5}{'supers.':>8}{'deferred':>9}{'failed':>7}{'waited':>9}")
    print(head)
    for r in rows:
        print(f"{r['setting']:34}{r['excess_gap_ms']:10.0f} ms{r['baseline_excess_gap_ms']:7.0f} ms"
              f"{r['lag_p50']:8.0f}{r['lag_p99']:5.0f}{r['lag_max']:5.0f}{r['stale_cut']:5.0f}{r['rebound']:8.0f}{r['calls']:6.0f}"
              f"{r['done']:5.0f}{r['superseded']:8.0f}{r['deferred']:9.0f}{r['failed_calls']:7.0f}{r['waited_ms']:6.0f} ms")
    print("cut: sessions ended by BINDING_STALE (their trajectory stops: aborted work); rebound: sessions moved to a "
          "newer version on purpose (served by two, recorded); the baseline aborts and resends requests instead ("
          + ", ".join(str(r["baseline_resent"]) for r in rows) + " per run). Mixed-version sessions beyond rebinds: "
          + ", ".join(str(r["mixed"]) for r in rows) + "; groups spanning two versions: "
          + ", ".join(str(r["mixed_groups"]) for r in rows) + ".")
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.6))
        for r in rows:
            ax.scatter(r["stale_cut"], r["lag_p99"], s=60)
            ax.annotate(f"{r['setting']}\nexcess stall {r['excess_gap_ms']:.0f} ms, {r['superseded']} of {r['calls']} "
                        f"calls superseded", 
                        (r["stale_cut"], r["lag_p99"]), textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax.set_xlabel("sessions ended by BINDING_STALE (cut trajectories)")
        ax.set_ylabel("version lag p99 (token-weighted, commits)")
        ax.set_title("Freshness against cut work (contract doubles, patched load; one seeded workload)", fontsize=10)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    print(f"runs: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
