"""Drive N concurrent streaming /generate requests on adapter A against a live SGLang server and
measure the no-progress gap while /load_lora_adapter (B, pinned), the first request on B and
/unload_lora_adapter run. Windows per repetition: control and control_b (nothing; together as long as
load and first_use together), load, first_use, unload.
The first request on B is sent together with a request of the same shape on A (the old version):
both latencies are recorded, so "the first request on the new version is no slower" is measured.
Metrics per window: merged_max_gap_ms = longest interval with no token arriving on ANY stream
(gap ending inside the window); itl_max_ms = longest token-to-token interval within one request;
tokens/s; completions. Usage: python gap_bench.py URL LABEL ADAPTER_ROOT OUT_PREFIX [reps] [reps32]"""
import asyncio, gc, gzip, json, os, random, statistics, sys, time
from bisect import bisect_left, bisect_right

import aiohttp

pc = time.perf_counter
STREAMS = int(os.environ.get("STALL_STREAMS", "48"))
PLEN = int(os.environ.get("STALL_PLEN", "128"))
WIN = float(os.environ.get("STALL_WIN", "3.0"))
#: one repetition: two control windows, load, first use (each WIN and the calls' latency), unload (WIN / 2)
REP_S = 4.5 * WIN + 3.0
MAXNEW = (128, 384)  # per request uniform, mean 256; de-synchronises request restarts


async def post(sess, url, body, timeout=300):
    t0 = pc()
    try:
        async with sess.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            txt = await r.text()
            st = r.status
    except Exception as e:  # noqa: BLE001
        st, txt = -1, repr(e)
    return st, txt, t0, pc()


class Bench:
    def __init__(self, url, label):
        self.url, self.label = url, label
        self.events = []       # (t, wid, req)
        self.completions = []  # (t, wid, req, chunks, completion_tokens)
        self.errors = []
        self.stop = False

    async def worker(self, wid, sess):
        rng = random.Random(7919 * wid + 13)
        await asyncio.sleep(wid * 2.0 / STREAMS)  # staggered start
        req = 0
        while not self.stop:
            ids = [rng.randrange(1, 150000) for _ in range(PLEN)]
            body = {"input_ids": ids, "lora_path": "A", "stream": True,
                    "sampling_params": {"max_new_tokens": rng.randint(*MAXNEW), "temperature": 0.0,
                                        "ignore_eos": True}}
            chunks, last = 0, b""
            try:
                async with sess.post(self.url + "/generate", json=body) as r:
                    if r.status != 200:
                        self.errors.append((pc(), r.status, (await r.text())[:300]))
                        await asyncio.sleep(0.2)
                        continue
                    async for line in r.content:
                        if not line.startswith(b"data:"):
                            continue
                        t = pc()
                        if line.startswith(b"data: [DONE]"):
                            break
                        self.events.append((t, wid, req))
                        chunks += 1
                        last = line
                        if self.stop:
                            break
                ct = None
                try:
                    ct = json.loads(last[5:]).get("meta_info", {}).get("completion_tokens")
                except Exception:  # noqa: BLE001
                    pass
                self.completions.append((pc(), wid, req, chunks, ct))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                if not self.stop:
                    self.errors.append((pc(), -1, repr(e)[:300]))
                    await asyncio.sleep(0.2)
            req += 1

    def analyse(self, windows):
        ev = sorted(self.events)
        ts = [e[0] for e in ev]
        # previous token time of the same request, per event
        prev_same = {}
        itl = []  # (t, itl)
        for t, w, q in ev:
            k = (w, q)
            if k in prev_same:
                itl.append((t, t - prev_same[k]))
            prev_same[k] = t
        itl_t = [x[0] for x in itl]
        comp_t = sorted(c[0] for c in self.completions)
        for w in windows:
            a, b = w["t0"], w["t1"]
            i0, i1 = bisect_right(ts, a), bisect_right(ts, b)
            gaps = [(ts[i] - ts[i - 1], ts[i - 1]) for i in range(max(i0, 1), i1)]
            g = sorted((x[0] for x in gaps), reverse=True)
            j0, j1 = bisect_right(itl_t, a), bisect_right(itl_t, b)
            il = sorted((itl[j][1] for j in range(j0, j1)), reverse=True)
            w["tokens"] = i1 - i0
            w["tok_per_s"] = round((i1 - i0) / (b - a), 1)
            w["merged_max_gap_ms"] = round(g[0] * 1e3, 1) if g else None
            w["merged_gap_top5_ms"] = [round(x * 1e3, 1) for x in g[:5]]
            w["merged_gap_p50_ms"] = round(statistics.median(g) * 1e3, 2) if g else None
            if gaps:
                mg = max(gaps)
                w["max_gap_start_rel_ms"] = round((mg[1] - a) * 1e3, 1)
            w["itl_max_ms"] = round(il[0] * 1e3, 1) if il else None
            w["itl_p99_ms"] = round(il[int(0.01 * len(il))] * 1e3, 1) if il else None
            w["itl_p50_ms"] = round(statistics.median(il) * 1e3, 1) if il else None
            w["completions"] = bisect_right(comp_t, b) - bisect_right(comp_t, a)
        return windows

    async def run(self, root, reps, reps32, out_prefix, deadline):
        conn = aiohttp.TCPConnector(limit=0)
        sess = aiohttp.ClientSession(connector=conn, read_bufsize=1 << 20,
                                     timeout=aiohttp.ClientTimeout(total=None))
        ctl = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20)
        info = {"label": self.label, "streams": STREAMS, "prompt_len": PLEN, "win_s": WIN, "max_new": MAXNEW}
        st, txt, a0, a1 = await post(ctl, self.url + "/load_lora_adapter",
                                     {"lora_name": "A", "lora_path": f"{root}/A", "pinned": True})
        info["load_A"] = {"status": st, "ms": round((a1 - a0) * 1e3, 1), "resp": txt[:300]}
        # warm A on the GPU and the LoRA kernels
        rr = await asyncio.gather(*[post(ctl, self.url + "/generate", {
            "input_ids": [random.randrange(1, 150000) for _ in range(PLEN)], "lora_path": "A",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}) for _ in range(8)])
        info["warm_status"] = [r[0] for r in rr]
        # no collection in this process while it timestamps tokens: a full one over the hundreds of
        # thousands of recorded events stalled the client 0.4-0.5 s, read as a gap on the server
        gc.collect(); gc.freeze(); gc.disable()
        wall0, pc0 = time.time(), pc()
        tasks = [asyncio.create_task(self.worker(i, sess)) for i in range(STREAMS)]
        await asyncio.sleep(6.0)  # steady state
        windows = []
        plan = [("B", i) for i in range(reps)] + [("B32", i) for i in range(reps32)]
        for variant, rep in plan:
            if deadline and time.time() + REP_S > deadline:
                info["stopped_early_at"] = f"{variant}#{rep}"
                break
            # two control windows as long as the load and first_use windows together: the publication's
            # longest gap (over both) is compared with the control's over the same length of time
            for kind in ("control", "control_b"):
                c0 = pc(); await asyncio.sleep(WIN)
                windows.append({"kind": kind, "variant": variant, "rep": rep, "t0": c0, "t1": pc()})
            st, txt, l0, l1 = await post(ctl, self.url + "/load_lora_adapter",
                                         {"lora_name": "B", "lora_path": f"{root}/{variant}", "pinned": True})
            end = max(l0 + WIN, l1 + 0.5); await asyncio.sleep(max(0.0, end - pc()))
            windows.append({"kind": "load", "variant": variant, "rep": rep, "t0": l0, "t1": pc(), "status": st,
                            "latency_ms": round((l1 - l0) * 1e3, 1), "resp": txt[:200]})
            first = {"input_ids": [random.randrange(1, 150000) for _ in range(PLEN)],
                     "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
            (st, txt, u0, u1), (ost, _, o0, o1) = await asyncio.gather(
                post(ctl, self.url + "/generate", dict(first, lora_path="B")),
                post(ctl, self.url + "/generate", dict(first, lora_path="A")))
            end = max(u0 + WIN, u1 + 0.5); await asyncio.sleep(max(0.0, end - pc()))
            windows.append({"kind": "first_use", "variant": variant, "rep": rep, "t0": u0, "t1": pc(),
                            "status": st, "latency_ms": round((u1 - u0) * 1e3, 1),
                            "old_status": ost, "old_latency_ms": round((o1 - o0) * 1e3, 1),
                            "resp": txt[:120] if st != 200 else ""})
            st, txt, n0, n1 = await post(ctl, self.url + "/unload_lora_adapter", {"lora_name": "B"})
            end = max(n0 + WIN / 2, n1 + 0.5); await asyncio.sleep(max(0.0, end - pc()))
            windows.append({"kind": "unload", "variant": variant, "rep": rep, "t0": n0, "t1": pc(),
                            "status": st, "latency_ms": round((n1 - n0) * 1e3, 1), "resp": txt[:200]})
        self.stop = True
        await asyncio.sleep(0.3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gc.enable(); gc.unfreeze()
        await sess.close(); await ctl.close()
        self.analyse(windows)
        for w in windows:  # wall-clock for matching server logs
            w["wall0"] = round(wall0 + (w["t0"] - pc0), 3)
            w["t0"], w["t1"] = round(w["t0"] - pc0, 4), round(w["t1"] - pc0, 4)
        cc = [c for c in self.completions if c[4] is not None]
        info["chunks_per_token_check"] = {"requests": len(cc), "chunks": sum(c[3] for c in cc),
                                          "tokens": sum(c[4] for c in cc)}
        info["errors"] = [(round(e[0] - pc0, 3), e[1], e[2]) for e in self.errors[:20]]
        info["n_errors"] = len(self.errors)
        info["n_events"] = len(self.events)
        res = {"info": info, "windows": windows, "summary": summarise(windows)}
        with open(out_prefix + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with gzip.open(out_prefix + "_events.txt.gz", "wt") as f:
            for t, w, q in sorted(self.events):
                f.write(f"{t - pc0:.5f} {w} {q}\n")
        return res


def summarise(windows):
    out = {}
    for w in windows:
        k = f"{w['variant']}:{w['kind']}"
        out.setdefault(k, []).append(w)
    s = {}
    for k, ws in out.items():
        g = [w["merged_max_gap_ms"] for w in ws if w.get("merged_max_gap_ms") is not None]
        il = [w["itl_max_ms"] for w in ws if w.get("itl_max_ms") is not None]
        lat = [w["latency_ms"] for w in ws if "latency_ms" in w]
        old = [w["old_latency_ms"] for w in ws if "old_latency_ms" in w]
        s[k] = {"n": len(ws), "max_gap_ms": g, "max_gap_median": statistics.median(g) if g else None,
                "itl_max_ms": il, "tok_per_s": [w["tok_per_s"] for w in ws],
                "latency_ms": lat, "latency_median": statistics.median(lat) if lat else None,
                "latency_max": max(lat) if lat else None, "status": [w.get("status") for w in ws],
                **({"old_latency_ms": old} if old else {})}
    return s


if __name__ == "__main__":
    url, label, root, outp = sys.argv[1:5]
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    reps32 = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    deadline = float(os.environ.get("STALL_DEADLINE", "0"))
    res = asyncio.run(Bench(url, label).run(root, reps, reps32, outp, deadline))
    print("BENCH " + label + " " + json.dumps({"info": {k: v for k, v in res["info"].items() if k != "errors"},
                                               "summary": res["summary"]}))
