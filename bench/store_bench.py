#!/usr/bin/env python3
"""Durable registry decisions: SQLiteStore (command log) vs FileStore (whole state) vs memory.

    python3 bench/store_bench.py                          # 1k, 10k, 100k live sessions, 3 repeats
    python3 bench/store_bench.py --sizes 1000,10000 --repeats 5 --decisions 2000

Each decision is one ``LocalRegistry.apply`` of a session command (``BindFirst`` of a new
session, then ``CloseAndRelease`` of it, alternating), timed alone, on a registry that
already holds N live (bound) sessions; the registry stores it before ``apply`` returns.
Stores, side by side on the same states in the same run:

* memory     -- ``MemoryStore``: no durability; the floor (the pure decision).
* sqlite     -- ``SQLiteStore`` defaults (snapshot every 10,000 commands).
* sqlite+c   -- ``SQLiteStore(snapshot_every=1)``: a snapshot is being written (or its log
                and parts collected) during every measured decision: compaction's worst case.
* sqlite+m   -- ``SQLiteStore(mark_sync_every=0)``: the high-water mark (written after every
                commit; fsynced once a second by default) fsynced after every commit too.
* file       -- ``FileStore`` (the control: pickle + fsync + rename of the whole state). It
                gets as many decisions as fit in ``--control-seconds`` (at least 3), so its
                p99 at large N is the max of few samples.

Setup, not timed as decisions: the states are built in memory by the pure core (one
publication, then N ``BindFirst``), once, and shared (they are immutable). Each store's
file is written once per state (a whole-state checkpoint) and copied fresh for each repeat;
opening it (load + replay) is timed and reported as "resume". A second part measures the
effect of sessions ever opened: 1,000 live sessions on a state where 99,000 more were opened
and closed (tombstones kept), against 1,000 live sessions on a fresh state.

Every figure is the median over ``--repeats`` repeats. decisions/s is the number of
decisions over the sum of their latencies (one caller, one decision at a time).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from lorapub.core import registry as R  # noqa: E402
from lorapub.core.attempt import ReadyLocal  # noqa: E402
from lorapub.core.effects import SOURCE  # noqa: E402
from lorapub.core.identity import SessionKey, VersionKey  # noqa: E402
from lorapub.local_registry import LocalRegistry, MemoryStore  # noqa: E402
from lorapub.adapters.stores import FileStore, SQLiteStore  # noqa: E402
from lorapub.core.manifest import BucketPlan, Manifest, TensorEntry  # noqa: E402

EPOCH = 1
ENGINES = {"e0": "i0", "e1": "i1"}


def published() -> R.RegistryState:
    """One committed version (made-up tensor hashes: the registry never sees bytes)."""
    state = R.new_registry(EPOCH, ENGINES)
    manifest = Manifest.build(
        [TensorEntry(f"layers.{i}.lora_A.weight", "float32", (16,), 64, hashlib.sha256(b"A%d" % i).hexdigest())
         for i in range(3)],
        {"r": 4, "lora_alpha": 8},
    )
    digest, plan = manifest.digest, BucketPlan.for_manifest(manifest, 128)
    key = VersionKey(EPOCH, "A")
    out = R.handle(state, R.Reserve(key, digest, plan))
    state, token = out.state, out.reply.token
    for e, inc in ENGINES.items():
        state = R.handle(state, R.RecordPrepared(token, e, inc)).state
    for i in range(len(plan)):
        for p in (SOURCE, *ENGINES):
            state = R.handle(state, R.RecordBucketDone(token, p, i, ENGINES.get(p))).state
    for e, inc in ENGINES.items():
        state = R.handle(state, R.RecordReady(ReadyLocal(e, token, digest, inc))).state
    return R.handle(state, R.Commit(key, token, 0)).state


def sk(name: str) -> SessionKey:
    return SessionKey(EPOCH, name, "n")


def build_states(sizes: list[int]) -> dict[int, R.RegistryState]:
    """N live sessions for every N, each state extending the last (shared structure).

    The collector is paused meanwhile: the pure core makes no cycles, and with it on each
    young-generation pass would walk the whole young map (setup time only)."""
    states, state, have = {}, published(), 0
    gc.disable()
    try:
        for n in sorted(sizes):
            for i in range(have, n):
                state = R.handle(state, R.BindFirst(sk(f"live{i}"))).state
            states[n], have = state, n
    finally:
        gc.enable()
    return states


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


STORES = ("memory", "sqlite", "sqlite+c", "sqlite+m", "file")


class Templates:
    """One store file per (store kind, state), copied fresh for every repeat."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.made: dict[tuple[str, str], str] = {}
        self.checkpoint_s: dict[tuple[str, str], float] = {}

    def path(self, kind: str, label: str, state: R.RegistryState) -> str:
        base = "sqlite" if kind.startswith("sqlite") else kind
        key = (base, label)
        if key not in self.made:
            path = os.path.join(self.root, f"tpl-{base}-{label}")
            store = SQLiteStore(path) if base == "sqlite" else FileStore(path)
            t0 = time.perf_counter()
            store.save(state)  # the whole state, once
            self.checkpoint_s[key] = time.perf_counter() - t0
            store.close()
            self.made[key] = path
        return self.made[key]


def one_run(kind: str, label: str, state: R.RegistryState, templates: Templates, work: str, args, rep: int) -> dict:
    if kind == "memory":
        store = MemoryStore()
        store.save(state)
        t0 = time.perf_counter()
        registry = LocalRegistry(EPOCH, ENGINES, store=store)
    else:
        path = os.path.join(work, f"{kind}-{label}-{rep}")
        shutil.copyfile(templates.path(kind, label, state), path)
        store = {
            "sqlite": lambda: SQLiteStore(path),
            "sqlite+c": lambda: SQLiteStore(path, snapshot_every=1),
            "sqlite+m": lambda: SQLiteStore(path, mark_sync_every=0),
            "file": lambda: FileStore(path),
        }[kind]()
        t0 = time.perf_counter()
        registry = LocalRegistry(EPOCH, ENGINES, store=store)
    resume = time.perf_counter() - t0
    assert registry.state == state
    gc.collect()  # the window starts as in a long-running registry, not owing the setup's full collection
    lat: list[float] = []
    started = time.perf_counter()
    for i in range(args.decisions):
        key = sk(f"r{rep}-{i // 2}")
        command = R.BindFirst(key) if i % 2 == 0 else R.CloseAndRelease(key)
        t = time.perf_counter()
        registry.apply(command)
        lat.append(time.perf_counter() - t)
        if kind == "file" and i >= 2 and time.perf_counter() - started > args.control_seconds:
            break
    stats = store.stats() if isinstance(store, SQLiteStore) else {}
    registry.close()
    if kind != "memory":
        for suffix in ("", "-wal", "-mark"):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)
    return {
        "n": len(lat), "p50": percentile(lat, 0.50), "p99": percentile(lat, 0.99), "max": max(lat),
        "rate": len(lat) / sum(lat), "resume": resume, "snapshots": stats.get("snapshot", 0),
    }


def disk_floor(work: str, tries: int = 200) -> tuple[float, float]:
    """p50 and p99 of one small append + fdatasync in the store folder: what any durable decision waits for."""
    path = os.path.join(work, "fsync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    lat = []
    try:
        for _ in range(tries):
            t = time.perf_counter()
            os.write(fd, b"x" * 200)
            os.fdatasync(fd)
            lat.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
    return percentile(lat, 0.5), percentile(lat, 0.99)


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def ms(x: float) -> str:
    return f"{x * 1e3:9.2f} ms" if x < 10 else f"{x:9.2f} s "


def table(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"{'store':<10}{'decisions':>10}{'p50':>13}{'p99':>13}{'max':>13}{'decisions/s':>13}{'resume':>13}")
    for kind, r in rows.items():
        print(f"{kind:<10}{int(r['n']):>10}{ms(r['p50']):>13}{ms(r['p99']):>13}{ms(r['max']):>13}"
              f"{r['rate']:>13,.0f}{ms(r['resume']):>13}")
    if "file" in rows and "sqlite" in rows:
        f, s = rows["file"], rows["sqlite"]
        print(f"{'':<10}sqlite/file: p50 {s['p50'] / f['p50']:.4f}, p99 {s['p99'] / f['p99']:.4f}, "
              f"decisions/s x{s['rate'] / f['rate']:,.0f}")


def measure(label: str, state, kinds, templates, work, args) -> dict[str, dict]:
    rows = {}
    for kind in kinds:
        runs = [one_run(kind, label, state, templates, work, args, rep) for rep in range(args.repeats)]
        rows[kind] = median_of(runs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000", help="live sessions, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decisions", type=int, default=1000, help="timed decisions per run")
    parser.add_argument("--control-seconds", type=float, default=2.0, help="time budget of one FileStore run")
    parser.add_argument("--ever-opened", type=int, default=100_000,
                        help="sessions ever opened in part 2 (0 skips it)")
    parser.add_argument("--dir", default=None, help="where the store files go (default: a temporary folder)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    work = tempfile.mkdtemp(prefix="lorapub-store-bench-", dir=args.dir)
    templates = Templates(work)
    t_start = time.perf_counter()
    try:
        t0 = time.perf_counter()
        states = build_states(sizes + ([1000] if args.ever_opened else []))
        print(f"states built by the pure core in {time.perf_counter() - t0:.1f} s; store files under {work}")
        p50, p99 = disk_floor(work)
        print(f"disk floor: append + fdatasync p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{args.repeats} repeats, median shown; {args.decisions} decisions per run "
              f"(file: as many as fit in {args.control_seconds:g} s, at least 3)")
        results = {}
        for n in sizes:
            results[n] = measure(str(n), states[n], STORES, templates, work, args)
            table(f"== {n:,} live sessions", results[n])
            whole = len(pickle.dumps(states[n], protocol=pickle.HIGHEST_PROTOCOL))
            print(f"{'':<10}one whole-state checkpoint (one sample): "
                  f"{templates.checkpoint_s[('sqlite', str(n))] * 1e3:.0f} ms "
                  f"({whole / 1e6:.1f} MB pickled): what compaction would stall one decision for if done inline")

        if args.ever_opened:
            big = states[1000]
            gc.disable()
            for i in range(1000, args.ever_opened):
                big = R.handle(big, R.BindFirst(sk(f"live{i}"))).state
                big = R.handle(big, R.CloseAndRelease(sk(f"live{i}"))).state
            gc.enable()
            fresh = results.get(1000) or measure("1000", states[1000], STORES[:3], templates, work, args)
            ever = measure(f"ever{args.ever_opened}", big, STORES[:3], templates, work, args)
            table("== sessions ever opened: 1,000 live, fresh state", {k: fresh[k] for k in STORES[:3]})
            table(f"== sessions ever opened: 1,000 live + {args.ever_opened - 1000:,} opened and closed "
                  f"(tombstones kept)", ever)
            results["ever"] = ever

        top = max(sizes)
        s = results[top]["sqlite"]
        c = results[top]["sqlite+c"]
        ok = s["p99"] <= 5e-3 and s["rate"] >= 500
        print(f"\nbar at {top:,} sessions: durable p99 <= 5 ms and >= 500 decisions/s -- "
              f"sqlite p99 {s['p99'] * 1e3:.2f} ms, {s['rate']:,.0f}/s: {'pass' if ok else 'FAIL'}; "
              f"while compacting p99 {c['p99'] * 1e3:.2f} ms, {c['rate']:,.0f}/s")
        print(f"total {time.perf_counter() - t_start:.0f} s; disk floor now: "
              + ", ".join(f"{x * 1e3:.2f} ms" for x in disk_floor(work)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
