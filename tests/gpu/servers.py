"""Start and stop live SGLang servers for the acceptance run (one GPU, several processes).

Each server runs ``python -m lorapub.sglang_patch launch`` (lorapub's runtime patch) or,
with ``patched=False``, the same launcher with ``LORAPUB_SGLANG_PATCH=observe``: stock
SGLang plus the read-only ``/lorapub/state`` route, so its native refs can be read.
"""

from __future__ import annotations

import asyncio
import os
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
        return sum(1 for line in self.log().splitlines()
                   if "LoRA adapter unloading starts" in line and f"lora_name='{lora_name}'" in line)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def server_args(model: str, port: int, *, max_lora_rank: int, context_length: int, mem_fraction: float) -> list[str]:
    return [
        "--model-path", model, "--enable-lora", "--max-loras-per-batch", "3", "--max-loaded-loras", "3",
        "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", "--max-lora-rank", str(max_lora_rank),
        "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--grammar-backend", "none", "--dtype", "bfloat16", "--context-length", str(context_length),
        "--max-total-tokens", "131072", "--mem-fraction-static", str(mem_fraction), "--random-seed", "0",
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--host", "127.0.0.1", "--port", str(port),
    ]


def start(name: str, model: str, port: int, out_dir: str, *, patched: bool, env: dict | None = None,
          max_lora_rank: int = 8, context_length: int = 8192, mem_fraction: float = 0.2) -> Server:
    log_path = os.path.join(out_dir, f"server-{name}.log")
    environ = dict(os.environ, **(env or {}))
    environ["PYTHONUNBUFFERED"] = "1"
    if not patched:
        environ["LORAPUB_SGLANG_PATCH"] = "observe"
    cmd = [sys.executable, "-m", "lorapub.sglang_patch", "launch",
           *server_args(model, port, max_lora_rank=max_lora_rank, context_length=context_length, mem_fraction=mem_fraction)]
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
                    async with http.get(s.url + "/health_generate", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            s.boot_s = time.monotonic() - started
                            pending.remove(s)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"servers not healthy after {timeout:.0f}s: {[s.name for s in pending]}")
            await asyncio.sleep(1.0)


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
