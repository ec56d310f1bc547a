"""Same-host transports without a second copy and without blocking the caller's loop.

Each bucket is written once into a shared-memory segment, both engines map that one segment
(a tensor load hands SGLang the publisher's pages: no engine-side copy), and a segment goes on
every path: the end, a failed publication, a cancelled one, a write that cannot finish. The
caller's loop never writes, unlinks or starts a store: counted by the thread each call ran on,
never by wall time.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time

import pytest

from lorapub.adapters.sglang_wire import SameHostIPC, SGLangWireEngine, TorchDistributed
from lorapub.adapters.transports import same_host
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.publisher import PublicationFailed
from lorapub.sglang_patch.staging import buffers, landing, receivers
from lorapub.testing import SGLangDouble
from lorapub.testing.fixtures import lora_snapshot
from tests.e2e.conftest import FAST

CAP = 8 << 10  # several buckets per adapter


class Calls:
    """Where (which thread) each call of a wrapped function ran, and with what."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.args: list[tuple] = []

    def wrap(self, fn):
        def wrapped(*args, **kw):
            self.threads.append(threading.current_thread())
            self.args.append(args)
            return fn(*args, **kw)

        return wrapped

    def on(self, thread: threading.Thread) -> int:
        return sum(t is thread for t in self.threads)


@pytest.fixture
async def pair(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    doubles = []
    for name in ("e0", "e1"):
        d = SGLangDouble(name)
        d.stash_root, d.shm_dir = str(tmp_path / f"{name}-disk"), str(shm)
        doubles.append(await d.start())
    made = []

    async def deployment(transport):
        engines = {d.name: SGLangWireEngine(d.name, d.url, probe_timeout=10) for d in doubles}
        dep = await Deployment(engines, epoch=1, deadlines=FAST, bucket_cap_bytes=CAP, transport=transport).start()
        made.append((dep, engines))
        return dep

    yield deployment, shm, doubles
    for dep, engines in made:
        await dep.settle()
        await dep.close()
        for e in engines.values():
            await e.close()
    for d in doubles:
        await d.stop()


async def no_files(folder, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while list(folder.iterdir()):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_each_bucket_is_written_once_and_both_engines_map_that_one_segment(pair, monkeypatch):
    deployment, shm, _ = pair
    writes, opened, shared, copied = Calls(), Calls(), Calls(), Calls()
    monkeypatch.setattr(same_host.ShmBucketSource, "_write", writes.wrap(same_host.ShmBucketSource._write))

    def from_shm(stash, bucket, control, shm_dir):
        opened.args.append((bucket.index, control["name"], os.stat(os.path.join(shm_dir, control["name"])).st_ino))
        return real_from_shm(stash, bucket, control, shm_dir)

    real_from_shm = receivers.from_shm
    monkeypatch.setattr(receivers, "from_shm", from_shm)
    monkeypatch.setattr(buffers.Buffer, "shared_file", classmethod(shared.wrap(buffers.Buffer.shared_file.__func__)))
    monkeypatch.setattr(landing, "landing", copied.wrap(landing.landing))
    dep = await deployment(SameHostIPC(shm_dir=str(shm)))
    await dep.publish(lora_snapshot(1), "A")
    buckets = len(lora_snapshot(1).plan(CAP).buckets)
    assert buckets > 1 and len(writes.args) == buckets  # one write per bucket, whatever the engines
    by_bucket: dict[int, set] = {}
    for index, name, inode in opened.args:
        by_bucket.setdefault(index, set()).add((name, inode))
    assert len(opened.args) == 2 * buckets  # both engines read every bucket ...
    assert all(len(found) == 1 for found in by_bucket.values())  # ... from the one segment written for it
    assert len(shared.args) == 2 * buckets and copied.args == []  # mapped as SGLang's tensors, never copied
    assert await no_files(shm)


async def test_a_cancelled_publication_leaves_no_segment_and_never_unlinks_on_the_loop(pair, monkeypatch):
    deployment, shm, _ = pair
    loop_thread = threading.current_thread()
    unlinks = Calls()
    monkeypatch.setattr(same_host.os, "unlink", unlinks.wrap(os.unlink))
    real = same_host.ShmBucketSource._write
    started = threading.Event()

    def slow(source, index):
        written = real(source, index)
        started.set()
        time.sleep(0.3)  # the publication is cancelled while its first buckets are written
        return written

    monkeypatch.setattr(same_host.ShmBucketSource, "_write", slow)
    dep = await deployment(SameHostIPC(shm_dir=str(shm)))
    task = asyncio.ensure_future(dep.publish(lora_snapshot(2), "B"))
    while not started.is_set():
        await asyncio.sleep(0.005)
    assert [n for n in os.listdir(shm) if n.endswith(".bucket")]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await no_files(shm)  # the segments being written went once written, owner file too
    assert unlinks.args and unlinks.on(loop_thread) == 0


async def test_a_segment_that_cannot_be_written_fails_the_publication_clean_and_is_removed(pair, monkeypatch):
    deployment, shm, doubles = pair

    def full(fd, views):
        os.write(fd, b"x" * 10)  # a part of it landed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(same_host, "write_views", full)
    dep = await deployment(SameHostIPC(shm_dir=str(shm)))
    with pytest.raises(PublicationFailed, match="free room there"):
        await dep.publish(lora_snapshot(3), "C")
    assert await no_files(shm)
    for d in doubles:
        assert d.staging.report()["attempts"] == {}


async def test_the_callers_loop_never_writes_nor_unlinks_a_segment(pair, monkeypatch):
    deployment, shm, _ = pair
    loop_thread = threading.current_thread()
    writes, unlinks = Calls(), Calls()
    monkeypatch.setattr(same_host.ShmBucketSource, "_write", writes.wrap(same_host.ShmBucketSource._write))
    monkeypatch.setattr(same_host.os, "unlink", unlinks.wrap(os.unlink))
    dep = await deployment(SameHostIPC(shm_dir=str(shm)))
    for i in range(2):
        await dep.publish(lora_snapshot(10 + i), f"V{i}")
    assert await no_files(shm)
    assert writes.args and writes.on(loop_thread) == 0
    assert unlinks.args and unlinks.on(loop_thread) == 0


def test_write_views_goes_on_after_a_short_write(tmp_path, monkeypatch):
    real, calls = os.writev, []

    def short(fd, views):  # the kernel may take part of what it is handed
        calls.append(len(views))
        return real(fd, [bytes(views[0])[:3]]) if len(calls) == 1 else real(fd, views)

    monkeypatch.setattr(same_host.os, "writev", short)
    parts = [memoryview(b"abcdef"), memoryview(b""), memoryview(b"ghij")]
    path = tmp_path / "seg"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        assert same_host.write_views(fd, parts) == 10
    finally:
        os.close(fd)
    assert path.read_bytes() == b"abcdefghij" and len(calls) == 2


async def test_a_torch_transport_makes_its_stores_off_the_callers_loop(pair, monkeypatch):
    import torch.distributed as dist

    deployment, _, _ = pair
    loop_thread = threading.current_thread()
    stores = Calls()
    monkeypatch.setattr(dist, "TCPStore", stores.wrap(dist.TCPStore))
    transport = TorchDistributed(timeout=10.0)
    dep = await deployment(transport)
    for i in range(2):
        await dep.publish(lora_snapshot(20 + i), f"T{i}")
    assert len(stores.args) >= 2 and stores.on(loop_thread) == 0


async def test_a_source_dropped_inside_an_executors_submit_still_removes_its_segments(tmp_path):
    """The collector may run a dropped source's finalizer inside any code, an executor's ``submit``
    holding its module-wide lock included: the finalizer hands the removal over without that lock."""
    import concurrent.futures.thread
    import gc

    snap = lora_snapshot(5)
    dropped = same_host.ShmBucketSource(snap, snap.plan(CAP), str(tmp_path))
    dropped.sweeping.join(10)
    dropped._files[0] = dropped._write(0)
    assert [n for n in os.listdir(tmp_path) if n.endswith(".bucket")]

    def drop_while_submitting():
        nonlocal dropped
        with concurrent.futures.thread._global_shutdown_lock:  # as a submit elsewhere holds it
            dropped = None
            gc.collect()

    worker = threading.Thread(target=drop_while_submitting, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "the finalizer waited for a lock its own thread holds"
    assert await no_files(tmp_path)
