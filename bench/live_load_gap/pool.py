"""Pool the decode-gap runs kept in docs/gpu/load-gap (runN-SERVER.json) that have a control as long as
the publication (control + control_b windows; runs 7 on): per server and adapter, each repetition's
longest gap over its load and first-use windows minus the longest over its two control windows, from
every run, with their median. Usage: python pool.py [FOLDER]   (default: docs/gpu/load-gap)"""
import json, os, re, statistics, sys

folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "docs", "gpu", "load-gap")
pooled: dict = {}
for name in sorted(os.listdir(folder)):
    m = re.fullmatch(r"run(\d+)-(.+)\.json", name)
    if not m or m.group(2) == "numerics":
        continue
    windows = json.load(open(os.path.join(folder, name)))["windows"]
    by = {(w["variant"], w["kind"], w["rep"]): w["merged_max_gap_ms"] for w in windows}
    if not any(k[1] == "control_b" for k in by):
        continue  # earlier runs: one control window, half as long as a publication's
    for (variant, kind, rep), gap in by.items():
        if kind != "load" or (variant, "first_use", rep) not in by or (variant, "control_b", rep) not in by:
            continue
        pub = max(gap, by[(variant, "first_use", rep)])
        ctl = max(by[(variant, "control", rep)], by[(variant, "control_b", rep)])
        pooled.setdefault((m.group(2), variant), []).append((int(m.group(1)), round(pub - ctl, 1)))
print("| server | adapter | runs | repetitions | publication - control, each (ms) | median |")
print("|---|---|---|---|---|---|")
for (server, variant), rows in sorted(pooled.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    values = [v for _, v in rows]
    runs = sorted({r for r, _ in rows})
    print(f"| {server} | {variant} | {', '.join(map(str, runs))} | {len(values)} | {sorted(values)} | "
          f"{statistics.median(values):+.1f} |")

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
print("| server | loads (B and B32) | longest scheduler iteration while preparing - before, each (ms) | median |")
print("|---|---|---|---|")
for server, values in sorted(scheduler.items()):
    print(f"| {server} | {len(values)} | {sorted(values)} | {statistics.median(values):+.1f} |")
