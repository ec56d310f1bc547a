"""bench/run.py's online figures on live SGLang: two patched SGLang servers on one GPU.

Builds the 4B-shaped random Qwen3 and its 264 MB r=64 adapters (bench/live_load_gap/build_model.py),
boots two servers through lorapub's runtime patch (``python -m lorapub.sglang_patch launch``, every
linear module a LoRA target, rank 64), warms them up (Triton compiles its kernels before anything is
measured), then runs ``bench/run.py`` against them: control, baseline (lorapub's switch off: pause,
flush, overwrite) and lorapub, interleaved rounds, lorapub's bytes over HTTP into each engine's own
staging, each version a rescaled copy of adapter B. Run by run.sh beside it, with the SGLang bundle
on PYTHONPATH. Env: OUT (results), LIVE_ONLINE_ARGS (extra bench/run.py arguments).
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
# A first run with 256 sessions and 32 new tokens a turn kept 128 requests per engine decoding in
# lockstep at ~60 ms a step (rank-64 LoRA, no decode graphs): every run's longest no-progress gap
# was one batch's 2-2.7 s, so a publication's stall could not show. Shorter turns and sessions spread
# over ~6 s, so that each of the three publications (a 264 MB adapter: about a second each) lands
# while sessions run.
WORKLOAD = ["--sessions", "192", "--arrival", "0.03", "--max-new-tokens", "8", "--tool-latency", "0.05"]


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
    engines = [srv.start(f"e{i}", os.path.join(MODEL, "base"), 30400 + 100 * i, OUT, patched=True, max_lora_rank=64,
                         mem_fraction=0.40, target_modules=ALL_LINEAR, decode_graphs=True) for i in range(2)]
    try:
        await srv.wait_healthy(engines)
        warm = await srv.warm_up(engines, os.path.join(MODEL, "A"))
        print(f"servers up {[round(s.boot_s) for s in engines]} s, warm-up {warm}", flush=True)
        cmd = [sys.executable, os.path.join(ROOT, "bench", "run.py"), *(a for s in engines for a in ("--engine-url", s.url)),
               "--transport", "http", "--adapter", os.path.join(MODEL, "B"), *WORKLOAD,
               "--json", os.path.join(OUT, "online.json"),
               *shlex.split(os.environ.get("LIVE_ONLINE_ARGS", ""))]
        if importlib.util.find_spec("matplotlib") is not None:
            cmd += ["--plot", os.path.join(OUT, "timeline.png")]
        print("$", " ".join(cmd[1:]), flush=True)
        return subprocess.run(cmd).returncode
    finally:
        srv.stop(engines)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
