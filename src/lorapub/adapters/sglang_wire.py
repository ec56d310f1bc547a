"""Adapter bytes into a patched SGLang server, staged and verified **inside the engine**.

:class:`SGLangWireEngine` is lorapub's :class:`~lorapub.ports.EngineAdmin` for SGLang: its begin /
buckets / end / cleanup run in the engine process (the routes lorapub's SGLang patch adds,
:mod:`lorapub.sglang_patch.engine_staging`): the publisher keeps one frozen snapshot and does no
per-engine byte work; each engine verifies every tensor's SHA-256 and the manifest digest before
the pinned fresh load. How the bytes travel is the deployment's :class:`~lorapub.ports.Transport`,
named once (``Deployment(engines, transport=...)``) and handed to every engine:

* :class:`HTTPBytes` (default, cross-host): each bucket's tensors are streamed as the body of one
  POST, straight from the frozen snapshot's memory (no serialisation, no copy);
* :class:`SameHostIPC`: the publisher writes each bucket once into a shared-memory file that every
  engine on the host reads; the engine loads through SGLang's own ``load_lora_adapter_from_tensors``
  (tensors handed to the scheduler over SGLang's IPC, nothing written to disk);
* :class:`SharedDir`: the same bucket files, in a folder the publisher and the engines both mount
  (the engine reads them from its ``LORAPUB_SHM_DIR``, its own mount of that folder);
* :class:`TorchDistributed`: the engine joins a process group with the publisher (gloo on CPUs,
  NCCL on GPUs) and receives each bucket as one ordered broadcast; a duplicate receive starts no
  second collective, and a failed collective fails the attempt on every party (every wait is
  bounded by the transport's ``timeout``).

Each transport is also the publisher's bucket source (:meth:`~lorapub.ports.Transport.source`) and
says what an engine posts for each bucket (:meth:`~lorapub.ports.Transport.bucket_request`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import re
import stat
import threading
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Iterable, Iterator

import aiohttp

from lorapub.adapters.body_sender import shared_sender
from lorapub.adapters.sglang_http import SGLangAdminBase, SGLangHTTP
from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown
from lorapub.ports import BucketPost, Transport
from lorapub.runtime.snapshot import Snapshot, tensor_bytes
from lorapub.wire.codec import json_bytes, json_or_text, plan_to_json, token_params, token_to_json
from lorapub.wire.collective import barrier, post_abort, running_kernel
from lorapub.wire.routes import BEGIN_ROUTE, BUCKET_ROUTE, CLEANUP_ROUTE, END_ROUTE, LOAD_FORMS, RELEASE_ROUTE

logger = logging.getLogger(__name__)
SENDERS = ("auto", "thread", "loop")  # where HTTPBytes' bodies are posted from (see HTTPBytes)
CHUNK = 128 << 10  # a streamed body is written in slices of this size (views, never copies): small
# slices keep what the socket transport buffers (and moves) per write small, so the loop never stalls


class RawBucket:
    """Bucket ``index`` of a frozen snapshot as it travels: its tensors back to back in plan order,
    read straight from the snapshot (``len`` is the plan's size; ``chunks()`` yields views)."""

    def __init__(self, snapshot: Snapshot, bucket: Bucket) -> None:
        self.snapshot, self.bucket = snapshot, bucket

    def __len__(self) -> int:
        return self.bucket.nbytes

    def views(self) -> Iterator[memoryview]:
        for entry in self.bucket.entries:
            view = tensor_bytes(self.snapshot.tensor(entry.name))
            for start in range(0, len(view), CHUNK):
                yield view[start : start + CHUNK]

    async def chunks(self) -> AsyncIterator[memoryview]:
        for view in self.views():
            yield view
            # A socket that takes every write at once would let the whole bucket go out in one step
            # of the event loop; yield after each slice so the caller's loop keeps running.
            await asyncio.sleep(0)


class HTTPBytes:
    """Buckets as HTTP bodies (cross-host; the default). ``load``: ``"dir"`` (the engine writes a PEFT
    folder on its own disk and loads it) or ``"tensors"`` (SGLang's ``load_lora_adapter_from_tensors``).

    ``sender``: where the bodies are posted from. ``"thread"``: lorapub's sender thread, with a
    session of its own (:mod:`lorapub.adapters.body_sender`), so the socket sends of hundreds of
    megabytes never run on the caller's event loop. ``"loop"``: the caller's loop, through the
    engine's session. ``"auto"`` (default): the thread, unless the engine was given an aiohttp
    session of the caller's (whose settings, such as a TLS context or a proxy, every request to
    that engine then keeps).

    Instances made with the same options are one way of sending (equal); a subclass that keeps
    per-attempt state of its own (as :class:`TorchDistributed` does) equals only itself.
    """

    kind = "http"

    def __init__(self, *, load: str = "dir", sender: str = "auto") -> None:
        if load not in LOAD_FORMS:
            raise InvalidInput(f"load must be one of {LOAD_FORMS}, got {load!r}")
        if sender not in SENDERS:
            raise InvalidInput(f"sender must be one of {SENDERS}, got {sender!r}")
        self.load, self.sender = load, sender

    def __repr__(self) -> str:
        return f"{type(self).__name__}(load={self.load!r}, sender={self.sender!r})"

    def _value(self) -> tuple:
        return (type(self), self.load, self.sender)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HTTPBytes) and self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())

    def source(self, snapshot: Snapshot, plan: BucketPlan) -> "WireBucketSource":
        return WireBucketSource(snapshot, plan)

    def begin_options(self, request: SendBegin, engine: str) -> dict[str, Any]:
        return {"kind": self.kind}

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        """A :class:`RawBucket` is streamed (``raw``); bytes are one safetensors blob (``safetensors``,
        e.g. :meth:`~lorapub.runtime.snapshot.Snapshot.bucket_bytes`)."""
        if isinstance(payload, RawBucket):
            return BucketPost("raw", payload.chunks(), length=len(payload), sender=self.sender)
        if isinstance(payload, (bytes, bytearray, memoryview)):
            return BucketPost("safetensors", payload)
        raise InvalidInput(f"{engine}: a bucket payload is bytes or a wire bucket, got {type(payload).__name__}")


class WireBucketSource:
    """The publisher's half for :class:`HTTPBytes`: nothing to prepare; each engine's receive streams
    the bucket from the frozen snapshot (no serialisation, no per-engine copy)."""

    collective = False

    def __init__(self, snapshot: Snapshot, plan: BucketPlan) -> None:
        if not isinstance(snapshot, Snapshot) or not isinstance(plan, BucketPlan) or plan.digest != snapshot.digest:
            raise InvalidInput("a wire bucket source takes a Snapshot and the plan made for it")
        self.snapshot, self.plan = snapshot, plan

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        return None

    def payload(self, token: AttemptToken, index: int) -> RawBucket:
        return RawBucket(self.snapshot, self.plan.buckets[index])


# -- same-host IPC ------------------------------------------------------------------------------------
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
_LIVE_OWNERS: set[str] = set()
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
        _LIVE_OWNERS.add(path)

    def _release(self) -> None:
        if self._fd is not None:
            path = os.path.join(self.shm_dir, f"lorapub-{self._id}.owner")
            try:  # removed while still locked: a sweeper never takes a live owner's file
                os.unlink(path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
            _LIVE_OWNERS.discard(path)
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
    tag, now, removed = _owner_tag(), time.time(), []
    for owner in sorted(owners):
        path = os.path.join(shm_dir, f"lorapub-{owner}.owner")
        if path in _LIVE_OWNERS:
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
    bucket ``i+1`` is written while the engines read bucket ``i`` (at most two files at a time).

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
        self._ahead: dict[int, asyncio.Future] = {}  # at most the next bucket, written in advance
        self._aborted = False
        self._finalizer = weakref.finalize(self, self._owner.remove_all)
        self.sweeping = threading.Thread(target=sweep_shm, args=(shm_dir,), name="lorapub-shm-sweep", daemon=True)
        self.sweeping.start()

    def _write(self, index: int) -> ShmBucket:
        bucket = self.plan.buckets[index]
        name, fd = self._owner.create(index)
        with os.fdopen(fd, "wb") as f:
            for view in RawBucket(self.snapshot, bucket).views():
                f.write(view)
        return ShmBucket(name, bucket.nbytes, self, index)

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        self._engines[index] = set(engines)
        if index not in self._files:
            ahead = self._ahead.pop(index, None)  # written while the engines read the previous bucket
            self._files[index] = await (ahead if ahead is not None else asyncio.to_thread(self._write, index))
        for old in [i for i in self._files if i < index]:  # every party finished those buckets
            self._remove(old)
        nxt = index + 1
        if not self._aborted and nxt < len(self.plan.buckets) and nxt not in self._files and nxt not in self._ahead:
            self._ahead[nxt] = asyncio.ensure_future(asyncio.to_thread(self._write, nxt))

    def payload(self, token: AttemptToken, index: int) -> ShmBucket:
        if index not in self._files:
            raise EngineError(f"shared-memory bucket {index} of {token} was not written (its send did not run)")
        return self._files[index]

    def abort(self) -> None:
        """The attempt failed: remove every bucket file, and the one being written ahead once written."""
        self._aborted = True
        for index in list(self._files):
            self._remove(index)
        for index, ahead in list(self._ahead.items()):
            ahead.add_done_callback(lambda f, i=index: self._drop_ahead(i, f))

    def _drop_ahead(self, index: int, done: asyncio.Future) -> None:
        self._ahead.pop(index, None)
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
            path = os.path.join(self.shm_dir, found.name)
            # removing a large tmpfs file frees its pages there and then: never on the event loop
            threading.Thread(target=self._owner.remove, args=({path},), name="lorapub-shm-unlink", daemon=True).start()

    def close(self) -> None:
        self._finalizer()
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

    def _value(self) -> tuple:
        return (type(self), self.load, os.path.realpath(self.shm_dir))

    def source(self, snapshot: Snapshot, plan: BucketPlan) -> ShmBucketSource:
        return ShmBucketSource(snapshot, plan, self.shm_dir)

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        if not isinstance(payload, ShmBucket):
            return await super().bucket_request(token, index, payload, engine)
        # the file goes once every engine read it, or at once when one could not (the attempt is over)
        return BucketPost("shm", json_bytes({"name": payload.name}), "application/json",
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

    def __init__(self, path: str | os.PathLike, *, load: str = "dir") -> None:
        super().__init__(shm_dir=_folder("path", path), load=load)

    @property
    def path(self) -> str:
        return self.shm_dir

    def __repr__(self) -> str:
        return f"SharedDir({self.shm_dir!r}, load={self.load!r})"


# -- torch.distributed ----------------------------------------------------------------------------------
class TorchDistributed(HTTPBytes):
    """Buckets as ordered broadcasts in a process group of the publisher (rank 0) and the attempt's
    engines (ranks 1.. in engine-name order): ``backend`` gloo (CPU) or nccl (GPU, ``device`` cuda).
    The publisher hosts the group's store at ``host`` (an address every engine can reach) on a free
    port per attempt; ``timeout`` bounds every join and broadcast on every party.

    It tracks the sources it made (each attempt's group): one instance serves a deployment, and
    equals only itself."""

    kind = "torch"

    def __init__(self, *, host: str = "127.0.0.1", backend: str = "gloo", device: str = "cpu",
                 timeout: float = 60.0, load: str = "dir") -> None:
        super().__init__(load=load)
        import torch.distributed  # noqa: F401 - imported here, never on the event loop of a publication

        if backend not in ("gloo", "nccl"):
            raise InvalidInput(f"backend must be gloo or nccl, got {backend!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise InvalidInput(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.host, self.backend, self.device, self.timeout = host, backend, device, float(timeout)
        self._sources: weakref.WeakValueDictionary[str, TorchBucketSource] = weakref.WeakValueDictionary()
        self._attempts: weakref.WeakValueDictionary[AttemptToken, TorchBucketSource] = weakref.WeakValueDictionary()

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def source(self, snapshot: Snapshot, plan: BucketPlan) -> "TorchBucketSource":
        source = TorchBucketSource(snapshot, plan, self)
        self._sources[plan.digest] = source
        return source

    def begin_options(self, request: SendBegin, engine: str) -> dict[str, Any]:
        source = self._sources.get(request.digest)
        if source is None:  # a caller that hands the buckets' bytes itself (no collective to join)
            return {"kind": "http"}
        self._attempts[request.token] = source
        return {"kind": self.kind, "host": self.host, "port": source.port, "backend": self.backend,
                "device": self.device, "timeout": self.timeout}

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        if not isinstance(payload, (bytes, bytearray, memoryview)) or len(payload):
            return await super().bucket_request(token, index, payload, engine)
        # no bytes: the engine joins the broadcast of bucket ``index``
        source = self._attempts.get(token)
        if source is None:
            raise EngineError(f"no torch.distributed bucket source is publishing {token} in this process")
        try:
            rank, world = await source.rank_of(token, engine)
        except Exception as e:
            source.abort(token, f"{engine}: {e}")
            raise

        def settle(stored: bool, why: str | None) -> None:
            if not stored and why is not None:  # the others must not wait for a rank that will not come
                source.abort(token, why)

        return BucketPost("torch", json_bytes({"rank": rank, "world_size": world, "src": 0}), "application/json",
                          settle=settle)


class TorchBucketSource:
    """The publisher's half for :class:`TorchDistributed` (rank 0). The group forms at the first
    bucket, once the attempt's engines are known; bucket ``i`` is broadcast at most once, from a
    flat copy made while bucket ``i-1`` was on the wire (two reused bucket-sized buffers)."""

    collective = True

    def __init__(self, snapshot: Snapshot, plan: BucketPlan, transport: TorchDistributed) -> None:
        import torch.distributed as dist

        if not isinstance(snapshot, Snapshot) or not isinstance(plan, BucketPlan) or plan.digest != snapshot.digest:
            raise InvalidInput("a torch bucket source takes a Snapshot and the plan made for it")
        self.snapshot, self.plan, self.transport = snapshot, plan, transport
        self.store = dist.TCPStore(transport.host, 0, None, True, timeout=datetime.timedelta(seconds=transport.timeout),
                                   wait_for_workers=False)
        self.port = self.store.port
        self._rosters: dict[AttemptToken, tuple[str, ...]] = {}
        self._roster_set: dict[AttemptToken, asyncio.Event] = {}
        self._groups: dict[AttemptToken, Any] = {}
        self._sent: dict[tuple[AttemptToken, int], asyncio.Future] = {}
        self.failed: str | None = None
        self.broadcasts = 0
        self._bufs: list[Any] = [None, None]  # at most two buckets' bytes beside the snapshot
        self._ahead: dict[int, tuple[threading.Thread, int]] = {}

    def _event(self, token: AttemptToken) -> asyncio.Event:
        return self._roster_set.setdefault(token, asyncio.Event())

    async def rank_of(self, token: AttemptToken, engine: str) -> tuple[int, int]:
        """(rank, world size) of ``engine`` in the group of ``token`` (known once its first bucket starts)."""
        try:
            async with asyncio.timeout(self.transport.timeout):
                await self._event(token).wait()
        except TimeoutError:
            raise OutcomeUnknown(f"the publisher never started the collective of {token}") from None
        roster = self._rosters[token]
        if engine not in roster:
            raise EngineError(f"{engine} is not a target of {token} ({roster})")
        return 1 + roster.index(engine), 1 + len(roster)

    def _prefixed(self, token: AttemptToken) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(f"lorapub/{token}", self.store)

    def abort(self, token: AttemptToken, reason: str) -> None:
        """Every party of ``token``'s collective stops waiting (an engine refused or did not answer)."""
        self.failed = self.failed or reason
        if self.store is not None:
            post_abort(self._prefixed(token), f"publisher: {reason}")

    def _join(self, token: AttemptToken, world: int) -> Any:
        import torch.distributed as dist

        span = datetime.timedelta(seconds=self.transport.timeout)
        store = self._prefixed(token)
        barrier(store, "join", world, self.transport.timeout)  # every party is there before the group forms
        if self.transport.backend == "gloo":
            return dist.ProcessGroupGloo(store, 0, world, span)
        opts = dist.ProcessGroupNCCL.Options()  # pragma: no cover - needs GPUs
        opts._timeout = span
        return dist.ProcessGroupNCCL(store, 0, world, opts)

    def _flatten(self, index: int, slot: int) -> Any:
        """Bucket ``index`` into buffer ``slot`` (two buffers of the largest bucket, reused)."""
        import numpy as np
        import torch

        if self._bufs[slot] is None:
            self._bufs[slot] = torch.empty(max(b.nbytes for b in self.plan.buckets), dtype=torch.uint8)
        bucket = self.plan.buckets[index]
        flat = self._bufs[slot][: bucket.nbytes]
        out, offset = flat.numpy(), 0
        for entry in bucket.entries:  # numpy copies without the GIL: the caller's loop keeps running
            view = tensor_bytes(self.snapshot.tensor(entry.name))
            np.copyto(out[offset : offset + len(view)], np.frombuffer(view, dtype=np.uint8))
            offset += len(view)
        return flat

    def _broadcast(self, token: AttemptToken, index: int, world: int) -> None:
        import torch.distributed as dist

        if token not in self._groups:
            self._groups[token] = self._join(token, world)
        ahead = self._ahead.pop(index, None)
        if ahead is not None:  # flattened while the previous bucket was broadcast
            ahead[0].join()
            slot = ahead[1]
            flat = self._bufs[slot][: self.plan.buckets[index].nbytes]
        else:
            slot = index % 2
            flat = self._flatten(index, slot)
        if index + 1 < len(self.plan.buckets):  # the next bucket goes into the other buffer meanwhile
            worker = threading.Thread(target=self._flatten, args=(index + 1, 1 - slot), daemon=True)
            worker.start()
            self._ahead[index + 1] = (worker, 1 - slot)
        if self.transport.device != "cpu":  # pragma: no cover - NCCL sends from the GPU
            flat = flat.to(self.transport.device)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.transport.timeout)
        barrier(self._prefixed(token), f"bucket-{index}", world, self.transport.timeout)
        self._groups[token].broadcast([flat], opts).wait()
        if index == len(self.plan.buckets) - 1:  # the last bucket: leave the group here, off the loop
            self._groups.pop(token, None)
            self._bufs = [None, None]
            self.store = None  # the store's server thread is joined here too

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        roster = tuple(sorted(engines))
        if token not in self._rosters:
            self._rosters[token] = roster
            self._event(token).set()
        key = (token, index)
        if key in self._sent:  # a duplicate: the same outcome, never a second collective
            return await asyncio.shield(self._sent[key])
        if self.failed:
            raise EngineError(f"the collective of {token} failed before bucket {index}: {self.failed}")
        self._sent[key] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.to_thread(self._broadcast, token, index, 1 + len(roster))
        except Exception as e:  # noqa: BLE001 - a failed collective fails the attempt for every party
            self.failed = f"{type(e).__name__}: {e}"
            if self.store is not None:
                post_abort(self._prefixed(token), f"publisher: {self.failed}")
            self._groups.pop(token, None)  # its sockets close: ranks still waiting fail at once
            error = EngineError(f"broadcast of bucket {index} of {token} failed: {self.failed}")
            self._sent[key].set_exception(error)
            self._sent[key].exception()  # retrieved here; the caller gets it raised below
            raise error from None
        self.broadcasts += 1
        self._sent[key].set_result(None)

    def payload(self, token: AttemptToken, index: int) -> bytes:
        return b""


# -- the engine adapter ----------------------------------------------------------------------------------
#: The transport of an engine no deployment gave one (buckets as HTTP bodies).
DEFAULT_TRANSPORT = HTTPBytes()


class SGLangWireEngine(SGLangAdminBase):
    """A patched SGLang server (0.5.17 or 0.5.23) whose staging runs inside it: lorapub's one
    SGLang engine adapter.

    Its buckets travel its deployment's transport: ``Deployment(engines, transport=...)`` hands it
    to every engine (:meth:`use_transport`); an engine no deployment gave one sends them as HTTP
    bodies (:data:`DEFAULT_TRANSPORT`). ``load_timeout`` bounds ``end`` (verification and the
    engine's load) and ``cleanup`` (which waits for an in-flight ``end``); ``transfer_timeout`` one
    bucket's request. The other options are :class:`~lorapub.adapters.sglang_http.SGLangHTTP`'s;
    every staging route is admin-level and carries the admin key.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        http: aiohttp.ClientSession | None = None,
        request_timeout: float | None = None,
        probe_timeout: float | None = 30.0,
        transfer_timeout: float | None = None,
        load_timeout: float | None = 600.0,
        require_patch: bool = True,
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        self.client = SGLangHTTP(
            name, base_url, http=http, request_timeout=request_timeout, probe_timeout=probe_timeout,
            require_patch=require_patch, api_key=api_key, admin_api_key=admin_api_key,
        )
        self.name = self.client.name
        self._transport: Transport | None = None  # the one its deployment gave it
        self.transfer_timeout = transfer_timeout  # one bucket's request (None: the runner's deadline bounds it)
        self.load_timeout = load_timeout  # end (verify + the engine's load) and cleanup (waits for it)
        self._lives: dict[AttemptToken, str] = {}
        #: where each recent ``end`` spent its time (seconds): the engine's last SHA-256 checks and load,
        #: the exact-version probe, the state check. The publication report carries them per engine.
        self.end_timings: dict[AttemptToken, dict[str, float]] = {}

    def __repr__(self) -> str:
        return f"SGLangWireEngine({self.client!r}, transport={self.transport!r})"

    @property
    def transport(self) -> Transport:
        """How this engine's buckets travel: its deployment's transport, else :data:`DEFAULT_TRANSPORT`."""
        return self._transport if self._transport is not None else DEFAULT_TRANSPORT

    def use_transport(self, transport: Transport) -> None:
        """Send buckets ``transport``'s way (what a deployment does with its transport). An engine
        given another transport before (by another deployment) refuses: :class:`InvalidInput` naming it."""
        if not isinstance(transport, Transport):
            raise InvalidInput(f"{self.name}: a transport is a lorapub.ports.Transport (HTTPBytes, SameHostIPC, "
                               f"SharedDir, TorchDistributed), got {transport!r}")
        if self._transport is None:
            self._transport = transport
        elif self._transport != transport:
            raise InvalidInput(f"engine {self.name} already sends buckets {self._transport!r}; it cannot also send "
                               f"them {transport!r} (one transport per engine adapter: build another for this deployment)")

    async def _stage(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        status, reply = await self.client.request("POST", path, json_body=body,
                                                  timeout=timeout if timeout is not None else self.client.probe_timeout)
        return self._staged(path, status, reply)

    def _staged(self, path: str, status: int, reply: Any) -> dict[str, Any]:
        if status == 404 and self.client.require_patch:
            raise EngineError(f"{self.name} lacks lorapub's engine-side staging ({path} is missing): update its "
                              "SGLang patch", engine=self.name, status=status)
        if status != 200:
            raise self.client.refusal(path, status, reply)
        return self.client.json_object(path, status, reply)

    # -- publication ------------------------------------------------------------------------------
    async def begin(self, request: SendBegin) -> str:
        body = {
            "token": token_to_json(request.token), "incarnation": request.incarnation,
            "lora_name": request.lora_name, "digest": request.digest, "plan": plan_to_json(request.plan),
            "transport": dict(self.transport.begin_options(request, self.name)), "load": self.transport.load,
        }
        reply = await self._stage(BEGIN_ROUTE, body)
        self._lives[request.token] = reply["incarnation"]
        return reply["incarnation"]

    async def _life(self, token: AttemptToken) -> str:
        return self._lives.get(token) or await self.incarnation()

    async def receive_bucket(self, token: AttemptToken, index: int, payload: Any) -> str:
        params = {**token_params(token), "index": str(index), "incarnation": await self._life(token)}
        post = await self.transport.bucket_request(token, index, payload, self.name)
        params["format"] = post.format
        headers = {**self.client._authorization(True), "Content-Type": post.content_type}
        if post.length is not None:
            headers["Content-Length"] = str(post.length)
        stored, why = False, None
        try:
            url = self.base_url + BUCKET_ROUTE
            if post.sender is not None and self._bodies_off_loop(post.sender):
                status, raw = await shared_sender().post(url, params=params, headers=headers, body=post.body,
                                                         timeout=self.transfer_timeout)
            else:
                t = aiohttp.ClientTimeout(total=self.transfer_timeout)
                async with self.client.http.post(url, params=params, data=post.body, headers=headers, timeout=t) as r:
                    status, raw = r.status, await r.read()
            text = raw.decode("utf-8", errors="replace")
            incarnation = self._staged(BUCKET_ROUTE, status, json_or_text(text))["incarnation"]
            stored = True
            return incarnation
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            why = f"{self.name} did not answer bucket {index}"
            raise OutcomeUnknown(f"{self.name} {BUCKET_ROUTE}: no answer ({type(e).__name__})") from None
        except EngineError as e:
            why = f"{self.name} refused bucket {index}: {e.message}"
            raise
        finally:
            if post.settle is not None:
                post.settle(stored, why)

    def _bodies_off_loop(self, sender: str) -> bool:
        self.client.http  # noqa: B018 - a closed engine refuses here, before anything is sent
        return sender == "thread" or (sender == "auto" and self.client.owns_http)

    async def end(self, token: AttemptToken) -> ReadyLocal:
        inc = await self._life(token)
        t0 = time.monotonic()
        receipt = await self._stage(END_ROUTE, {"token": token_to_json(token), "incarnation": inc},
                                    self.load_timeout)
        t1 = time.monotonic()
        name, digest = receipt.get("lora_name"), receipt.get("digest")
        if receipt.get("incarnation") != inc or not isinstance(name, str) or not isinstance(digest, str):
            raise EngineError(f"{self.name} {END_ROUTE} answered a malformed receipt: {receipt}", engine=self.name)
        await self._probe(name)
        t2 = time.monotonic()
        state = await self.client.state()
        timings = receipt.get("timings") if isinstance(receipt.get("timings"), dict) else {}
        self.end_timings[token] = {**{f"end.{k}": v for k, v in timings.items() if isinstance(v, (int, float))},
                                   "end.stage": t1 - t0, "end.probe": t2 - t1, "end.state": time.monotonic() - t2}
        while len(self.end_timings) > 16:  # a few recent ones, for reports
            self.end_timings.pop(next(iter(self.end_timings)))
        if state["incarnation"] != inc:
            raise EngineError(f"{self.name} restarted during end ({inc} -> {state['incarnation']})")
        entry = state["adapters"].get(name)
        if entry is None or not entry.get("pinned") or entry.get("lora_id") != receipt.get("lora_id"):
            raise EngineError(f"{self.name}: {name} is not loaded pinned from this attempt")
        self._lives.pop(token, None)
        return ReadyLocal(self.name, token, digest, inc, entry.get("lora_id"))

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        # The engine tombstones the attempt first and waits for its in-flight operation, so nothing
        # of it can be loaded after this answer; then the exact name is unloaded if this attempt
        # loaded it (another attempt of the same version — a re-provisioning — may hold that name).
        reply = await self._stage(CLEANUP_ROUTE, {"token": token_to_json(token)}, self.load_timeout)
        if "loaded" not in reply or reply["loaded"] or await self._left_behind(lora_name):
            # (a staging that does not say: unloaded to be safe)
            await self._unload(lora_name, f"cleanup-{token}")
        self._lives.pop(token, None)
        return await self.incarnation()

    async def _left_behind(self, lora_name: str) -> bool:
        """The engine holds ``lora_name`` though no attempt staged there claims it: the load of the
        attempt just cleaned up, which ended after the cleanup tombstoned it (the staging then
        answers ``loaded: null`` for a load that did happen). A name another attempt holds or is
        loading (a re-provisioning of the same version) is that attempt's, and stays."""
        state = await self.client.state()
        if lora_name not in state.get("adapters", {}):
            return False
        attempts = (state.get("staging") or {}).get("attempts") or {}
        return not any(isinstance(a, dict) and a.get("lora_name") == lora_name
                       for a in (attempts.values() if isinstance(attempts, dict) else ()))

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        await self._unload(lora_name, reclaim_id)
        await self._stage(RELEASE_ROUTE, {"lora_name": lora_name})  # the engine frees what it still kept


__all__ = ["DEFAULT_TRANSPORT", "HTTPBytes", "RawBucket", "SGLangWireEngine", "SameHostIPC", "SharedDir", "ShmBucket",
           "ShmBucketSource", "TorchBucketSource", "TorchDistributed", "WireBucketSource"]
