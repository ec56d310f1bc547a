"""Harness: the real SGLang router binary on loopback, in front of two SGLangDouble servers.

Every router is started in a session (process group) of its own, dies with the test
process (PR_SET_PDEATHSIG) and is killed at fixture teardown and at interpreter exit,
whatever the test did.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp

from lorapub.adapters.sglang_router import router_command
from lorapub.testing import SGLangDouble

START_TIMEOUT = 30.0


class RecordingDouble(SGLangDouble):
    """An SGLangDouble that remembers every /generate body it received (as the router sent it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: list[dict] = []

    async def h_generate(self, request):
        self.received.append(await request.json())
        return await super().h_generate(request)

    def lora_paths(self) -> list:
        return [b.get("lora_path") for b in self.received]

    def rids(self) -> list:
        return [b.get("rid") for b in self.received if b.get("rid")]

    def lora_id(self, name: str) -> str | None:
        ref = self.lora_registry.get_all_adapters().get(name)
        return None if ref is None else ref.lora_id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the test process dies
    except OSError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


class RouterProcess:
    def __init__(self, worker_urls: list[str], log_path: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_urls = list(worker_urls)
        self.log_path = log_path
        self.argv = router_command(
            self.worker_urls,
            port=self.port,
            python=sys.executable,
            extra=(
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--health-check-interval-secs", "1",
                "--shutdown-grace-period-secs", "1",
                "--worker-startup-timeout-secs", "10",
                "--log-level", "warn",
                *extra,
            ),
        )
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    async def start(self) -> "RouterProcess":
        t0 = time.monotonic()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )
        log.close()
        atexit.register(_kill_group, self.proc)
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() - t0 > START_TIMEOUT:
                    self.stop()
                    raise RuntimeError(f"router not ready after {START_TIMEOUT}s:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
                    async with http.get(self.url + "/workers", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        body = await r.json()
                        healthy = {w["url"] for w in body["workers"] if w.get("is_healthy")}
                        if healthy >= set(self.worker_urls):
                            self.startup_s = time.monotonic() - t0
                            return self
                await asyncio.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)


def served_by(doubles: dict, reply: dict) -> RecordingDouble:
    """The double whose engine-local lora_id is in the reply (lora_ids are unique per load)."""
    lora_id = reply["meta_info"]["lora_id"]
    found = [d for d in doubles.values() if lora_id is not None and lora_id in d.loaded]
    assert len(found) == 1, f"lora_id {lora_id} is loaded on {[d.name for d in found]}"
    return found[0]




async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)
