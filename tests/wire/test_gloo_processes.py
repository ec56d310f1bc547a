"""torch.distributed (gloo) end to end across processes: the publisher (rank 0) in this process, two
engines (contract doubles running lorapub's engine-side staging) in processes of their own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import pytest

from lorapub.adapters.sglang_wire import SGLangWireEngine, TorchDistributed
from lorapub.core.version import VersionState
from lorapub.errors import PublicationBlocked, PublicationFailed
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.runner import Deadlines
from lorapub.testing.fixtures import lora_snapshot

pytest.importorskip("torch")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}}
TIMEOUT = 30.0  # the transport's bound on every wait; a failure must end far sooner
DEADLINES = Deadlines(begin=10, bucket=40, end=10, cleanup=40, commit=5, reclaim=20)


class EngineProcess:
    def __init__(self, name: str, stash: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
        self.proc = subprocess.Popen([sys.executable, "-m", "lorapub.testing.serve_double", name, stash],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=env, text=True)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "URL", line
        self.url, self.control = line[1], line[2]

    async def inject(self, op: str, mode: str = "error", **kw) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(self.control + "/inject", json={"op": op, "mode": mode, **kw}) as r:
                assert r.status == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
async def cluster(tmp_path):
    procs = {name: EngineProcess(name, str(tmp_path / f"{name}-disk")) for name in ("e0", "e1")}
    transport = TorchDistributed(backend="gloo", timeout=TIMEOUT)
    engines = {n: SGLangWireEngine(n, p.url, probe_timeout=20) for n, p in procs.items()}
    dep = await Deployment(engines, epoch=1, deadlines=DEADLINES, bucket_cap_bytes=16 << 10, transport=transport).start()
    try:
        yield dep, procs, engines
    finally:
        await dep.settle()
        await dep.close()
        for e in engines.values():
            await e.close()
        for p in procs.values():
            p.stop()


async def test_publish_over_gloo_across_processes_serves_and_reclaims(cluster):
    dep, procs, engines = cluster
    snapshot = lora_snapshot(1, layers=4, hidden=64, rank=8)
    buckets = len(snapshot.plan(16 << 10).buckets)
    a = await dep.publish(snapshot, "A")
    for e in engines.values():
        state = await e.state()
        assert state["adapters"][a.lora_name]["pinned"]
        assert state["staging"]["collectives"] == buckets and state["staging"]["bytes"] == 0
    session = dep.session("s")
    first = await session.generate(GEN)
    await dep.publish(lora_snapshot(2, layers=4, hidden=64, rank=8), "B")
    assert (await session.generate(GEN))["output_ids"] == first["output_ids"]
    await session.close()
    await dep.settle()
    assert (await dep.state()).versions[a.version].state is VersionState.RECLAIMED
    for e in engines.values():
        state = await e.state()
        assert a.lora_name not in state["adapters"]
        assert all(x["lora_name"] != a.lora_name for x in state["staging"]["attempts"].values())
        assert state["staging"]["collectives"] == 2 * buckets  # one broadcast per bucket, never a second


async def test_a_rank_that_refuses_fails_the_attempt_on_every_party_at_once(cluster):
    dep, procs, engines = cluster
    await procs["e1"].inject("bucket", "error", status=500)  # e1 never joins the group
    started = time.monotonic()
    with pytest.raises(PublicationFailed):
        await dep.publish(lora_snapshot(3, layers=4, hidden=64, rank=8), "C")
    assert time.monotonic() - started < TIMEOUT / 3  # nobody waited for the rank that will not come
    for e in engines.values():
        staging = (await e.state())["staging"]
        assert staging["attempts"] == {} and staging["bytes"] == 0 and staging["tombstones"] == 1
    assert (await dep.publish(lora_snapshot(3, layers=4, hidden=64, rank=8), "C")).receipt is not None


async def test_a_rank_that_dies_mid_transfer_leaves_no_party_waiting(cluster):
    dep, procs, engines = cluster
    await dep.publish(lora_snapshot(4, layers=4, hidden=64, rank=8), "D")
    await procs["e1"].inject("bucket", "slow", delay=60.0)  # e1 stalls before its first bucket ...
    publishing = asyncio.create_task(dep.publish(lora_snapshot(5, layers=4, hidden=64, rank=8), "E"))
    await asyncio.sleep(1.0)
    procs["e1"].proc.kill()  # ... and dies there
    started = time.monotonic()
    with pytest.raises((PublicationFailed, PublicationBlocked)):
        await publishing
    assert time.monotonic() - started < TIMEOUT / 3
    staging = (await engines["e0"].state())["staging"]  # the surviving engine holds nothing of E
    assert all(not x["lora_name"].startswith("relax_policy_lora@1-E") for x in staging["attempts"].values())
