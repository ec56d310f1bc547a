"""GPU-machine driver: build the random 4B-like Qwen3 + adapters, boot two SGLang servers side by side
(stock ``sglang.launch_server``, and the same server through ``python -m lorapub.sglang_patch launch``,
lorapub's runtime patch with its prepared loads), then measure each in turn with gap_bench.py while the
others idle. Run with the image's python, no PYTHONPATH.
Env: OUT (results folder), STALL_TOTAL_S (wall budget for this script, default 560), STALL_SITE (the
SGLang bundle's PYTHONPATH), LORAPUB_SRC (lorapub's source folder), STALL_ORDER (which servers, in
measuring order: "unpatched,patched" by default; "patched-switch" is the patched server with a 100 us GIL
switch interval while a preparation runs, "patched-image" the patched server with slot images asked for (the default
since 2026-12-07, so the same as "patched" since), "patched-no-image" the patched server without slot images (each
adapter's first batch fills its slot the stock way: the control for slot images by default; all with the default gate),
"patched-ungated" the patched server whose preparing thread does not step aside for prefill batches,
"patched-batch-gate" the patched server whose gate stays closed until the scheduler's next loop iteration,
budget 1 s -- what "patched" was in every run kept in 2026-12-03-load-gap; since 2026-12-06 "patched" steps aside only
while a prefill is launched, so keep its runs in a new folder -- "patched-budget150" the patched server
whose preparations wait for prefills at most 150 ms in all, the default since 2026-12-06 (named apart so the
runs before it read the same), and "patched-budget1000" at most 1 s, the default before).
STALL_REPS / STALL_REPS32: loads of B (default 3) and of B32 (default 2) per server. STALL_PRESET: the model's
shape (build_model.py: "4b" by default, "8b" the larger one, whose adapter is 349 MB).
With "unpatched" among them, a numerics check compares every other server's greedy outputs with it."""
import asyncio, json, os, re, signal, subprocess, sys, time, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gap_bench  # noqa: E402

T0 = time.time()
DEADLINE = T0 + float(os.environ.get("STALL_TOTAL_S", "560"))
OUT = os.environ.get("OUT", "/tmp/out")
ROOT = os.environ.get("STALL_ROOT", "/tmp/m")
PRESET = os.environ.get("STALL_PRESET", "4b")
os.makedirs(OUT, exist_ok=True)


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def env_site():
    site = os.environ.get("STALL_SITE", "/tmp/site")
    src = os.environ.get("LORAPUB_SRC", os.path.join(HERE, "..", "..", "src"))
    e = dict(os.environ, PYTHONPATH=f"{site}:{os.path.abspath(src)}", PYTHONUNBUFFERED="1")
    for variant_knob in ("LORAPUB_SGLANG_SLOT_IMAGE", "LORAPUB_SGLANG_PREPARE_SWITCH_US", "LORAPUB_SGLANG_PREPARE_GATE",
                         "LORAPUB_SGLANG_PREPARE_GATE_BUDGET_MS"):
        e.pop(variant_knob, None)  # only the server variant that names it gets it
    return e


# 1) model + adapters (image transformers/peft)
env_img = dict(os.environ); env_img.pop("PYTHONPATH", None)
if not os.path.exists(f"{ROOT}/B32/adapter_model.safetensors"):
    r = subprocess.run([sys.executable, f"{HERE}/build_model.py", ROOT, PRESET], env=env_img,
                       capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        if line.startswith("BUILD") or "Error" in line or "error" in line[:80]:
            print(line[:3000], flush=True)
    if r.returncode != 0:
        print((r.stdout + r.stderr)[-4000:]); sys.exit(2)
log("model built")

COMMON = ["--model-path", f"{ROOT}/base", "--enable-lora", "--max-loras-per-batch", "3",
          "--max-loaded-loras", "3", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
          "gate_proj", "up_proj", "down_proj", "--max-lora-rank", "64", "--skip-tokenizer-init",
          "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
          "--dtype", "bfloat16", "--max-total-tokens", "65536", "--mem-fraction-static", None,
          "--random-seed", "0", "--host", "127.0.0.1", "--cuda-graph-backend-prefill", "disabled",
          "--cuda-graph-max-bs-decode", "64"]
TRACE = {"LORAPUB_SGLANG_PREPARE_TRACE": os.environ.get("LORAPUB_SGLANG_PREPARE_TRACE", "1")}
KNOWN = {"unpatched": {"port": 30000, "extra": [], "entry": ["-m", "sglang.launch_server"]},
         "patched": {"port": 30001, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"], "env": TRACE},
         "patched-switch": {"port": 30002, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                            "env": dict(TRACE, LORAPUB_SGLANG_PREPARE_SWITCH_US="100")},
         "patched-image": {"port": 30003, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                           "env": dict(TRACE, LORAPUB_SGLANG_SLOT_IMAGE="1")},
         "patched-no-image": {"port": 30008, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                              "env": dict(TRACE, LORAPUB_SGLANG_SLOT_IMAGE="0")},
         "patched-ungated": {"port": 30004, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                             "env": dict(TRACE, LORAPUB_SGLANG_PREPARE_GATE="0")},
         # the gate closed until the next loop iteration, budget 1 s (the rule of runs 7-9); then the
         # default gate with a 150 ms budget (the default since 2026-12-06) and with 1 s (the default before)
         "patched-batch-gate": {"port": 30005, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                                "env": dict(TRACE, LORAPUB_SGLANG_PREPARE_GATE="batch",
                                            LORAPUB_SGLANG_PREPARE_GATE_BUDGET_MS="1000")},
         "patched-budget150": {"port": 30006, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                               "env": dict(TRACE, LORAPUB_SGLANG_PREPARE_GATE_BUDGET_MS="150")},
         "patched-budget1000": {"port": 30007, "extra": [], "entry": ["-m", "lorapub.sglang_patch", "launch"],
                                "env": dict(TRACE, LORAPUB_SGLANG_PREPARE_GATE_BUDGET_MS="1000")}}
REPS, REPS32 = int(os.environ.get("STALL_REPS", "3")), int(os.environ.get("STALL_REPS32", "2"))
PER_SERVER_S = 10 + gap_bench.REP_S * (REPS + REPS32)  # warm-up, then each repetition
ORDER = list(dict.fromkeys(n.strip() for n in os.environ.get("STALL_ORDER", "unpatched,patched").split(",") if n.strip()))
unknown = [n for n in ORDER if n not in KNOWN]
if unknown:
    sys.exit(f"STALL_ORDER names unknown servers {unknown}; known: {sorted(KNOWN)}")
SERVERS = {name: KNOWN[name] for name in ORDER}
# the servers share the GPU: their static memory together stays at 84 % (KV is capped by --max-total-tokens)
COMMON[COMMON.index(None)] = f"{min(0.42, 0.84 / len(SERVERS)):.2f}"


FRACTION_TOO_LOW = re.compile(r"Raise --mem-fraction-static above ([0-9]+(?:\.[0-9]+)?)")


def fraction_asked(name):
    """The static memory fraction a server that died said it needs (SGLang 0.5.17 names it when the
    servers booted before it leave too little), or None."""
    try:
        with open(f"{OUT}/server_{name}.log", errors="replace") as f:
            found = FRACTION_TOO_LOW.findall(f.read()[-20000:])
    except OSError:
        return None
    return float(found[-1]) if found else None


def launch(name, graphs=True):
    s = SERVERS[name]
    common = list(COMMON)
    if s.get("fraction"):  # raised after a boot that found too little memory left
        common[common.index("--mem-fraction-static") + 1] = f"{s['fraction']:.3f}"
    cmd = [sys.executable, *s["entry"], *common, "--port", str(s["port"]), *s["extra"]]
    if not graphs:
        cmd += ["--cuda-graph-backend-decode", "disabled"]
    s["cmd"] = " ".join(cmd[3:])
    s["graphs"] = graphs
    s["logf"] = open(f"{OUT}/server_{name}.log", "a")
    s["logf"].write(f"\n==== launch graphs={graphs} at {time.time() - T0:.1f}s: {s['cmd']}\n"); s["logf"].flush()
    s["proc"] = subprocess.Popen(cmd, env=dict(env_site(), **s.get("env", {})), stdout=s["logf"], stderr=subprocess.STDOUT,
                                 start_new_session=True)
    s["t_launch"] = time.time()
    s.pop("ready", None)


def kill(name):
    p = SERVERS[name].get("proc")
    if p and p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM); time.sleep(2); os.killpg(p.pid, signal.SIGKILL)
        except Exception:  # noqa: BLE001
            pass


def healthy(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001
        return False


for k, name in enumerate(ORDER):
    if k:
        time.sleep(3)
    launch(name)
# keep PER_SERVER_S per measured server (and 20 s for the numerics check) after the boot
boot_deadline = min(DEADLINE - PER_SERVER_S * len(ORDER) - 20, T0 + 430)
while time.time() < boot_deadline and not all("ready" in s for s in SERVERS.values()):
    for name, s in SERVERS.items():
        if "ready" in s:
            continue
        if s["proc"].poll() is not None:
            log(f"{name} died rc={s['proc'].returncode} graphs={s['graphs']}")
            asked = fraction_asked(name)
            if asked is not None and not s.get("fraction"):  # once: the same boot with the fraction it named
                s["fraction"] = asked + 0.02
                log(f"{name} asked for --mem-fraction-static above {asked}: booting it again with {s['fraction']:.3f}")
                launch(name, graphs=s["graphs"])
            elif s["graphs"]:
                launch(name, graphs=False)
            else:
                s["ready"] = None
            continue
        if healthy(s["port"]):
            s["ready"] = round(time.time() - s["t_launch"], 1)
            log(f"{name} ready after {s['ready']} s (graphs={s['graphs']})")
    time.sleep(2)
def gpu_mem():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return repr(e)


smi = gpu_mem()
log("boot done", {n: (s.get("ready"), s["graphs"]) for n, s in SERVERS.items()}, "gpu mem", smi)

results = {}
for k, name in enumerate(ORDER):
    s = SERVERS[name]
    if not s.get("ready"):
        why = ("it died at boot (its log says why)" if s["proc"].poll() is not None
               else "not up by the boot deadline (LORAPUB_GAP_BUDGET_S)")
        log(f"skip {name}: not ready, {why}")
        with open(f"{OUT}/not_measured.txt", "a") as f:  # the summary names every server it lacks
            f.write(f"{name}: {why}\n")
        continue
    later = sum(1 for n in ORDER[k + 1:] if SERVERS[n].get("ready"))
    dl = DEADLINE - PER_SERVER_S * later - 25  # room for the servers after this one and for the numerics check
    os.environ["STALL_DEADLINE"] = str(dl)
    log(f"bench {name} (deadline in {dl - time.time():.0f}s)")
    try:
        res = asyncio.run(gap_bench.Bench(f"http://127.0.0.1:{s['port']}", name).run(
            ROOT, REPS, REPS32, f"{OUT}/{name}", dl))
        res["info"]["server"] = {"cmd": s["cmd"], "graphs": s["graphs"], "boot_s": s["ready"]}
        with open(f"{OUT}/{name}.json", "w") as f:
            json.dump(res, f, indent=1)
        results[name] = res
        summ = {k2: {kk: v[kk] for kk in ("max_gap_ms", "itl_max_ms", "latency_ms", "status")}
                for k2, v in res["summary"].items()}
        log(f"RESULT {name} n_errors={res['info']['n_errors']} events={res['info']['n_events']} "
            f"chunks/tokens={res['info']['chunks_per_token_check']}")
        for k2, v in summ.items():
            print("   ", k2, json.dumps(v), flush=True)
        if res["info"]["errors"]:
            print("    errors:", res["info"]["errors"][:5], flush=True)
    except Exception as e:  # noqa: BLE001
        import traceback; traceback.print_exc()
        log(f"bench {name} failed: {e!r}")
    log(f"gpu mem after {name}: {gpu_mem()}")


def numerics():
    """Greedy outputs of A, B and B32 on both servers: a prepared load must serve exactly what
    SGLang's own load serves (same token ids, same log-probs)."""
    import random

    async def run():
        import aiohttp

        rng = random.Random(5)
        prompts = [[rng.randrange(1, 150000) for _ in range(64)] for _ in range(3)]
        out = {}
        async with aiohttp.ClientSession() as http:
            for name, s in SERVERS.items():
                if not s.get("ready") or s["proc"].poll() is not None:
                    continue
                url = f"http://127.0.0.1:{s['port']}"
                for lora in ("B", "B32"):
                    async with http.post(url + "/load_lora_adapter", json={
                            "lora_name": lora, "lora_path": f"{ROOT}/{lora}", "pinned": False}) as r:
                        assert r.status == 200, await r.text()
                res = {}
                for lora in ("A", "B", "B32"):
                    for i, ids in enumerate(prompts):
                        body = {"input_ids": ids, "lora_path": lora, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}
                        async with http.post(url + "/generate", json=body) as r:
                            j = await r.json()
                        res[f"{lora}#{i}"] = (j["output_ids"], [x[0] for x in j["meta_info"]["output_token_logprobs"]])
                out[name] = res
        return out

    out = asyncio.run(run())
    if "unpatched" not in out or len(out) < 2:
        return {"skipped": f"servers answering: {sorted(out)}"}
    a = out.pop("unpatched")
    rows = {}
    for name, b in out.items():  # each patched server against the stock one
        for key in a:
            same_ids = a[key][0] == b[key][0]
            diff = max(abs(x - y) for x, y in zip(a[key][1], b[key][1]))
            rows[f"{name}:{key}" if len(out) > 1 else key] = {"same_token_ids": same_ids, "max_logprob_diff": diff}
    return rows


try:
    check = numerics()
    results["numerics"] = check
    log("NUMERICS patched vs unpatched (greedy, 16 tokens):", json.dumps(check))
    with open(f"{OUT}/numerics.json", "w") as f:
        json.dump(check, f, indent=1)
except Exception as e:  # noqa: BLE001
    import traceback; traceback.print_exc()
    log(f"numerics failed: {e!r}")
for name in SERVERS:
    kill(name)
log("end")
