#!/usr/bin/env python3
"""Registry memory and garbage-collection pauses with many live sessions.

    python3 bench/memory_bench.py               # 100k live sessions, 3 repeats (about 1-2 minutes)
    python3 bench/memory_bench.py --quick       # smoke run: 2k sessions, 1 repeat, few decisions

It answers: with N live (bound) sessions in the registry's state, how long does a full
(generation-2) garbage collection stop the process, how many objects does the collector
track, how many bytes does one live session (and one tombstone) cost, and how long is one
``ExpireLeases`` pass that finds nothing to expire?

Scenarios, side by side in one run:

* empty      -- a registry with one published version and no session: the process's own
                floor (interpreter, lorapub, its dependencies), running the same commands.
* pmap ctl   -- the empty registry plus the same N sessions held the way the registry held
                them before (a pyrsistent ``PMap`` of ``SessionKey -> SessionRecord`` attrs
                instances): the control. Only forced collections (it runs no commands).
* memory     -- ``LocalRegistry`` on ``MemoryStore`` holding N live sessions.
* sqlite     -- ``LocalRegistry`` resumed from a ``SQLiteStore`` holding the same state
                (load + replay), then running commands durably (snapshots every 10,000
                commands, so the run also writes one, sliced, while an older state is held).

For every scenario, ``gc.collect(2)`` is timed ``--repeats`` times (min / median), each after
64 MiB were written (the CPU caches hold other work, as before an automatic collection), with
the number of objects the collector tracks. Except for the control, ``--decisions`` commands then
run through ``LocalRegistry.apply`` (``BindFirst`` of a new session and ``CloseAndRelease``
of it, alternating; every 100 decisions one ``RenewLeases`` of 1,000 live sessions; every
1,000 an ``ExpireLeases``) on a clock that advances 1 ms a decision, with the collector on
and every collection CPython starts timed through ``gc.callbacks``: their count and the
median and max pause per generation are printed. Bytes per live session and per tombstone
are ``tracemalloc``'s traced memory with the state held minus without it, over N.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from pyrsistent import pmap  # noqa: E402

from lorapub.core import registry as R  # noqa: E402
from lorapub.core.identity import SessionKey, new_nonce  # noqa: E402
from lorapub.core.session import SessionRecord, SessionState  # noqa: E402
from lorapub.local_registry import LocalRegistry, MemoryStore  # noqa: E402
from lorapub.adapters.stores import SQLiteStore  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
from store_bench import ENGINES, EPOCH, published  # noqa: E402

T0 = 1_800_000_000.0  # the benchmark's clock starts here (wall-clock seconds)


def key(name: str, born: float = T0) -> SessionKey:
    return SessionKey(EPOCH, name, new_nonce(born, f"{zlib.crc32(name.encode()):08x}"))


def with_live(state: R.RegistryState, n: int, prefix: str = "live") -> R.RegistryState:
    """``n`` more bound sessions (leases from T0), built by the pure core, collector paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(n):
            state = R.handle(state, R.BindFirst(key(f"{prefix}{i}"), now=T0)).state
    finally:
        if enabled:
            gc.enable()
    return state


def with_tombstones(state: R.RegistryState, n: int) -> R.RegistryState:
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(n):
            k = key(f"dead{i}")
            state = R.handle(state, R.BindFirst(k, now=T0)).state
            state = R.handle(state, R.CloseAndRelease(k, now=T0)).state
    finally:
        if enabled:
            gc.enable()
    return state


def previous_representation(n: int, prefix: str = "live"):
    """The records ``with_live(published(), n)`` makes, held as the registry held them
    before: a pyrsistent PMap of ``SessionKey -> SessionRecord`` attrs instances (built
    one ``set`` at a time, as the transitions did)."""
    version = published().default
    sessions = pmap()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(n):
            k = key(f"{prefix}{i}")
            sessions = sessions.set(k, SessionRecord(k, SessionState.BOUND, version, True, T0 + R.DEFAULT_LEASE_TTL))
    finally:
        if enabled:
            gc.enable()
    return sessions


_FLUSH = bytearray(64 << 20)


def _evict_caches() -> None:
    """Touch 64 MiB so a forced collection starts as an automatic one does: with the CPU
    caches full of other work, not of the previous collection's objects."""
    _FLUSH[::64] = bytes(len(_FLUSH) // 64)


def forced(repeats: int) -> dict:
    pauses, cpu = [], []
    for _ in range(repeats):
        _evict_caches()
        t, c = time.perf_counter(), time.thread_time()
        gc.collect(2)
        pauses.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    return {"min": min(pauses), "median": statistics.median(pauses), "fcpu": statistics.median(cpu),
            "tracked": len(gc.get_objects())}


class Pauses:
    """Every collection CPython starts, timed (gc.callbacks), per generation: wall time, and
    the CPU time of this thread (the wall time less what other processes took of the CPU)."""

    def __init__(self) -> None:
        self.by_gen: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.cpu: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t = self._c = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t, self._c = time.perf_counter(), time.thread_time()
        else:
            self.by_gen[info["generation"]].append(time.perf_counter() - self._t)
            self.cpu[info["generation"]].append(time.thread_time() - self._c)

    def __enter__(self) -> "Pauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_commands(registry: LocalRegistry, clock: list[float], live: int, decisions: int, tag: str) -> dict:
    """Decisions with the collector on; every collection timed. Returns pauses and timings."""
    expire = []
    gc.collect()
    with Pauses() as pauses:
        started = time.perf_counter()
        for i in range(decisions):
            clock[0] += 0.001
            k = key(f"{tag}{i // 2}", born=clock[0])
            registry.apply(R.BindFirst(k) if i % 2 == 0 else R.CloseAndRelease(k))
            if i % 100 == 99 and live:
                j = (i // 100) * 1000 % max(1, live)  # the keys are made here: the benchmark holds none
                registry.apply(R.RenewLeases(tuple(key(f"live{x}") for x in range(j, min(j + 1000, live)))))
            if i % 1000 == 999:
                t = time.perf_counter()
                registry.apply(R.ExpireLeases())
                expire.append(time.perf_counter() - t)
        wall = time.perf_counter() - started
    return {"pauses": pauses.by_gen, "auto_cpu": pauses.cpu, "expire": expire, "wall": wall}


def bytes_per(build, n: int) -> float:
    """tracemalloc's traced bytes held by ``build()``'s result over ``n``."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del held
    return (after - before) / n


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=100_000, help="live sessions")
    parser.add_argument("--repeats", type=int, default=3, help="forced gen-2 collections per scenario")
    parser.add_argument("--decisions", type=int, default=10_000, help="commands per command run")
    parser.add_argument("--tombstones", type=int, default=None, help="tombstones for bytes/tombstone (default: --sessions)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,000 sessions, 1 repeat, 2,000 decisions")
    parser.add_argument("--dir", default=None, help="where the SQLite store goes (default: a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.repeats, args.decisions = 2_000, 1, 2_000
    n = args.sessions
    tombs = args.tombstones if args.tombstones is not None else n
    t_start = time.perf_counter()
    print(f"python {sys.version.split()[0]}, gc thresholds {gc.get_threshold()}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {n:,} live sessions; {args.repeats} repeats "
          f"(min / median); {args.decisions:,} decisions per command run")

    base = published()
    rows: dict[str, dict] = {}

    # empty registry: the process's floor, forced and while it runs the same commands
    clock = [T0]
    store = MemoryStore()
    store.save(base)
    registry = LocalRegistry(EPOCH, ENGINES, store=store, clock=lambda: clock[0])
    gc.collect()
    rows["empty"] = forced(args.repeats)
    rows["empty"].update(run_commands(registry, clock, 0, args.decisions, "e"))
    registry.close()
    del registry, store

    # the control: the same sessions held as the registry held them before
    prev = previous_representation(n)
    gc.collect()
    rows["pmap ctl"] = forced(args.repeats)
    del prev
    gc.collect()

    # bytes per live session and per tombstone (tracemalloc; setup, not timed)
    per_prev = bytes_per(lambda: previous_representation(n), n)
    per_live = bytes_per(lambda: with_live(base, n), n)
    per_tomb = bytes_per(lambda: with_tombstones(base, tombs), tombs)
    state = with_live(base, n)
    gc.collect()

    # memory: LocalRegistry on MemoryStore with the n sessions
    live = n
    store = MemoryStore()
    store.save(state)
    registry = LocalRegistry(EPOCH, ENGINES, store=store, clock=lambda: clock[0])
    del state
    gc.collect()
    rows["memory"] = forced(args.repeats)
    rows["memory"].update(run_commands(registry, clock, live, args.decisions, "m"))
    checkpoint_of = registry.state
    registry.close()
    del registry, store

    # sqlite: the same state resumed from a SQLiteStore, then durable commands
    work = tempfile.mkdtemp(prefix="lorapub-memory-bench-", dir=args.dir)
    try:
        path = os.path.join(work, "registry.db")
        writer = SQLiteStore(path)
        writer.save(checkpoint_of)
        writer.close()
        del checkpoint_of
        gc.collect()
        t = time.perf_counter()
        registry = LocalRegistry(EPOCH, ENGINES, store=SQLiteStore(path), clock=lambda: clock[0])
        resume = time.perf_counter() - t
        gc.collect()
        rows["sqlite"] = forced(args.repeats)
        rows["sqlite"].update(run_commands(registry, clock, live, args.decisions, "s"))
        rows["sqlite"]["resume"] = resume
        registry.close()
        del registry
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nbytes (tracemalloc): {per_live:,.0f} per live session, {per_tomb:,.0f} per tombstone; "
          f"previous representation (PMap of attrs records, control): {per_prev:,.0f} per live session")
    print("\nfull (generation-2) collections, ms: forced = gc.collect(2), min / median (cpu: median of this "
          "thread's CPU time);\nautomatic = every one CPython started during the command run: count, median, "
          "max (cpu: max)")
    print(f"{'scenario':<10}{'tracked':>9}{'forced':>17}{'cpu':>7}{'auto n':>8}{'median':>8}{'max':>8}{'cpu':>7}"
          f"{'young max':>11}{'expire pass':>13}")
    for name, r in rows.items():
        line = f"{name:<10}{r['tracked']:>9,}{ms(r['min']) + ' / ' + ms(r['median']):>17}{ms(r['fcpu']):>7}"
        if "pauses" in r:
            g2, c2 = r["pauses"][2], r["auto_cpu"][2]
            young = r["pauses"][0] + r["pauses"][1]
            line += (f"{len(g2):>8}{(ms(statistics.median(g2)) if g2 else '-'):>8}{(ms(max(g2)) if g2 else '-'):>8}"
                     f"{(ms(max(c2)) if c2 else '-'):>7}{(ms(max(young)) if young else '-'):>11}"
                     f"{(ms(statistics.median(r['expire'])) if r['expire'] else '-'):>13}")
        print(line)
    for name in ("empty", "memory", "sqlite"):
        r = rows[name]
        extra = f", resume {r['resume']:.2f} s" if "resume" in r else ""
        print(f"{name}: {args.decisions:,} decisions in {r['wall']:.1f} s{extra}")
    worst = max(max(rows[s]["median"] for s in ("memory", "sqlite")),
                max((max(rows[s]["pauses"][2]) for s in ("memory", "sqlite") if rows[s]["pauses"][2]), default=0.0))
    worst_cpu = max(max(rows[s]["fcpu"] for s in ("memory", "sqlite")),
                    max((max(rows[s]["auto_cpu"][2]) for s in ("memory", "sqlite") if rows[s]["auto_cpu"][2]),
                        default=0.0))
    print(f"\nbar at {n:,} live sessions: gen-2 pause <= 20 ms (forced median and every automatic one) -- "
          f"worst {worst * 1e3:.2f} ms wall ({'pass' if worst <= 0.020 else 'FAIL'}), "
          f"{worst_cpu * 1e3:.2f} ms CPU ({'pass' if worst_cpu <= 0.020 else 'FAIL'})")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
