"""bench/run.py's online figures on live SGLang: two patched SGLang servers on one GPU.

Builds the 4B-shaped random Qwen3 and its 264 MB r=64 adapters (bench/live_load_gap/build_model.py),
boots two servers through lorapub's runtime patch (``python -m lorapub.sglang_patch launch``, every
linear module a LoRA target, rank 64), warms them up (Triton compiles its kernels before anything is
measured), then runs ``bench/run.py`` against them: control, baseline (lorapub's switch off: pause,
flush, overwrite) and lorapub, interleaved rounds, lorapub's bytes over HTTP into each engine's own
staging, each version a rescaled copy of adapter B, once per workload (WORKLOADS). Run by run.sh
beside it, with the SGLang bundle on PYTHONPATH. Env: OUT (results), LIVE_ONLINE_WORKLOADS (which
workloads, comma-separated; default all; "<workload>@shm" runs one with the bytes through shared memory;
"<workload>[@shm]/<variant>" adds LIVE_ONLINE_ARGS_<VARIANT>), LIVE_ONLINE_ARGS (extra bench/run.py arguments, every workload),
LIVE_ONLINE_ARGS_<WORKLOAD> (one workload's), LIVE_ONLINE_MAX_LORAS (the servers' LoRA slots, default 3), LIVE_ONLINE_CONTROL_PLANE=0 (no control-plane table).
"""
import asyncio
import importlib.util
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from tests.gpu import servers as srv  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
MODEL = os.environ.get("LIVE_ONLINE_MODEL", "/tmp/m")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Two workloads on the same servers, one bench/run.py each, each with one publication 2 s into the
# workload (while sessions run and arrive):
# * "busy": 192 sessions arriving every 30 ms, 8 new tokens a turn, 50 ms tools. Many completions a
#   second, but more arrivals than the servers prefill: a run of it with three publications
#   (bench/results/2026-12-03-online-live-run3) showed decoding starved while sessions kept arriving (each new
#   request's prefill, launch-bound with a rank-64 adapter on every module, runs before any decode
#   step) and requests completing in bursts once arrivals stopped, so the control's own longest
#   gap was 0.7-1.5 s; and lorapub deferred two of its three publications for capacity (sessions
#   keep their version for their whole life, and at most two managed versions are held, as
#   specified), so its figures rested on one publication against the baseline's three.
# * "steady": 64 sessions arriving every 50 ms, 32 new tokens a turn, 0.5 s tools: fewer
#   arrivals than the servers prefill, so decoding runs between them.
# (An earlier run with 256 sessions, 32 tokens and no decode CUDA graphs kept 128 requests per
# engine decoding in lockstep at ~60 ms a step: bench/results/2026-12-03-online-live-attempts/attempt-2-bench.txt.)
ONE_PUBLICATION = ["--publications", "1", "--cadence", "2.0"]
# * "long": longer trajectories at training cadence (8-12 tool turns, GRPO groups of 4 binding as
#   one), the freshness workload of lorapub's own: sessions outlive several publications.
WORKLOADS = {
    "busy": ["--sessions", "192", "--arrival", "0.03", "--max-new-tokens", "8", "--tool-latency", "0.05",
             *ONE_PUBLICATION],
    "steady": ["--sessions", "64", "--arrival", "0.05", "--max-new-tokens", "32", "--tool-latency", "0.5",
               *ONE_PUBLICATION],
    "long": ["--sessions", "64", "--arrival", "0.1", "--max-new-tokens", "32", "--tool-latency", "0.5",
             "--turns", "8", "12", "--group-size", "4", "--publications", "4", "--cadence", "1.0"],
}
TRANSPORTS = {"http": ["--transport", "http"], "shm": ["--transport", "folder", "--stash-dir", "/dev/shm"]}
#: The servers log each scheduler iteration around a load (bench/attribution.py names where a slow decode
#: step went); LORAPUB_SGLANG_PREPARE_TRACE=0 in the driver's environment turns that off.
TRACE = "LORAPUB_SGLANG_PREPARE_TRACE"
#: SGLang's --max-loras-per-batch / --max-loaded-loras on both servers (capacity N needs N + 1).
MAX_LORAS = int(os.environ.get("LIVE_ONLINE_MAX_LORAS", "3"))
# each server's static share of GPU memory: 0.40 suits two servers on a 141 GB card; on an 80 GB card the
# second server's start-up profile sees the first one's pool and needs a little more (SGLang names the minimum)
MEM_FRACTION = float(os.environ.get("LIVE_ONLINE_MEM_FRACTION", "0.40"))
# on an 80 GB card the two servers boot one after the other (a second one sizing its pool while the
# first allocates sees too little free memory and exits)
SEQUENTIAL_BOOT = os.environ.get("LIVE_ONLINE_SEQUENTIAL_BOOT", "0") == "1"


def build_model() -> None:
    if os.path.exists(os.path.join(MODEL, "B", "adapter_model.safetensors")):
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the image's own transformers and peft
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "live_load_gap", "build_model.py"), MODEL, "4b"],
                       env=env, capture_output=True, text=True)
    print("\n".join(line for line in (r.stdout + r.stderr).splitlines() if line.startswith("BUILD")), flush=True)
    if r.returncode:
        sys.exit(f"building the model failed:\n{(r.stdout + r.stderr)[-3000:]}")


async def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    t0 = time.monotonic()
    build_model()
    print(f"model built in {time.monotonic() - t0:.0f} s", flush=True)
    # decode with CUDA graphs, as the decode-gap bench and production servers run (without them a
    # decode step at 128 running requests took ~60 ms)
    def boot(i: int):
        return srv.start(f"e{i}", os.path.join(MODEL, "base"), 30400 + 100 * i, OUT, patched=True, max_lora_rank=64,
                         mem_fraction=MEM_FRACTION, target_modules=ALL_LINEAR, decode_graphs=True, max_loras=MAX_LORAS,
                         env={TRACE: os.environ.get(TRACE, "1")})

    if SEQUENTIAL_BOOT:  # each server sizes its KV pool from the memory free when it starts: one at a time
        engines = [boot(0)]
    else:
        engines = [boot(i) for i in range(2)]
    try:
        await srv.wait_healthy(engines)
        if SEQUENTIAL_BOOT:
            engines.append(boot(1))
            await srv.wait_healthy(engines)
        warm = await srv.warm_up(engines, os.path.join(MODEL, "A"))
        print(f"servers up {[round(s.boot_s) for s in engines]} s, warm-up {warm}", flush=True)
        rc = 0
        for n, name in enumerate(os.environ.get("LIVE_ONLINE_WORKLOADS", ",".join(WORKLOADS)).split(",")):
            # "<workload>@shm": the same workload with lorapub's bytes as bucket files in shared memory
            # (SharedDir over /dev/shm, the engines' default LORAPUB_SHM_DIR) instead of HTTP bodies
            # "<workload>[@<transport>][/<variant>]": a variant adds LIVE_ONLINE_ARGS_<VARIANT>'s arguments
            # (the same workload twice in one run, e.g. steady@shm/error and steady@shm/rebind)
            spec, _, variant = name.partition("/")
            workload, _, transport = spec.partition("@")
            label = name.replace("@", "-").replace("/", "-")
            cmd = [sys.executable, os.path.join(ROOT, "bench", "run.py"),
                   *(a for s in engines for a in ("--engine-url", s.url)),
                   *(a for s in engines for a in ("--engine-log", s.log_path)),
                   *TRANSPORTS[transport or "http"], "--adapter", os.path.join(MODEL, "B"), *WORKLOADS[workload],
                   "--json", os.path.join(OUT, f"online-{label}.json"),
                   *shlex.split(os.environ.get("LIVE_ONLINE_ARGS", "")),
                   *shlex.split(os.environ.get(f"LIVE_ONLINE_ARGS_{workload.upper()}", "")),
                   *shlex.split(os.environ.get(f"LIVE_ONLINE_ARGS_{variant.upper()}", "") if variant else "")]
            if importlib.util.find_spec("matplotlib") is not None:
                cmd += ["--plot", os.path.join(OUT, f"timeline-{label}.png")]
            # the control plane (registry decisions alone, no engine) is the same for every workload, and
            # needs no GPU: LIVE_ONLINE_CONTROL_PLANE=0 skips it for the first too
            if n or os.environ.get("LIVE_ONLINE_CONTROL_PLANE") == "0":
                cmd += ["--skip-control-plane"]
            print(f"== workload {name} ==\n$", " ".join(cmd[1:]), flush=True)
            rc = subprocess.run(cmd).returncode or rc  # every workload runs, whatever the one before said
        return rc
    finally:
        srv.stop(engines)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
