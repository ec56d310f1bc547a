"""Summarise a GPU run's results (OUT folder with one NAME.json and NAME_events.txt.gz per server).
'action gap' = longest interval with no token on any stream that STARTS between the HTTP call and
its response (the stall the call caused, one decode step included). 'window max' = longest gap
ending inside the 3 s window (what the lorapub goal compares with the control).
Usage: python summarize.py RESULTS_DIR"""
import gzip, json, os, statistics, sys

d = sys.argv[1]
med = statistics.median


def window_gap(w):
    """The window's longest gap; a window with fewer than two tokens had none for all its length."""
    gap = w.get("merged_max_gap_ms")
    return gap if gap is not None else round((w["t1"] - w["t0"]) * 1e3, 1)


names = sorted((f[:-5] for f in os.listdir(d) if f.endswith(".json") and f != "numerics.json"
                and os.path.exists(os.path.join(d, f[:-5] + "_events.txt.gz"))),  # one per measured server
               key=lambda n: (n != "unpatched", n))
for name in names:
    p = os.path.join(d, f"{name}.json")
    r = json.load(open(p))
    ts = sorted(float(l.split()[0]) for l in gzip.open(os.path.join(d, f"{name}_events.txt.gz"), "rt"))
    gaps = [(ts[i - 1], ts[i] - ts[i - 1]) for i in range(1, len(ts))]
    rows = {}
    for w in r["windows"]:
        key = (w["variant"], w["kind"])
        e = rows.setdefault(key, {"act": [], "lat": [], "by_rep": {}})
        e["by_rep"][w["rep"]] = window_gap(w)
        if "latency_ms" in w:
            a, b = w["t0"], w["t0"] + w["latency_ms"] / 1e3
            act = max((g for s, g in gaps if a <= s <= b), default=None)  # None: no token in the whole call
            e["act"].append(None if act is None else round(act * 1e3, 1))
            e["lat"].append(w["latency_ms"])
        if "old_latency_ms" in w:
            e.setdefault("old", []).append(w["old_latency_ms"])
    ctl = {v: med(rows[(v, "control")]["by_rep"].values()) for v in ("B", "B32") if (v, "control") in rows}
    print(f"## {name}  (ITL p50 {med(w['itl_p50_ms'] for w in r['windows'])} ms, "
          f"{r['info']['streams']} streams, errors {r['info']['n_errors']})")
    print("| adapter | phase | HTTP latency ms (each) | action gap ms (each) | window max gap ms (each) | "
          "median window max | control median | excess |")
    print("|---|---|---|---|---|---|---|---|")
    for (v, k), e in rows.items():
        win = list(e["by_rep"].values())  # in repetition order
        m = med(win)
        print(f"| {v} | {k} | {e['lat'] or '-'} | {e['act'] or '-'} | {win} | {m} | {ctl[v]} | "
              f"{round(m - ctl[v], 1):+} |")
    # whole publication = load window + first_use window, per rep, against a control as long (two
    # windows: control + control_b); runs before control_b existed compared it with one 3 s window
    for v in ("B", "B32"):
        if (v, "load") in rows:
            reps = sorted(set(rows[(v, "load")]["by_rep"]) & set(rows[(v, "first_use")]["by_rep"]))
            pub = [max(rows[(v, "load")]["by_rep"][i], rows[(v, "first_use")]["by_rep"][i]) for i in reps]
            if (v, "control_b") in rows:
                both = [round(max(rows[(v, "control")]["by_rep"][i], rows[(v, "control_b")]["by_rep"][i]), 1)
                        for i in reps]
                paired = [round(p - c, 1) for p, c in zip(pub, both)]
                print(f"publication {v}: max gap over load+first_use windows {pub}, median {med(pub)}; "
                      f"control over as long {both}, median {round(med(both), 1)}; excess {round(med(pub) - med(both), 1):+} "
                      f"(per repetition {paired}, median {med(paired):+})")
            else:
                print(f"publication {v}: max gap over load+first_use windows {pub}, median {med(pub)}, "
                      f"control {ctl[v]} (one window, half as long), excess {round(med(pub) - ctl[v], 1):+}")
        if (v, "first_use") in rows and rows[(v, "first_use")].get("old"):
            new, old = rows[(v, "first_use")]["lat"], rows[(v, "first_use")]["old"]
            print(f"first request {v}: new version {new} ms, same request on the old version {old} ms, "
                  f"median new - old {round(med(new) - med(old), 1):+} ms")
    print()
missing = os.path.join(d, "not_measured.txt")
if os.path.exists(missing):  # a server of STALL_ORDER that never answered: shown, never silently absent
    for line in open(missing):
        print(f"## {line.split(':')[0]}  NOT MEASURED: {line.split(':', 1)[1].strip()}")
