"""SameHostIPC and SharedDir: each bucket written once into a file of a folder every engine reads
(shared memory on one host, or a folder the publisher and the engines both mount)."""


import asyncio
import atexit
import concurrent.futures
import functools
import logging
import os
import queue
import re
import stat
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Iterable


from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import BucketPlan
from lorapub.errors import EngineError, InvalidInput
from lorapub.ports import BucketPost
from lorapub.snapshot import Snapshot, tensor_bytes
from lorapub.wire.codec import json_bytes
from lorapub.wire.messages import ShmControl
from lorapub.wire.collective import running_kernel

from .http_bytes import HTTPBytes

__all__ = ['IO_THREADS', 'LIVE_OWNERS', 'WRITE_AHEAD', 'SHM_BUCKET', 'SHM_OWNER', 'SHM_STALE_S', 'SameHostIPC', 'SharedDir',
    'ShmBucket', 'ShmBucketSource', 'sweep_shm', 'write_views']

logger = logging.getLogger("lorapub.adapters.sglang_wire")

# -- same-host IPC ------------------------------------------------------------------------------------
#: Buckets a source writes ahead of the one being sent: each send starts, each on its own thread, the
#: writes of its bucket and of the WRITE_AHEAD after it that are not under way yet (before 2026-12-06 the
#: next one started only once the current one was written). Live
#: (bench/results/2026-12-06-online-live-shm-parallel-checks), 3 ahead cut the transfer of 264 MB from
#: 127 to 57 ms, but the engines' checks then ran behind it (80 -> 113 ms) and that workload's stall
#: rose (+131 to +322 ms over control); with 1 the transfer took 54 ms and the checks 68 ms
#: (bench/results/2026-12-06-online-live-launch-gate).
WRITE_AHEAD = 1
#: The threads that write every source's segments in this process, made once: a send hands its
#: write to them, so the caller's loop never starts a thread per bucket (a thread's start waits for it
#: to take the GIL) and never runs a write.
IO_THREADS = WRITE_AHEAD + 2
_io: concurrent.futures.ThreadPoolExecutor | None = None
_io_lock = threading.Lock()
#: Views handed to one ``writev`` (the kernel's limit, IOV_MAX).
_IOV_MAX = 1024
#: Removals for the one remover thread. A removal is queued from the loop and from a dropped source's
#: finalizer, which the garbage collector may run inside any code, an executor's ``submit`` holding its
#: module-wide lock included: so a queue whose ``put`` takes no lock that code can hold (a SimpleQueue),
#: never an executor.
_removals: queue.SimpleQueue[tuple[Callable[..., object], tuple[object, ...]]] = queue.SimpleQueue()
_remover: threading.Thread | None = None
_exiting = False


def _io_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _io
    with _io_lock:
        if _io is None:
            _io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="lorapub-shm-io")
        return _io


def _remove_forever() -> None:
    while True:
        work, args = _removals.get()
        try:
            work(*args)
        except Exception:  # noqa: BLE001 - one removal's failure never stops the next
            logger.exception("lorapub: removing shared-memory files failed")


def _start_remover() -> None:
    """The remover thread, started once per process from a source's constructor (never from a finalizer)."""
    global _remover
    with _io_lock:
        if _remover is None or not _remover.is_alive():
            _remover = threading.Thread(target=_remove_forever, name="lorapub-shm-remove", daemon=True)
            _remover.start()


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True


def _off_loop(work: Callable[..., object], *args: object) -> None:
    """Run ``work(*args)`` (a removal) on the remover thread; while the interpreter exits, here."""
    if _exiting or _remover is None:
        work(*args)
    else:
        _removals.put((work, args))


def write_views(fd: int, views: list[memoryview]) -> int:
    """Write ``views`` back to back at ``fd``'s position: each call of ``writev`` hands the kernel up to
    IOV_MAX views at once, with the GIL released for all of it (a write per slice held it between every
    slice); a short write goes on where it stopped. Answers the bytes written."""
    pending = [v for v in views if len(v)]
    total = 0
    while pending:
        n = os.writev(fd, pending[:_IOV_MAX])
        if n <= 0:
            raise OSError(f"writev wrote {n} bytes")
        total += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]
    return total

class ShmBucket:
    """A bucket written once into a shared-memory file; removed once every engine has read it."""

    def __init__(self, name: str, nbytes: int, source: "ShmBucketSource", index: int) -> None:
        self.name, self.nbytes, self.source, self.index = name, nbytes, source, index

    def __len__(self) -> int:
        return self.nbytes

    def read_by(self, engine: str, ok: bool = True) -> None:
        """``engine``'s receive of this bucket ended (``ok``: it stored it; else the attempt is over)."""
        if ok:
            self.source._read(self.index, engine)
        else:
            self.source.abort()


#: A shared-memory bucket file, named after its owner: ``lorapub-<owner id>-b<index>.bucket`` (what the
#: engine accepts, ``lorapub.wire.routes.SHM_NAME``).
SHM_BUCKET = re.compile(r"lorapub-([0-9a-f]{8,64})-b[0-9]{1,6}\.bucket")
#: Beside an owner's bucket files, its owner file: locked (flock) while the owner has bucket files there.
SHM_OWNER = re.compile(r"lorapub-([0-9a-f]{8,64})\.owner")
#: Bucket files with no owner file (an earlier lorapub's, or an owner that could not lock) are removed
#: only once they are this old: a bucket file lives while the engines read it, seconds to minutes.
SHM_STALE_S = 3600.0
#: Owner files of this process (locks over some network filesystems do not exclude a process from itself).
LIVE_OWNERS: set[str] = set()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _owner_tag() -> str:
    """What an owner file starts with: the running kernel, the only one whose locks a sweeper can read."""
    return f"lorapub-shm-owner v1\n{running_kernel()}\n"


class _ShmOwner:
    """The bucket files one source has in its shared-memory folder and, while it has any, their owner
    file ``lorapub-<id>.owner``: created, locked exclusively (``flock``) and tagged with the running
    kernel before the first bucket file, removed (then unlocked) after the last. The lock goes with
    the process, however it ends: a sweeper that can take it knows the owner is gone. Each ownership
    has a new id, so a sweeper that saw an earlier owner file never touches a later one's files."""

    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = shm_dir
        self.paths: set[str] = set()
        self._mutex = threading.Lock()  # bucket files are made and removed from threads
        self._id: str | None = None
        self._fd: int | None = None

    def create(self, index: int) -> tuple[str, int]:
        """A new bucket file for bucket ``index``: its name and a descriptor open for writing."""
        with self._mutex:
            if self._id is None:
                self._take()
            name = f"lorapub-{self._id}-b{index}.bucket"
            path = os.path.join(self.shm_dir, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
            self.paths.add(path)
            return name, fd

    def remove(self, paths: Iterable[str]) -> None:
        """Remove bucket files (from a thread: unlinking a large tmpfs file frees its pages there and
        then); after the last one the owner file goes too."""
        paths = set(paths)
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        with self._mutex:
            self.paths -= paths
            if not self.paths:
                self._release()

    def remove_all(self) -> None:
        with self._mutex:
            paths = set(self.paths)
        self.remove(paths)

    def _take(self) -> None:
        self._id = uuid.uuid4().hex
        path = os.path.join(self.shm_dir, f"lorapub-{self._id}.owner")
        try:
            import fcntl

            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        except (ImportError, OSError) as e:
            logger.warning("lorapub: no owner file in %s (%s): bucket files left by a crash are removed only "
                           "after %.0f s", self.shm_dir, e, SHM_STALE_S)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{_owner_tag()}pid {os.getpid()}\n".encode())  # written once locked: see sweep_shm
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            logger.warning("lorapub: cannot lock the owner file %s (%s): bucket files left by a crash are removed "
                           "only after %.0f s", path, e, SHM_STALE_S)
            return
        self._fd = fd
        LIVE_OWNERS.add(path)

    def _release(self) -> None:
        if self._fd is not None:
            path = os.path.join(self.shm_dir, f"lorapub-{self._id}.owner")
            try:  # removed while still locked: a sweeper never takes a live owner's file
                os.unlink(path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
            LIVE_OWNERS.discard(path)
        self._id = None


def sweep_shm(shm_dir: str, *, stale_after: float = SHM_STALE_S) -> list[str]:
    """Remove what owners that are gone left in ``shm_dir``; answers the names removed.

    An owner file whose lock this process can take (its owner's process ended, however: a SIGKILL
    included) and that names the running kernel goes with every bucket file of its id. An owner file
    still locked, another kernel's (a folder shared between machines), or empty and younger than
    ``stale_after`` (being made) is left alone, with its files. A bucket file with no owner file is
    removed only once older than ``stale_after``. Nothing else in the folder is touched."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: nothing is swept
        return []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    owners = {m.group(1) for m in map(SHM_OWNER.fullmatch, names) if m}
    buckets: dict[str, list[str]] = {}
    for name in names:
        m = SHM_BUCKET.fullmatch(name)
        if m:
            buckets.setdefault(m.group(1), []).append(name)
    tag, now, removed = _owner_tag(), time.time(), []  # compared with files' mtimes: wall time
    for owner in sorted(owners):
        path = os.path.join(shm_dir, f"lorapub-{owner}.owner")
        if path in LIVE_OWNERS:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError:
            continue
        try:
            # Read before locking: an owner locks its file before it writes the tag, so a file with
            # no tag yet is never locked here (its owner's own lock cannot lose to this sweep).
            text = os.pread(fd, 4096, 0).decode(errors="replace")
            if text and not text.startswith(tag):
                continue
            if not text and now - os.fstat(fd).st_mtime < stale_after:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused: the owner still runs
            for name in buckets.get(owner, ()):
                try:
                    os.unlink(os.path.join(shm_dir, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            continue
        finally:
            os.close(fd)
    for owner, names_of in buckets.items():
        if owner in owners:
            continue
        for name in names_of:
            path = os.path.join(shm_dir, name)
            try:
                st = os.stat(path, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime >= stale_after:
                    os.unlink(path)
                    removed.append(name)
            except OSError:
                continue
    if removed:
        logger.info("lorapub: removed %d shared-memory files of ended publishers from %s", len(removed), shm_dir)
    return removed


class ShmBucketSource:
    """The publisher's half for :class:`SameHostIPC`: bucket ``i`` is written into one shared-memory
    file (off the event loop) for every engine on the host, and removed when all of them read it;
    the ``WRITE_AHEAD`` buckets after ``i`` are written while the engines read bucket ``i`` (at most
    ``WRITE_AHEAD + 2`` files at a time: the one read last is removed once ``i`` is written).

    While it has bucket files it holds their owner file's lock (:class:`_ShmOwner`), so a publisher
    killed mid-publication leaves files the next source made on the host removes (:func:`sweep_shm`,
    run off the event loop when a source is made; ``sweeping`` is that thread)."""

    collective = False

    def __init__(self, snapshot: Snapshot, plan: BucketPlan, shm_dir: str) -> None:
        if not isinstance(snapshot, Snapshot) or not isinstance(plan, BucketPlan) or plan.digest != snapshot.digest:
            raise InvalidInput("a shared-memory bucket source takes a Snapshot and the plan made for it")
        self.snapshot, self.plan, self.shm_dir = snapshot, plan, shm_dir
        self._owner = _ShmOwner(shm_dir)
        self._files: dict[int, ShmBucket] = {}
        self._engines: dict[int, set[str]] = {}
        self._read_by: dict[int, set[str]] = {}
        self._ahead: dict[int, asyncio.Future[ShmBucket]] = {}  # up to WRITE_AHEAD buckets, written in advance
        self._aborted = False
        _start_remover()
        # a source dropped with segments left (a failed or cancelled publication) removes them off the loop
        self._finalizer = weakref.finalize(self, _off_loop, self._owner.remove_all)
        self.sweeping = threading.Thread(target=sweep_shm, args=(shm_dir,), name="lorapub-shm-sweep", daemon=True)
        self.sweeping.start()

    def _write(self, index: int) -> ShmBucket:
        """Bucket ``index`` into a new segment: the snapshot's tensors, straight from its memory, in plan
        order (the one copy of the bytes this transport makes). A segment that could not be written
        whole is removed at once."""
        bucket = self.plan.buckets[index]
        name, fd = self._owner.create(index)
        try:
            written = write_views(fd, [tensor_bytes(self.snapshot.tensor(e.name)) for e in bucket.entries])
            if written != bucket.nbytes:
                raise OSError(f"wrote {written} of {bucket.nbytes} bytes")
        except OSError as e:
            self._owner.remove({os.path.join(self.shm_dir, name)})
            raise EngineError(f"writing shared-memory bucket {index} into {self.shm_dir} failed ({e}): free "
                              "room there (tmpfs size), or publish over HTTPBytes") from None
        finally:
            os.close(fd)
        return ShmBucket(name, bucket.nbytes, self, index)

    def _start_write(self, index: int) -> asyncio.Future[ShmBucket]:
        write = asyncio.wrap_future(_io_pool().submit(self._write, index))
        write.add_done_callback(lambda f: f.cancelled() or f.exception())  # a write ahead nobody awaits: read here
        return write

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        self._engines[index] = set(engines)
        last = min(index + WRITE_AHEAD, len(self.plan.buckets) - 1)
        for nxt in range(index, last + 1):  # this bucket and the next ones, each on a thread of its own
            if not self._aborted and nxt not in self._files and nxt not in self._ahead:
                self._ahead[nxt] = self._start_write(nxt)
        if index not in self._files:
            ahead = self._ahead.pop(index, None)
            if ahead is None:
                ahead = self._start_write(index)
            try:
                self._files[index] = await asyncio.shield(ahead)
            except BaseException:  # cancelled (the attempt is over) or not written: no segment of it stays,
                # those being written go once written
                self._ahead[index] = ahead
                self.abort()
                raise
        for old in [i for i in self._files if i < index]:  # every party finished those buckets
            self._remove(old)

    def payload(self, token: AttemptToken, index: int) -> ShmBucket:
        if index not in self._files:
            raise EngineError(f"shared-memory bucket {index} of {token} was not written (its send did not run)")
        return self._files[index]

    def abort(self) -> None:
        """The attempt is over (failed, or its send cancelled): remove every bucket file now, and those
        being written once written; nothing more is written ahead."""
        self._aborted = True
        for index in list(self._files):
            self._remove(index)
        for index, ahead in list(self._ahead.items()):
            del self._ahead[index]
            ahead.add_done_callback(functools.partial(self._drop_ahead, index))

    def _drop_ahead(self, index: int, done: asyncio.Future[ShmBucket]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._files[index] = done.result()
            self._remove(index)

    def _read(self, index: int, engine: str) -> None:
        seen = self._read_by.setdefault(index, set())
        seen.add(engine)
        if index in self._engines and seen >= self._engines[index]:
            self._remove(index)

    def _remove(self, index: int) -> None:
        found = self._files.pop(index, None)
        if found is not None:
            # removing a large tmpfs file frees its pages there and then: never on the event loop
            _off_loop(self._owner.remove, {os.path.join(self.shm_dir, found.name)})

    def close(self) -> None:
        """Remove every bucket file now, on this thread, and each one still being written ahead once it
        is written (a publication never calls this: its segments go off the loop as its engines read
        them, or when it fails, is cancelled or its source is dropped)."""
        self.abort()
        self._finalizer.detach()
        self._owner.remove_all()
        self._files.clear()

    @property
    def files(self) -> list[str]:
        """The bucket files this source has in the folder now (those being removed included)."""
        return sorted(self._owner.paths)


def _folder(kind: str, value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not os.path.isdir(value):
        raise InvalidInput(f"{kind} must be an existing folder, got {value!r}")
    return value


class SameHostIPC(HTTPBytes):
    """Buckets through shared memory on one host (``shm_dir``, default ``/dev/shm``; the engine reads
    only lorapub's bucket files from its own ``LORAPUB_SHM_DIR``, the same folder), loaded through
    SGLang's own ``load_lora_adapter_from_tensors`` by default.

    Each bucket is written once into a file of the folder (:class:`ShmBucketSource`) and every
    engine is sent only its name; the engine maps it, verifies it and stores it like any bucket."""

    kind = "shm"

    def __init__(self, *, shm_dir: str = "/dev/shm", load: str = "tensors") -> None:
        super().__init__(load=load)
        self.shm_dir = _folder("shm_dir", shm_dir)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shm_dir={self.shm_dir!r}, load={self.load!r})"

    def _value(self) -> tuple[object, ...]:
        return (type(self), self.load, os.path.realpath(self.shm_dir))

    def source(self, snapshot: Snapshot, plan: BucketPlan) -> ShmBucketSource:
        return ShmBucketSource(snapshot, plan, self.shm_dir)

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        if not isinstance(payload, ShmBucket):
            return await super().bucket_request(token, index, payload, engine)
        # the file goes once every engine read it, or at once when one could not (the attempt is over)
        return BucketPost("shm", json_bytes(ShmControl(payload.name).to_json()), "application/json",
                          settle=lambda stored, why: payload.read_by(engine, ok=stored))


class SharedDir(SameHostIPC):
    """Buckets as files in a folder the publisher and the engines both mount (``path``, the
    publisher's mount): :class:`SameHostIPC`'s mechanism over that folder. Each bucket is written
    there once; every engine is sent only its file's name and reads it from **its own**
    ``LORAPUB_SHM_DIR``, which the operator sets, in the engine's environment, to the engine's
    mount of the same folder (the mount points may differ). The engine verifies every tensor
    before anything is loaded; ``load="dir"`` (default) has it write the adapter's PEFT folder on
    its own disk and load that.

    The folder must keep a removed file readable to a reader that opened it (a local filesystem
    or a host folder mounted into containers: the publisher removes each bucket file once every
    engine answered it)."""

    def __init__(self, path: str | os.PathLike[str], *, load: str = "dir") -> None:
        super().__init__(shm_dir=_folder("path", path), load=load)

    @property
    def path(self) -> str:
        return self.shm_dir

    def __repr__(self) -> str:
        return f"SharedDir({self.shm_dir!r}, load={self.load!r})"
