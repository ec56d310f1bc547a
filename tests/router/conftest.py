"""Fixtures: the real SGLang router on loopback in front of two recording SGLangDouble servers.

The router tests are skipped only where the ``sglang-router`` wheel cannot be had; under CI
(which installs it) its absence is an error.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os

import pytest

from lorapub.adapters.sglang_router import RouterRouting, SGLangRouter, WorkerWatcher, reconcile_heal
from lorapub.errors import EngineError
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.runner import Deadlines
from tests.router.harness import RecordingDouble, RouterProcess


def _router_missing() -> str | None:
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed (pip install 'lorapub[router]'; .ci/install does)"
    try:
        import sglang_router.launch_router  # noqa: F401  (the launcher and the Rust extension it loads)
    except Exception as e:  # noqa: BLE001
        return f"the sglang-router launcher cannot be imported: {type(e).__name__}: {e}"
    return None


MISSING = _router_missing()


class _DropGrpcProbes(logging.Filter):
    """The router probes every worker for gRPC too (an HTTP/2 preface the aiohttp doubles refuse): not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


logging.getLogger("aiohttp.server").addFilter(_DropGrpcProbes())


def pytest_collection_modifyitems(config, items):
    if MISSING is None:
        return
    if os.environ.get("CI"):  # CI installs the router: there its absence is a failure, not a skip
        raise pytest.UsageError(f"tests/router cannot run in CI: {MISSING}")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=MISSING))

@pytest.fixture
async def doubles():
    pair = [await RecordingDouble("e0").start(), await RecordingDouble("e1").start()]
    yield {d.name: d for d in pair}
    for d in pair:
        await d.stop()


@pytest.fixture
async def router_process(doubles, tmp_path):
    proc = await RouterProcess([d.url for d in doubles.values()], str(tmp_path / "router.log")).start()
    try:
        yield proc
    finally:
        proc.stop()
    assert proc.proc.poll() is not None, "the router outlived its fixture"


@pytest.fixture
async def router(router_process):
    client = SGLangRouter(router_process.url)
    yield client
    await client.close()


class Fleet:
    """A Deployment whose sessions generate through the router, with a WorkerWatcher."""

    def __init__(self, deployment, watcher, router, doubles) -> None:
        self.deployment, self.watcher, self.router, self.doubles = deployment, watcher, router, doubles
        self._reconcile = reconcile_heal(deployment)  # the wiring a deployment uses
        self.heal_calls: list[str] = []
        self.heal_gate: asyncio.Event = asyncio.Event()
        self.heal_gate.set()
        self.heal_started: asyncio.Event = asyncio.Event()
        self.heal_failures = 0  # the next n heals raise

    async def heal(self, name: str) -> None:
        self.heal_calls.append(name)
        self.heal_started.set()
        await self.heal_gate.wait()
        if self.heal_failures:
            self.heal_failures -= 1
            raise EngineError(f"{name}: re-provisioning failed (injected)")
        await self._reconcile(name)

    def events(self, kind, name: str | None = None) -> list:
        return [e for e in self.watcher.events if isinstance(e, kind) and (name is None or e.name == name)]


# Bounded, with room for a loaded CI machine (a passed deadline is an unknown outcome, not a retry).
DEADLINES = Deadlines(begin=15, bucket=15, end=15, cleanup=15, commit=5, reclaim=30)


@pytest.fixture
async def fleet(doubles, router, tmp_path):
    holder: dict = {}

    async def heal(name: str) -> None:
        await holder["fleet"].heal(name)

    watcher = WorkerWatcher(
        router, heal=heal,  # the workers stage every version's bytes themselves
        names={d.url: d.name for d in doubles.values()}, interval=0.05, backoff=0.05, max_backoff=0.2,
    )
    engines = await watcher.discover()
    assert set(engines) == set(doubles)
    from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine

    assert all(type(e) is SGLangWireEngine for e in engines.values())
    deployment = await Deployment(
        engines, epoch=1, deadlines=DEADLINES, bucket_cap_bytes=8 << 10, transport=HTTPBytes(),
        reconcile_interval=0.5, router=RouterRouting(router),
    ).start()
    assert all(e.transport is deployment.transport for e in engines.values())  # one deployment, one transport
    fleet = holder["fleet"] = Fleet(deployment, watcher, router, doubles)
    try:
        yield fleet
    finally:
        await deployment.settle()
        await deployment.close()
        await watcher.close()
