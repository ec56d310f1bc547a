"""driver.py on live SGLang: two patched SGLang servers on one GPU, booted as bench/live_online does.

Builds the 4B-shaped random Qwen3 and its 264 MB r=64 adapters (bench/live_online/driver.py's
``build_model``), boots two servers through lorapub's runtime patch (``python -m lorapub.sglang_patch
launch``, tests/gpu/servers.py: every linear module a LoRA target, rank 64, decode CUDA graphs), warms
them up, then runs ``bench/live_relax/driver.py`` against them with adapter B, lorapub's bytes over
HTTP. Run by run.sh beside it, with the SGLang bundle on PYTHONPATH. Env: OUT (results),
LIVE_RELAX_MAX_LORAS (the servers' --max-loras-per-batch and --max-loaded-loras, default 5: lorapub's
capacity + 1, and one for Relax's fixed adapter, so the driver runs with capacity LIVE_RELAX_MAX_LORAS - 2),
LIVE_RELAX_ARGS (extra driver arguments), LIVE_RELAX_DEADLINE (a Unix time: the driver is stopped in time
for the servers to be stopped before it).
"""

import asyncio
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src")]

from lorapub.integrations.relax import LorapubConfig, engine_env  # noqa: E402
from tests.gpu import servers as srv  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
MAX_LORAS = int(os.environ.get("LIVE_RELAX_MAX_LORAS", "5"))
#: The workload (driver.py's defaults otherwise): two rounds fit the script's budget on a fresh machine.
ARGS = ["--rounds", "2"]


def _live_online():
    """bench/live_online/driver.py as a module: its model build and server settings are reused."""
    spec = importlib.util.spec_from_file_location("lorapub_live_online", os.path.join(ROOT, "bench", "live_online",
                                                                                      "driver.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def relax_route_check(servers, adapter_dir: str) -> dict:
    """On Relax's image: its same-name replace route (/update_lora_from_distributed) must refuse a
    version lorapub manages, and that version stays loaded. A version is published for the check
    and reclaimed after it (the servers are left as found)."""
    import aiohttp

    from lorapub import Deployment
    from lorapub.adapters.sglang_wire import SGLangWireEngine
    from tests.gpu.fixtures import adapter_snapshot

    from lorapub.integrations.relax import DEFAULT_NAME_PREFIX

    engines = {s.name: SGLangWireEngine(s.name, s.url) for s in servers}
    dep = await Deployment(engines, epoch=int(time.time() * 1000), reconcile_interval=None,
                           name_prefix=DEFAULT_NAME_PREFIX).start()
    out = {}
    try:
        report = await dep.publish(adapter_snapshot(adapter_dir), "relax-route-check")
        async with aiohttp.ClientSession() as http:
            for s in servers:
                async with http.post(s.url + "/update_lora_from_distributed", json={
                        "lora_name": report.lora_name, "config_dict": {"r": 64}, "names": [], "dtypes": [],
                        "shapes": [], "pinned": True}) as r:
                    status, text = r.status, await r.text()
                state = await engines[s.name].state()
                out[s.name] = {"sglang": state.get("sglang"), "status": status, "answer": text[:300],
                               "refused_managed": status == 400 and "managed by lorapub" in text,
                               "still_loaded": report.lora_name in state["adapters"]}
        for e in engines.values():  # the check's version goes (nothing used it): the servers as found
            await e.reclaim(report.lora_name, "relax-route-check")
    finally:
        await dep.close()
    return out


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # run.sh's timeout: stop the servers on the way out


async def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    os.makedirs(OUT, exist_ok=True)
    online = _live_online()
    t0 = time.monotonic()
    online.build_model()
    print(f"model built in {time.monotonic() - t0:.0f} s", flush=True)
    engines = [srv.start(f"e{i}", os.path.join(online.MODEL, "base"), 30400 + 100 * i, OUT, patched=True,
                         max_lora_rank=64, mem_fraction=0.40, target_modules=online.ALL_LINEAR, decode_graphs=True,
                         max_loras=MAX_LORAS, env=engine_env(LorapubConfig()))  # they protect its names
               for i in range(2)]
    try:
        await srv.wait_healthy(engines)
        warm = await srv.warm_up(engines, os.path.join(online.MODEL, "A"))
        print(f"servers up {[round(s.boot_s) for s in engines]} s, warm-up {warm}", flush=True)
        route = await relax_route_check(engines, os.path.join(online.MODEL, "A"))
        print("relax route check:", json.dumps(route), flush=True)
        with open(os.path.join(OUT, "relax-route.json"), "w") as f:
            json.dump(route, f, indent=1)
        cmd = [sys.executable, os.path.join(ROOT, "bench", "live_relax", "driver.py"),
               *(a for s in engines for a in ("--engine-url", s.url)), "--adapter", os.path.join(online.MODEL, "B"),
               "--transport", "http", "--capacity", str(MAX_LORAS - 2), *ARGS,
               "--json", os.path.join(OUT, "relax.json"), *shlex.split(os.environ.get("LIVE_RELAX_ARGS", ""))]
        print("$", " ".join(cmd[1:]), flush=True)
        deadline = os.environ.get("LIVE_RELAX_DEADLINE")
        timeout = float(deadline) - time.time() - 30 if deadline else None  # 30 s to stop the servers
        try:
            return subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"the driver ran out of time ({timeout:.0f} s) and was stopped", flush=True)
            return 124
    finally:
        srv.stop(engines)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
