"""Pool the decode-gap runs kept in bench/results/2026-12-03-load-gap (runN-SERVER.json) that have a control as long as
the publication (control + control_b windows; runs 7 on): per server and adapter, each repetition's
longest gap over its load and first-use windows minus the longest over its two control windows, from
every run, with their median. Usage: python pool.py [FOLDER]   (default: bench/results/2026-12-03-load-gap)"""
import json, math, os, re, statistics, sys

folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "results", "2026-12-03-load-gap")
pooled: dict = {}
for name in sorted(os.listdir(folder)):
    m = re.fullmatch(r"run(\d+)-(.+)\.json", name)
    if not m or m.group(2) == "numerics":
        continue
    windows = json.load(open(os.path.join(folder, name)))["windows"]
    # a window with fewer than two tokens had no token for all its length: that length, not None
    by = {(w["variant"], w["kind"], w["rep"]): w["merged_max_gap_ms"] if w.get("merged_max_gap_ms") is not None
          else round((w["t1"] - w["t0"]) * 1e3, 1) for w in windows}
    if not any(k[1] == "control_b" for k in by):
        continue  # earlier runs: one control window, half as long as a publication's
    for (variant, kind, rep), gap in by.items():
        if kind != "load" or (variant, "first_use", rep) not in by or (variant, "control_b", rep) not in by:
            continue
        pub = max(gap, by[(variant, "first_use", rep)])
        ctl = max(by[(variant, "control", rep)], by[(variant, "control_b", rep)])
        pooled.setdefault((m.group(2), variant), []).append((int(m.group(1)), round(pub - ctl, 1)))


def median_interval(values, level=0.95):
    """A distribution-free interval for the median: the order statistics x(k) and x(n+1-k) with the
    largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is still at least ``level``; with its
    coverage. None when n is too small for any such k."""
    x, n = sorted(values), len(values)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if coverage < level:
            break
        best = (x[k - 1], x[n - k], coverage)
    return best


def interval_text(values):
    ci = median_interval(values)
    return f"[{ci[0]:+.1f}, {ci[1]:+.1f}] ({100 * ci[2]:.1f} %)" if ci else "too few"


def table(selected):
    print("| server | adapter | runs | repetitions | publication - control, each (ms) | median | 95 % interval of the median |")
    print("|---|---|---|---|---|---|---|")
    for (server, variant), rows in sorted(selected.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        values = [v for _, v in rows]
        runs = sorted({r for r, _ in rows})
        print(f"| {server} | {variant} | {', '.join(map(str, runs))} | {len(values)} | {sorted(values)} | "
              f"{statistics.median(values):+.1f} | {interval_text(values)} |")


print("All kept runs with a control as long as the publication:")
table(pooled)
# the runs that measured stock, the ungated and the gated patch side by side: a like-for-like comparison
servers_of: dict = {}
for (server, _), rows in pooled.items():
    for run, _ in rows:
        servers_of.setdefault(run, set()).add(server)
matched = sorted(r for r, s in servers_of.items() if {"unpatched", "patched-ungated", "patched"} <= s)
if matched:
    print()
    print(f"Runs {', '.join(map(str, matched))} only (stock, the patch without and with its prefill gate, side by side):")
    table({k: [(r, v) for r, v in rows if r in matched] for k, rows in pooled.items()
           if k[0] in ("unpatched", "patched-ungated", "patched") and any(r in matched for r, _ in rows)})

# The scheduler's own view (LORAPUB_SGLANG_PREPARE_TRACE): per load on a busy server, its longest loop
# iteration while the adapter was prepared minus the longest in as long a stretch just before.
trace = re.compile(r"iterations while preparing \S+ \((\d+) ms\): n=\d+ max ([\d.]+) ms .*?; "
                   r"before: n=\d+ max ([\d.]+) ms p90 [\d.]+ ms p50 ([\d.]+) ms")
scheduler: dict = {}
for name in sorted(os.listdir(folder)):
    m = re.fullmatch(r"run(\d+)-(.+)-trace\.txt", name)
    if not m or int(m.group(1)) < 7:
        continue
    for line in open(os.path.join(folder, name)):
        t = trace.search(line)
        if t and float(t.group(4)) > 1.0:  # decoding before it (the numerics check loads on an idle server)
            scheduler.setdefault(m.group(2), []).append(round(float(t.group(2)) - float(t.group(3)), 1))
print()
print("| server | loads (B and B32) | longest scheduler iteration while preparing - before, each (ms) | median | "
      "95 % interval of the median |")
print("|---|---|---|---|---|")
for server, values in sorted(scheduler.items()):
    print(f"| {server} | {len(values)} | {sorted(values)} | {statistics.median(values):+.1f} | {interval_text(values)} |")
