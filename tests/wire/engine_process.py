"""One contract double (with lorapub's engine-side staging) in a process of its own, for the
cross-process transport tests and the transport benchmark.

    python -m tests.wire.engine_process NAME STASH_DIR [SHM_DIR]

prints ``URL <url>`` once serving and runs until its standard input closes. ``POST /test/inject``
(this script only) injects a fault into the double: ``{"op", "mode", "delay", "status"}``.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

from lorapub.testing import SGLangDouble


async def main(name: str, stash: str, shm: str | None) -> None:
    double = SGLangDouble(name, decode_delay=0.001)
    double.stash_root, double.shm_dir = stash, shm
    await double.start()

    async def inject(request: web.Request) -> web.Response:
        body = await request.json()
        double.inject(body["op"], body.get("mode", "error"), delay=body.get("delay", 0.0), status=body.get("status", 500))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/test/inject", inject)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    control = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    print(f"URL {double.url} {control}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await runner.cleanup()
    await double.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None))
