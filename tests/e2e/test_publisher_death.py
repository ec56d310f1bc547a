"""A publisher SIGKILLed mid-publication, with the default in-memory registry: its adapters and
staged attempts on the engines are orphans no registry holds. A new trainer (a later epoch) finds
them at start and in every reconcile pass, reclaims them once their requests end, and publishes
at full capacity; a trainer of an *older* epoch never touches them. Real child processes."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from lorapub import Deployment
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.core.identity import epoch_of_name
from lorapub.core.version import VersionState
from lorapub.runtime.runner import Deadlines
from lorapub.testing import SGLangDouble, lora_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = Deadlines(begin=2, bucket=2, end=3, cleanup=2, commit=1, reclaim=10)


async def killed_publisher(epoch: int, kill_at: str, doubles: list[SGLangDouble]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.helpers.child_publisher", str(epoch), kill_at, *(d.url for d in doubles),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert b"READY" in out and b"NOT KILLED" not in out, (out, err[-2000:])
    assert proc.returncode == -9, (proc.returncode, err[-2000:])  # SIGKILL, at the chosen step


def epochs_held(double: SGLangDouble) -> set[int]:
    return {epoch_of_name(n) for n in double.registered()}


@pytest.mark.parametrize("kill_at", ["RecordPrepared", "RecordBucketDone", "RecordReady", "Commit"])
async def test_a_killed_publishers_orphans_are_reclaimed_by_the_next_trainer(kill_at):
    doubles = [await SGLangDouble(f"e{i}").start() for i in range(2)]
    try:
        await killed_publisher(3, kill_at, doubles)
        for d in doubles:
            assert epochs_held(d) == {3}  # A (and B where it got that far), pinned, managed
        older = {d.name: SGLangWireEngine(d.name, d.url) for d in doubles}
        dep2 = await Deployment(older, epoch=2, deadlines=FAST, reconcile_interval=None).start()
        health = await dep2.reconcile()
        assert not any(b.kind == "orphan_pending" for b in health.blockers)  # a newer epoch's: untouched
        await dep2.close()
        for d in doubles:
            assert epochs_held(d) == {3}

        engines = {d.name: SGLangWireEngine(d.name, d.url) for d in doubles}
        dep = await Deployment(engines, epoch=4, deadlines=FAST, reconcile_interval=None,
                               bucket_cap_bytes=8 << 10).start()
        health = await dep.reconcile()
        for _ in range(10):
            if health.healthy:
                break
            await dep.settle(30.0)  # returns once the work is done
            health = await dep.reconcile()
        assert health.healthy, health.describe()
        for d in doubles:
            assert epochs_held(d) == set()  # every orphan unloaded
            assert not d.staging.report()["attempts"] or all(
                a["loaded"] for a in d.staging.report()["attempts"].values())  # no attempt staged for nobody
        for i in range(3):  # full capacity again: publish, publish, and a third once one retires
            report = await dep.publish(lora_snapshot(10 + i), f"v{i}")
            assert report.state is VersionState.PUBLISHED
            await dep.settle()
        await dep.close()
    finally:
        for d in doubles:
            await d.stop()


async def test_an_orphan_is_unloaded_only_once_its_running_requests_end():
    doubles = [await SGLangDouble(f"e{i}", decode_delay=0.2).start() for i in range(2)]
    try:
        await killed_publisher(3, "Commit", doubles)
        name = next(n for n in doubles[0].registered() if "-A-" in n)
        raw = SGLangWireEngine("e0", doubles[0].url)
        long = asyncio.ensure_future(raw.generate({"input_ids": [1, 2, 3], "lora_path": name,
                                                   "sampling_params": {"max_new_tokens": 8}}))
        await asyncio.sleep(0.3)
        engines = {d.name: SGLangWireEngine(d.name, d.url) for d in doubles}
        dep = await Deployment(engines, epoch=4, deadlines=FAST, reconcile_interval=None).start()
        health = await dep.reconcile(wait=0.2)
        orphan = [b for b in health.blockers if b.kind == "orphan_pending" and b.subject == f"e0:{name}"]
        assert orphan and "running request" in orphan[0].detail, health.describe()
        out = await long  # the request a dead trainer's rollout sent runs to its end
        assert out["meta_info"]["completion_tokens"] == 8
        await dep.settle(30.0)
        health = await dep.reconcile()
        assert health.healthy, health.describe()
        assert epochs_held(doubles[0]) == set()
        await dep.close()
        await raw.close()
    finally:
        for d in doubles:
            await d.stop()
