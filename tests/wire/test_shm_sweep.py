"""Shared-memory bucket files of a publisher that was killed are removed by the next one on the host.

Each :class:`~lorapub.adapters.sglang_wire.ShmBucketSource` holds an exclusive ``flock`` on an owner
file (``lorapub-<id>.owner``) beside its bucket files while it has any; the kernel drops the lock when
the process ends, however it ends. A new source sweeps the folder: the files of owners whose lock it
can take go, a live owner's files (another process's or this one's) stay, and bucket files with no
owner file go only once they are an hour old. The tests use a temporary folder, never /dev/shm.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import lorapub
from lorapub.adapters.transports import same_host as sw
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.testing.fixtures import lora_snapshot
from lorapub.wire.routes import SHM_NAME

TOKEN = AttemptToken(VersionKey(1, "v1"), 1)
SRC = os.path.dirname(os.path.dirname(lorapub.__file__))
# A publisher that writes its first bucket (and the next ones, ahead) into the folder, says how many, and waits.
PUBLISHER = textwrap.dedent("""
    import asyncio, sys, time
    from lorapub.adapters.sglang_wire import ShmBucketSource
    from lorapub.adapters.transports.same_host import WRITE_AHEAD
    from lorapub.testing.fixtures import lora_snapshot

    async def main():
        snap = lora_snapshot(1)
        plan = snap.plan(4 << 10)
        source = ShmBucketSource(snap, plan, sys.argv[1])
        await source.send(None, 0, ("e0",))
        expected = min(1 + WRITE_AHEAD, len(plan.buckets))
        while len(source.files) < expected:
            await asyncio.sleep(0.01)
        print("written", expected, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def source(shm) -> sw.ShmBucketSource:
    snap = lora_snapshot(2)
    return sw.ShmBucketSource(snap, snap.plan(4 << 10), str(shm))


def swept(shm) -> sw.ShmBucketSource:
    """A new source made on the host: its sweep of the folder has run when this returns."""
    made = source(shm)
    made.sweeping.join(10)
    assert not made.sweeping.is_alive()
    return made


def publisher(shm) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(shm)], stdout=subprocess.PIPE, env=env, text=True)
    told = child.stdout.readline().split()
    assert told[:1] == ["written"], "the publisher never wrote its buckets"
    child.written = int(told[1])  # type: ignore[attr-defined]
    return child


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    child.stdout.close()


def names(shm) -> list[str]:
    return sorted(os.listdir(shm))


def lorapub_files(shm) -> tuple[list[str], list[str]]:
    listed = names(shm)
    return [n for n in listed if n.endswith(".owner")], [n for n in listed if n.endswith(".bucket")]


@pytest.fixture
def shm(tmp_path):
    folder = tmp_path / "shm"
    folder.mkdir()
    return folder


def test_a_sigkilled_publishers_bucket_files_are_removed_by_the_next_source(shm):
    child = publisher(shm)
    owners, buckets = lorapub_files(shm)
    # the bucket being read and those written ahead
    assert len(owners) == 1 and len(buckets) == child.written >= min(2, 1 + sw.WRITE_AHEAD)
    assert all(SHM_NAME.fullmatch(n) for n in buckets)  # names the engine accepts
    assert all(n.startswith(owners[0][: -len(".owner")] + "-b") for n in buckets)
    (shm / "unrelated.bin").write_bytes(b"x")
    kill(child)  # no finalizer, no atexit: the kernel only drops the owner's lock
    assert lorapub_files(shm) == (owners, buckets)
    swept(shm)
    assert names(shm) == ["unrelated.bin"]


def test_a_live_publishers_files_survive_every_sweep_and_go_once_it_is_killed(shm):
    child = publisher(shm)
    try:
        before = names(shm)
        swept(shm)
        assert sw.sweep_shm(str(shm)) == []
        assert names(shm) == before
    finally:
        kill(child)
    assert sorted(sw.sweep_shm(str(shm))) == before
    assert names(shm) == []


async def test_a_live_source_of_this_process_keeps_its_files_and_its_owner_file_goes_with_the_last(shm):
    live = source(shm)
    await live.send(TOKEN, 0, ("e0",))
    while len(live.files) < min(1 + sw.WRITE_AHEAD, len(live.plan.buckets)):  # the writes ahead ended
        await asyncio.sleep(0.01)
    before = names(shm)
    assert sum(n.endswith(".owner") for n in before) == 1
    sw.LIVE_OWNERS.clear()  # as if this process's own lock were all a sweep could go by
    try:
        swept(shm)
        assert names(shm) == before
    finally:
        sw.LIVE_OWNERS.update(str(shm / n) for n in before if n.endswith(".owner"))
    live.close()  # the last bucket file goes, then the owner file
    assert names(shm) == []


def test_bucket_files_with_no_owner_file_go_only_once_an_hour_old(shm):
    old = f"lorapub-{uuid.uuid4().hex}-b0.bucket"  # an earlier lorapub's naming: no owner file
    young = f"lorapub-{uuid.uuid4().hex}-b3.bucket"
    for name in (old, young, "lorapub-notes.txt"):
        (shm / name).write_bytes(b"x" * 16)
    hour_ago = time.time() - sw.SHM_STALE_S - 60
    os.utime(shm / old, (hour_ago, hour_ago))
    os.utime(shm / "lorapub-notes.txt", (hour_ago, hour_ago))
    swept(shm)
    assert names(shm) == sorted([young, "lorapub-notes.txt"])


def test_an_owner_file_being_made_or_of_another_kernel_is_left_alone(shm):
    making, elsewhere, crashed = (uuid.uuid4().hex for _ in range(3))
    (shm / f"lorapub-{making}.owner").write_bytes(b"")  # created, not yet locked and tagged
    (shm / f"lorapub-{elsewhere}.owner").write_text("lorapub-shm-owner v1\nboot another-machine\npid 1\n")
    (shm / f"lorapub-{crashed}.owner").write_bytes(b"")  # its owner died between create and lock
    hour_ago = time.time() - sw.SHM_STALE_S - 60
    os.utime(shm / f"lorapub-{crashed}.owner", (hour_ago, hour_ago))
    for owner in (making, elsewhere, crashed):
        (shm / f"lorapub-{owner}-b0.bucket").write_bytes(b"x")
    swept(shm)
    assert names(shm) == sorted(f"lorapub-{o}{s}" for o in (making, elsewhere) for s in (".owner", "-b0.bucket"))


async def test_a_source_closed_while_it_writes_ahead_leaves_no_file(shm):
    live = source(shm)
    assert len(live.plan.buckets) > 2
    write = live._write
    live._write = lambda i: (time.sleep(0.2) if i else None, write(i))[1]  # a slow write ahead
    await live.send(TOKEN, 0, ("e0",))  # bucket 0 written; bucket 1 being written ahead on a thread
    live.close()
    await asyncio.sleep(0.3)  # the write ahead has ended
    for _ in range(500):  # ... and its file goes (from a thread)
        if not names(shm):
            break
        await asyncio.sleep(0.01)
    assert names(shm) == []
