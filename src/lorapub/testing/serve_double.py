"""A contract double (with lorapub's engine-side staging) in a process of its own, for tests and
benchmarks that need the engine outside the publisher's process:
``python -m lorapub.testing.serve_double NAME STASH_DIR [SHM_DIR] [--max-loras-per-batch N]
[--max-loaded-loras N]``, with a control server beside it.
See docs/testing.md, "A double in a process of its own: `lorapub.testing.serve_double`".
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import mmap
import os
import sys
from typing import Any

from aiohttp import web

from lorapub.testing.sglang_double import SGLangDouble

__all__ = ["main"]


def _gloo_sink(body: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    span = datetime.timedelta(seconds=float(body.get("timeout", 60)))
    # torch's stubs: torch.distributed re-exports TCPStore and PrefixStore from its C extension without
    # declaring them, and give the Gloo group no broadcast (it has one)
    store = dist.TCPStore(body["host"], int(body["port"]), None, False, timeout=span)  # type: ignore[attr-defined]
    prefixed = dist.PrefixStore(body.get("prefix", "raw"), store)  # type: ignore[attr-defined]
    pg = dist.ProcessGroupGloo(prefixed, int(body["rank"]), int(body["world_size"]), span)
    total = 0
    for size in body["sizes"]:
        t = torch.empty(int(size), dtype=torch.uint8)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        pg.broadcast([t], opts).wait()  # type: ignore[attr-defined]
        total += t.numel()
    return total


async def main(name: str, stash: str, shm: str | None, *, max_loras_per_batch: int | None = None,
               max_loaded_loras: int | None = None) -> None:
    try:  # an SGLang server has torch loaded before its first publication; so does this engine
        import torch  # noqa: F401
    except ImportError:
        pass
    double = SGLangDouble(name, decode_delay=0.001, max_loras_per_batch=max_loras_per_batch,
                          max_loaded_loras=max_loaded_loras)
    double.stash_root, double.shm_dir = stash, shm
    await double.start()

    async def inject(request: web.Request) -> web.Response:
        body = await request.json()
        double.inject(body["op"], body.get("mode", "error"), delay=body.get("delay", 0.0), status=body.get("status", 500))
        return web.json_response({"ok": True})

    async def sink_http(request: web.Request) -> web.Response:
        view, got = memoryview(bytearray(request.content_length or 0)), 0
        async for chunk in request.content.iter_chunked(1 << 20):
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        return web.json_response({"bytes": got})

    def shm_read(path: str) -> int:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                memoryview(buf)[:] = m
        return size

    async def sink_shm(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"bytes": await asyncio.to_thread(shm_read, body["path"])})

    async def sink_gloo(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"bytes": await asyncio.to_thread(_gloo_sink, body)})

    app = web.Application(client_max_size=1 << 40)
    app.router.add_post("/inject", inject)
    app.router.add_post("/sink/http", sink_http)
    app.router.add_post("/sink/shm", sink_shm)
    app.router.add_post("/sink/gloo", sink_gloo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    control = f"http://127.0.0.1:{runner.addresses[0][1]}"  # the port the OS chose (asyncio's server or uvloop's)
    print(f"URL {double.url} {control}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await runner.cleanup()
    await double.stop()


def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lorapub.testing.serve_double",
                                description="An SGLang contract double in a process of its own.")
    p.add_argument("name", help="the engine's name")
    p.add_argument("stash", metavar="STASH_DIR", help="the engine's own disk, where it stages adapters")
    p.add_argument("shm", metavar="SHM_DIR", nargs="?", help="where it reads shared-memory buckets")
    p.add_argument("--max-loras-per-batch", type=int, default=None,
                   help="SGLang's --max-loras-per-batch (default 8, as SGLang's)")
    p.add_argument("--max-loaded-loras", type=int, default=None,
                   help="SGLang's --max-loaded-loras (default unset: no limit, as SGLang's)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = _arguments()
    asyncio.run(main(args.name, args.stash, args.shm, max_loras_per_batch=args.max_loras_per_batch,
                     max_loaded_loras=args.max_loaded_loras))
