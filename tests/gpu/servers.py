"""Start and stop live SGLang servers for the acceptance run (one GPU, several processes).

Each server runs ``python -m lorapub.sglang_patch launch`` (lorapub's runtime patch) or,
with ``patched=False``, the same launcher with ``LORAPUB_SGLANG_PATCH=observe``: stock
SGLang plus the read-only ``/lorapub/state`` route, so its native refs can be read.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import attrs


@attrs.define
class Server:
    name: str
    port: int
    patched: bool
    log_path: str
    proc: subprocess.Popen | None = None
    boot_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def unload_events(self, lora_name: str) -> int:
        """Physical unloads the scheduler logged for ``lora_name``."""
        named = re.compile(rf"lora_name='?{re.escape(lora_name)}'?[,)]")
        return sum(1 for line in self.log().splitlines() if "LoRA adapter unloading starts" in line and named.search(line))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def server_args(model: str, port: int, *, max_lora_rank: int, context_length: int, mem_fraction: float,
                target_modules: tuple[str, ...] = ATTENTION_MODULES, decode_graphs: bool = False,
                max_loras: int = 3) -> list[str]:
    """``max_loras``: SGLang's --max-loras-per-batch and --max-loaded-loras (lorapub pins at most one
    fewer: capacity N needs N + 1)."""
    graphs = [] if decode_graphs else ["--cuda-graph-backend-decode", "disabled"]
    return [
        "--model-path", model, "--enable-lora", "--max-loras-per-batch", str(max_loras),
        "--max-loaded-loras", str(max_loras),
        "--lora-target-modules", *target_modules, "--max-lora-rank", str(max_lora_rank),
        "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--grammar-backend", "none", "--dtype", "bfloat16", "--context-length", str(context_length),
        "--max-total-tokens", "131072", "--mem-fraction-static", str(mem_fraction), "--random-seed", "0",
        *graphs, "--cuda-graph-backend-prefill", "disabled",
        # lorapub's warm_up() below replaces SGLang's own warm-up request, which a short
        # SGLANG_REQ_RUNNING_TIMEOUT would kill while Triton compiles its first kernels.
        "--skip-server-warmup",
        "--host", "127.0.0.1", "--port", str(port),
    ]


def start(name: str, model: str, port: int, out_dir: str, *, patched: bool, env: dict | None = None,
          max_lora_rank: int = 8, context_length: int = 8192, mem_fraction: float = 0.2,
          target_modules: tuple[str, ...] = ATTENTION_MODULES, decode_graphs: bool = False,
          max_loras: int = 3) -> Server:
    log_path = os.path.join(out_dir, f"server-{name}.log")
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONUNBUFFERED"] = "1"
    if not patched:
        environ["LORAPUB_SGLANG_PATCH"] = "observe"
    cmd = [sys.executable, "-m", "lorapub.sglang_patch", "launch",
           *server_args(model, port, max_lora_rank=max_lora_rank, context_length=context_length, mem_fraction=mem_fraction,
                        target_modules=target_modules, decode_graphs=decode_graphs, max_loras=max_loras)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
    return Server(name, port, patched, log_path, proc)


async def wait_healthy(servers: list[Server], timeout: float = 420.0) -> None:
    started = time.monotonic()
    pending = list(servers)
    async with aiohttp.ClientSession() as http:
        while pending:
            for s in list(pending):
                if not s.alive():
                    raise RuntimeError(f"server {s.name} exited with {s.proc.returncode}:\n{s.log()[-3000:]}")
                try:
                    async with http.get(s.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            s.boot_s = time.monotonic() - started
                            pending.remove(s)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"servers not healthy after {timeout:.0f}s: {[s.name for s in pending]}")
            await asyncio.sleep(1.0)


async def warm_up(servers: list[Server], adapter_dir: str, timeout: float = 300.0) -> dict[str, float]:
    """Compile the kernels before anything is measured: base requests until one succeeds, then a
    batch of LoRA requests of mixed lengths (a request that hits the running timeout is retried)."""
    started = time.monotonic()

    async def one(http: aiohttp.ClientSession, s: Server) -> float:
        async def generate(ids: list[int], lora: str | None, max_new: int) -> int:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
            if lora:
                body["lora_path"] = lora
            try:
                async with http.post(s.url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
                    await r.read()
                    return r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return 0

        t0 = time.monotonic()
        while await generate(list(range(1, 17)), None, 8) != 200:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{s.name}: no successful warm-up request in {timeout:.0f}s")
        async with http.post(s.url + "/load_lora_adapter",
                             json={"lora_name": "lorapub-warmup", "lora_path": adapter_dir, "pinned": False}) as r:
            assert r.status == 200, await r.text()
        # token ids stay inside the fixture's vocabulary (an id past it is a CUDA assert that kills the server)
        shapes = [([i % 1000 + 1 for i in range(n)], 16) for n in (8, 32, 96, 200, 300, 500, 1000, 2000)] * 2
        while True:
            statuses = await asyncio.gather(*(generate(ids, "lorapub-warmup" if i % 2 else None, m)
                                              for i, (ids, m) in enumerate(shapes)))
            if all(x == 200 for x in statuses):
                break
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{s.name}: warm-up batch kept failing: {statuses}")
        async with http.post(s.url + "/unload_lora_adapter", json={"lora_name": "lorapub-warmup"}) as r:
            assert r.status == 200, await r.text()
        return time.monotonic() - t0

    async with aiohttp.ClientSession() as http:
        took = await asyncio.gather(*(one(http, s) for s in servers))
    return {s.name: round(t, 1) for s, t in zip(servers, took)}


def stop(servers: list[Server]) -> None:
    for s in servers:
        if s.alive():
            try:
                os.killpg(s.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 20
    for s in servers:
        if s.proc is None:
            continue
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
