"""elastic.py on live SGLang: three patched SGLang servers on one GPU, booted as live.py boots two.

e0 and e1 boot first, one after another (a server's boot is minutes, not what is measured), then e2 boots
while they serve and joins once it is healthy. elastic.py is started before the boots, builds its versions
beside them and sends its first request once e0 and e1 are up and warm; it starts with e0 and e1
in the router's list and the trainer's topology, adds e2 under load, then drains and removes e0. Adapter B
of bench/live_online's 4B-shaped model, lorapub's bytes over HTTP. Run by elastic.sh beside it, with the
SGLang bundle on PYTHONPATH. Env: OUT (results), LIVE_RELAX_MAX_LORAS (each server's LoRA slots, default 5:
capacity 3 + 2, sglang_overrides()), LIVE_RELAX_ELASTIC_ARGS (extra elastic.py arguments),
LIVE_RELAX_DEADLINE (a Unix time: elastic.py is stopped in time for the servers to be stopped).
"""

import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "src"), HERE]

from lorapub.integrations.relax import LorapubConfig, engine_env  # noqa: E402
from tests.gpu import servers as srv  # noqa: E402

import live  # noqa: E402  (live.py: bench/live_online's model build)

OUT = os.environ.get("OUT", "/tmp/out")
MAX_LORAS = int(os.environ.get("LIVE_RELAX_MAX_LORAS", "5"))


def _stop(signum, frame):
    raise SystemExit(128 + signum)


async def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    os.makedirs(OUT, exist_ok=True)
    online = live._live_online()
    t0 = time.monotonic()
    online.build_model()
    print(f"model built in {time.monotonic() - t0:.0f} s", flush=True)
    def port(i: int) -> int:
        return 30400 + 100 * i

    def boot(i: int) -> srv.Server:
        return srv.start(f"e{i}", os.path.join(online.MODEL, "base"), port(i), OUT, patched=True,
                         max_lora_rank=64, mem_fraction=0.26, target_modules=online.ALL_LINEAR, decode_graphs=True,
                         max_loras=MAX_LORAS, env=engine_env(LorapubConfig()))

    # elastic.py starts now, beside the boots: building its three 264 MB versions took it 95 s live, in a
    # run whose budget the boots already spent; it waits for READY before its first request
    ready = os.path.join(OUT, "servers-ready")
    if os.path.exists(ready):
        os.remove(ready)
    urls = [f"http://127.0.0.1:{port(i)}" for i in range(3)]  # srv.Server.url of each, before it exists
    cmd = [sys.executable, os.path.join(HERE, "elastic.py"), *(a for u in urls for a in ("--engine-url", u)),
           "--adapter", os.path.join(online.MODEL, "B"), "--transport", "http", "--capacity", str(MAX_LORAS - 2),
           "--max-new-tokens", "64", "--phase-s", "40", "--json", os.path.join(OUT, "elastic.json"),
           "--start-after", ready, *shlex.split(os.environ.get("LIVE_RELAX_ELASTIC_ARGS", ""))]
    print("$", " ".join(cmd[1:]), flush=True)
    run = subprocess.Popen(cmd)
    deadline = os.environ.get("LIVE_RELAX_DEADLINE")
    # One at a time: each server sizes its KV pool from the memory free when it starts, and three booting
    # at once on an 80 GB card each saw the others' weights as its own (no memory left for the KV cache).
    # The third boots while the first two serve, as an engine added to a running fleet does: elastic.py
    # lets it join once it answers /health (booting all three first left elastic.py 40 s of a 450 s run).
    engines: list[srv.Server] = []
    try:
        for i in range(2):
            engines.append(boot(i))
            await srv.wait_healthy(engines)
        warm = await srv.warm_up(engines, os.path.join(online.MODEL, "A"))
        engines.append(boot(2))
        print(f"e0, e1 up {[round(s.boot_s) for s in engines[:2]]} s, warm-up {warm}; e2 booting", flush=True)
        assert [s.url for s in engines] == urls, [s.url for s in engines]
        with open(ready, "w") as f:
            f.write(str(time.time()))
        timeout = float(deadline) - time.time() - 30 if deadline else None
        try:
            return run.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"elastic.py ran out of time ({timeout:.0f} s after the servers were up) and was stopped", flush=True)
            return 124
    finally:
        if run.poll() is None:
            run.terminate()
            try:
                run.wait(20)
            except subprocess.TimeoutExpired:
                run.kill()
        srv.stop(engines)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
