"""bench/areal_side_by_side.py on live SGLang 0.5.17: AReaL's path on two stock servers, then lorapub's on
two patched ones, one GPU, the model and adapters bench/live_online builds (a 4B-shaped random Qwen3,
264 MB r=64 adapters A and B, which the trainer alternates). Run by run.sh beside it, with the SGLang
bundle and AReaL 1.0.4 on PYTHONPATH. Env: OUT (results), LIVE_AREAL_ARGS (extra arguments for the
side-by-side), LIVE_AREAL_DEADLINE (a Unix time: each run is stopped in time to stop its servers).

Not run yet: the live figures are pending (docs/areal.md).
"""

import asyncio
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from tests.gpu import servers as srv  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
SLOTS = 5  # max_head_offpolicyness 1: lorapub's capacity 3 + 1; AReaL keeps 3 and loads a 4th before unloading
#: The workload: the recorded CPU size, with turns long enough for a GPU (64 tokens a turn).
ARGS = ["--rounds", "2", "--episodes", "16", "--group", "4", "--turns", "4", "--tokens", "64", "--updates", "4",
        "--interval", "2", "--wait", "180"]


def _live_online():
    spec = importlib.util.spec_from_file_location("lorapub_live_online", os.path.join(ROOT, "bench", "live_online",
                                                                                      "driver.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stop(signum, frame):
    raise SystemExit(128 + signum)


async def one_path(path: str, online, patched: bool) -> int:
    env = {"SGLANG_LORAPUB_MANAGED_PREFIX": "lorapub@"} if patched else None
    # One at a time: a server sizes its KV pool from the memory free when it starts, and one booting beside
    # another counts the other's weights as its own (live, 80 GB: "no GPU memory for the KV cache").
    servers: list[srv.Server] = []
    try:
        for i in range(2):
            servers.append(srv.start(f"{path}{i}", os.path.join(online.MODEL, "base"), 30400 + 100 * i, OUT,
                                     patched=patched, max_lora_rank=64, mem_fraction=0.40,
                                     target_modules=online.ALL_LINEAR, decode_graphs=True, max_loras=SLOTS, env=env))
            await srv.wait_healthy(servers)
        warm = await srv.warm_up(servers, os.path.join(online.MODEL, "A"))
        print(f"{path}: servers up {[round(s.boot_s) for s in servers]} s, warm-up {warm}", flush=True)
        cmd = [sys.executable, os.path.join(ROOT, "bench", "areal_side_by_side.py"), "--paths", path,
               "--urls", *(s.url for s in servers),
               "--adapters", os.path.join(online.MODEL, "A"), os.path.join(online.MODEL, "B"), *ARGS,
               "--json", os.path.join(OUT, f"areal-{path}.json"),
               *shlex.split(os.environ.get("LIVE_AREAL_ARGS", ""))]
        print("$", " ".join(cmd[1:]), flush=True)
        deadline = os.environ.get("LIVE_AREAL_DEADLINE")
        timeout = float(deadline) - time.time() - 30 if deadline else None
        try:
            return subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"{path}: the run ran out of time and was stopped", flush=True)
            return 124
    finally:
        srv.stop(servers)


async def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    os.makedirs(OUT, exist_ok=True)
    online = _live_online()
    online.build_model()
    # LIVE_AREAL_PATHS: which paths run, in order (default both: AReaL's on stock SGLang, then lorapub's)
    rcs = [await one_path(path, online, patched=path == "lorapub")
           for path in os.environ.get("LIVE_AREAL_PATHS", "areal lorapub").split()]
    return next((rc for rc in rcs if rc), 0)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
