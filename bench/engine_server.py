#!/usr/bin/env python3
"""One SGLang contract double (``lorapub.testing.SGLangDouble``) in a process of its own.

    python3 bench/engine_server.py NAME [--shm-dir DIR] [--decode-delay S] [--load-delay S]
                                        [--prefill-per-token S] [--blocking-load]
                                        [--install-stop S] [--first-use-stop S]

bench/run.py starts one per engine and per run, so an engine's event loop, CPU and garbage
collector are not the workload's (nor the other engine's). It prints ``URL <base url>`` once
it serves on loopback, then serves until its standard input closes. A line ``events`` on its
standard input is answered on its standard output with ``EVENTS {"pause": n, ...}``: how many
of each kind of the double's ``events`` it has recorded so far (pause, flush, continue, load,
unload, abort_request...), so a benchmark counts what reached the engine from the engine itself. The process lives for
one run: once it serves, its start-up objects are frozen out of the collector and the
collector is off (``gc.freeze()``, ``gc.disable()``), so no collection pause lands in the
engine's timings.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from lorapub.core.identity import MANAGED_PREFIX  # noqa: E402
from lorapub.testing import SGLangDouble  # noqa: E402


async def serve(args: argparse.Namespace) -> None:
    double = SGLangDouble(
        args.name, decode_delay=args.decode_delay, load_delay=args.load_delay,
        prefill_per_token=args.prefill_per_token, blocking_load=args.blocking_load,
        install_stop=args.install_stop, first_use_stop=args.first_use_stop,
        max_loaded_loras=args.max_loras, max_loras_per_batch=args.max_loras, managed_prefix=args.managed_prefix,
    )
    double.shm_dir = args.shm_dir  # its LORAPUB_SHM_DIR (None: that variable, else /dev/shm)
    await double.start()
    gc.collect()
    gc.freeze()
    gc.disable()
    print(f"URL {double.url}", flush=True)
    while True:  # until the benchmark closes our stdin (or dies)
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        if line.strip() == "events":
            print("EVENTS " + json.dumps(collections.Counter(kind for kind, _ in double.events)), flush=True)
    await double.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--shm-dir", help="the folder bucket files are read from (a shared-folder transport's)")
    parser.add_argument("--decode-delay", type=float, default=0.002)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--prefill-per-token", type=float, default=0.0)
    parser.add_argument("--blocking-load", action="store_true")
    parser.add_argument("--install-stop", type=float, default=0.0)
    parser.add_argument("--first-use-stop", type=float, default=0.0)
    parser.add_argument("--max-loras", type=int, default=3, help="SGLang's --max-loaded-loras and --max-loras-per-batch")
    parser.add_argument("--managed-prefix", default=MANAGED_PREFIX,
                        help="the adapter names its patch protects (SGLANG_LORAPUB_MANAGED_PREFIX)")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
