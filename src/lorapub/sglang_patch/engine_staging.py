"""Engine-side staging of adapter versions: begin / bucket / end / cleanup / release, in the engine.

This module runs **inside the SGLang server process** (lorapub's patch adds its routes) and inside
lorapub's contract double, so both use one implementation. It imports only the standard library,
``lorapub.core`` and, where a transport or load form needs them, torch (and nothing of lorapub's
runtime, adapters or aiohttp).

One :class:`EngineStaging` per server life (``incarnation``). Every message names its attempt
(``AttemptToken``) and the life it was meant for; a message for another life, for an attempt that
was cleaned up (a **tombstone**), or for one never begun here is refused and recreates nothing.

* ``begin``: checks the name is the version's managed name, that the bucket plan is the one the
  digest describes (the manifest rebuilt from the plan hashes to the digest), that the name is not
  loaded and a LoRA slot is free; fixes the attempt, its transport and its load form.
* ``receive``: stores bucket ``index`` once into a buffer of exactly the plan's size and verifies the
  SHA-256 of every tensor in it (off the event loop, beside the next bucket's transfer); ``end``
  waits for every check. A duplicate stores nothing and starts no second collective. Where the bytes
  land depends on the load form: a ``dir`` load receives each bucket straight into its place in the
  adapter's safetensors file on the engine's disk (an ``shm`` bucket is mapped, verified, then copied
  there), so the folder is complete when the last bucket is checked; a ``tensors`` load into shared
  memory SGLang's scheduler maps (for ``shm``: the publisher's own pages, no copy). Transports: ``raw`` (HTTP body: the bucket's tensors
  back to back in plan order), ``safetensors`` (HTTP body: a safetensors blob of the bucket),
  ``shm`` (same host: a shared-memory file the publisher wrote once for every engine), ``torch``
  (a torch.distributed broadcast from the publisher, gloo or NCCL, in a group begun here).
* ``end``: every bucket present and verified, the manifest digest checked again, then the fresh,
  **pinned** load through the engine (``dir``: the PEFT directory on the engine's own disk, its
  config added now, loaded with ``load_lora_adapter``; ``tensors``: SGLang's own ``load_lora_adapter_from_tensors``, which
  hands the tensors to the scheduler over SGLang's IPC, never touching disk). A duplicate ``end``
  answers the same receipt.
* ``cleanup``: tombstones the attempt first, waits for its in-flight operation, frees the stash
  (the unload itself is SGLang's ``/unload_lora_adapter`` with the reclaim header).
* ``release``: after a reclaim unloaded a name, frees what the attempt that loaded it still keeps.
* **aging**: an attempt nobody has driven (no begin, bucket, end, cleanup or release touching it)
  for ``LORAPUB_STAGE_IDLE_S`` seconds (default 600) is freed and tombstoned exactly as a cleanup
  would, so a publisher that vanished mid-transfer never keeps its stash (nor the byte budget) for
  the server's life. Never while an operation on it runs (the sweep takes its lock); an attempt
  whose ``end`` loaded its adapter is left alone while that adapter is loaded (its staged bytes were
  freed at ``end``; the adapter is the registry's to reclaim or clean up), and aged like any other
  once it is gone. The sweep runs before every ``begin``'s capacity check and on a timer of the
  server's event loop (armed by the routes, stopped by ``close``).

Every handler answers ``(status, body)``: 200 with a JSON object, or a definite refusal
(``{"error": {"message", "code"}}``, 400 malformed or not verifying, 409 refused by state).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import mmap
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Protocol

from lorapub.core.identity import MANAGED_PREFIX, MANAGED_PREFIX_ENV, AttemptToken, lora_name_for
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.wire.codec import manifest_digest, plan_from_json, token_from_json, token_to_json
from lorapub.wire.collective import barrier, post_abort, running_kernel
from lorapub.wire.dtypes import SAFETENSORS_DTYPES
from lorapub.wire.refusal import Refused, bad, refuse
from lorapub.wire.routes import FORMATS, LOAD_FORMS, SHM_NAME
from lorapub.wire.safetensors import raw_spans, safetensors_header, safetensors_layout, verify_spans

_CHUNK = 1 << 20
#: Beside each life's stash folder, its claim: a file locked (flock) while that life's process runs,
#: naming the running kernel (its boot id) whose locks make the claim mean anything.
CLAIM_SUFFIX = ".claim"
#: Seconds an attempt may go undriven before the engine frees and tombstones it (see the module docs).
IDLE_ENV = "LORAPUB_STAGE_IDLE_S"
DEFAULT_IDLE_S = 600.0
logger = logging.getLogger(__name__)
#: Stash folders claimed by lives of this process (locks over some network filesystems do not
#: exclude one process from itself).
_LIVE_ROOTS: set[str] = set()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _claim_tag() -> str:
    """Which lives' locks this process can read: those of the same running kernel."""
    return f"lorapub-claim v1\n{running_kernel()}\n"


def idle_timeout_setting() -> float:
    """``LORAPUB_STAGE_IDLE_S`` in seconds (``inf``: never); the default when unset, or when not a
    positive number (logged)."""
    raw = os.environ.get(IDLE_ENV)
    if not raw:
        return DEFAULT_IDLE_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:  # zero, negative, NaN or not a number
        logger.warning("lorapub: %s=%r is not a positive number of seconds; using %g", IDLE_ENV, raw, DEFAULT_IDLE_S)
        return DEFAULT_IDLE_S
    return seconds


def _verify_and_keep(buf: memoryview, spans: list[tuple[int, int]], bucket: Bucket, into: tuple[str, int] | None) -> None:
    """Check the bucket (:func:`verify_spans`); then, with ``into`` (file, offset), copy its verified
    tensors there, back to back in plan order, through a shared mapping of that file region (a
    ``write`` into a disk file's page cache costs several times more here). The file is opened, never
    created: a folder a cleanup removed stays removed."""
    verify_spans(buf, spans, bucket)
    if into is None:
        return
    path, at = into
    try:
        window = Buffer.file_window(path, at, bucket.nbytes)
    except OSError as e:
        raise refuse(f"writing bucket {bucket.index} into the engine's folder failed: {e}", "STAGE_DISK") from None
    try:
        offset = 0
        for start, end in spans:
            window.view[offset : offset + end - start] = buf[start:end]
            offset += end - start
    finally:
        window.close()


# -- what the staging needs from its engine ----------------------------------------------------
class EngineHooks(Protocol):
    """The engine around the staging (SGLang's TokenizerManager, or the contract double)."""

    def adapters(self) -> Mapping[str, Mapping[str, Any]]:
        """Registered adapters: name -> {"lora_id", "pinned", "lora_path"}."""

    def max_loaded_loras(self) -> int | None: ...

    # optional: def managed_prefix(self) -> str — the names the engine protects (MANAGED_PREFIX if absent)

    async def load_dir(self, lora_name: str, path: str) -> str | None:
        """Load the PEFT directory ``path`` pinned under ``lora_name``; None, or the engine's error text."""

    async def load_tensors(self, lora_name: str, tensors: dict[str, Any], config: dict[str, Any],
                           checksums: dict[str, str]) -> str | None:
        """Load named torch tensors pinned under ``lora_name``; None, or the engine's error text."""


class Buffer:
    """A bucket's bytes on the engine: an anonymous mapping, a read-only mapping of a shared-memory
    bucket file (no copy at all), or a uint8 torch tensor in shared memory when the load form hands
    tensors to SGLang's scheduler processes (for a shared-memory bucket file: the file's own pages,
    mapped as a storage torch shares by file descriptor — again no copy).

    ``populate``: fault the anonymous mapping's pages in at once (one kernel call instead of a fault
    per page as the bytes arrive); only off the event loop, since the call takes the mapping's time."""

    def __init__(self, nbytes: int, shared: bool, mapping: mmap.mmap | None = None, *, populate: bool = False,
                 tensor: Any = None, skip: int = 0) -> None:
        self.nbytes, self.tensor, self._map = nbytes, tensor, mapping
        self.in_file = False  # the bytes land in the adapter's own file (a dir load's folder)
        if tensor is not None:
            self.view = memoryview(tensor.numpy()).cast("B")
        elif mapping is not None:
            self.view = memoryview(mapping)[skip : skip + nbytes] if skip else memoryview(mapping)
        elif shared:
            import torch

            self.tensor = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
            self.view = memoryview(self.tensor.numpy()).cast("B")
        elif nbytes:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._map = mmap.mmap(-1, nbytes, flags=flags)
            self.view = memoryview(self._map)
        else:
            self.view = memoryview(bytearray(0))

    @classmethod
    def shared_file(cls, fd: int, nbytes: int) -> "Buffer | None":
        """The open file ``fd`` (a shared-memory file, opened for reading and writing) as a uint8 tensor
        whose storage torch shares by file descriptor: SGLang's scheduler maps the same pages. None
        where this torch cannot (the caller copies instead)."""
        import torch

        make = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)  # what torch's own fd sharing rebuilds with
        if make is None or not nbytes:
            return None
        storage = make(fd, nbytes)  # keeps a duplicate of fd: the storage stays shareable after ours closes
        return cls(nbytes, True, tensor=torch.empty(0, dtype=torch.uint8).set_(storage))

    @classmethod
    def file_window(cls, path: str, offset: int, nbytes: int) -> "Buffer":
        """Bytes ``offset`` .. ``offset + nbytes`` of the existing file ``path``, mapped shared and
        writable: what is received there is in the file (the page cache) at once, with no second copy
        and no second allocation. Its disk blocks are reserved first (``posix_fallocate``): a full
        disk is an ``OSError`` here, never a fault while the bytes arrive."""
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)  # never created: a removed folder stays removed
        try:
            if not nbytes:
                return cls(0, False)
            os.posix_fallocate(fd, offset, nbytes)
            skip = offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, nbytes + skip, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                                offset=offset - skip)
        finally:
            os.close(fd)
        buf = cls(nbytes, False, mapping, skip=skip)
        buf.in_file = True
        return buf

    def close(self) -> None:
        """Give the memory back now (or, while a loaded tensor still views it, when that goes)."""
        self.tensor = None
        try:
            self.view.release()
            if self._map is not None:
                self._map.close()
        except (BufferError, ValueError):
            pass


def close_all(buffers: list[Buffer]) -> None:
    """Unmap many buckets (hundreds of MB: the kernel frees every page) off the event loop."""
    if buffers:
        threading.Thread(target=lambda: [b.close() for b in buffers], name="lorapub-stash-free", daemon=True).start()


class _Attempt:
    def __init__(self, token: AttemptToken, lora_name: str, digest: str, plan: BucketPlan, transport: dict,
                 load: str) -> None:
        self.token, self.lora_name, self.digest, self.plan = token, lora_name, digest, plan
        self.transport, self.load = transport, load
        self.lock = asyncio.Lock()
        self.buckets: dict[int, tuple[Buffer, list[tuple[int, int]]]] = {}
        self.receipt: dict[str, Any] | None = None
        self.folder: str | None = None
        self.peft: tuple[str, dict[int, int]] | None = None  # dir load: the safetensors file, bucket -> offset
        self.group: Any = None  # torch transport: the group's store and, once formed, its process group
        self.inflight: dict[int, asyncio.Future] = {}  # torch buckets whose collective is running
        self.verifying: dict[int, asyncio.Future] = {}  # SHA-256 checks running beside the next bucket
        self.failed: str | None = None
        self.driving = 0  # operations on it running or waiting for its lock
        self.last_driven = time.monotonic()  # when an operation on it last began or ended

    @property
    def held_bytes(self) -> int:
        return sum(buf.nbytes for buf, _ in self.buckets.values())


class EngineStaging:
    """The engine-side staging of one server life. ``hooks`` is the engine; ``stash_root`` the
    engine's own folder for ``dir`` loads; ``shm_dir`` the only folder ``shm`` buckets are read from;
    ``max_stash_bytes`` bounds what staged attempts may hold at once (None: no bound);
    ``idle_timeout`` the seconds an attempt may go undriven before it is aged out (None:
    ``LORAPUB_STAGE_IDLE_S``, default 600; ``math.inf``: never)."""

    def __init__(self, hooks: EngineHooks, *, incarnation: str, stash_root: str | None = None,
                 shm_dir: str | None = None, max_stash_bytes: int | None = None,
                 idle_timeout: float | None = None) -> None:
        self.hooks = hooks
        self.incarnation = incarnation
        root = stash_root or os.environ.get("LORAPUB_ENGINE_STASH") or os.path.join(
            tempfile.gettempdir(), "lorapub-engine-stash")
        self.stash_root = os.path.join(root, re.sub(r"[^A-Za-z0-9_.-]", "_", incarnation))
        self.shm_dir = os.path.realpath(shm_dir or os.environ.get("LORAPUB_SHM_DIR") or "/dev/shm")
        if max_stash_bytes is None and os.environ.get("LORAPUB_MAX_STASH_BYTES"):
            max_stash_bytes = int(os.environ["LORAPUB_MAX_STASH_BYTES"])
        self.max_stash_bytes = max_stash_bytes
        if idle_timeout is None:
            idle_timeout = idle_timeout_setting()
        elif isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        self.idle_timeout = float(idle_timeout)
        self._attempts: dict[AttemptToken, _Attempt] = {}
        self._tombstones: set[AttemptToken] = set()
        self.collectives = 0  # broadcasts this life joined (a duplicate receive joins none)
        self.aged_out = 0  # attempts freed because nobody drove them for idle_timeout
        self._timer: asyncio.TimerHandle | None = None  # the next sweep, on the loop the routes run on
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._sweeping: asyncio.Task | None = None
        self._closed = False
        # Closes the claim's descriptor (its lock goes with it); also when a staging is never closed.
        self._claim: weakref.finalize | None = None
        self._pid = os.getpid()
        tag = _claim_tag()
        if self._take_claim(root, tag):
            self._sweep_ended_lives(root, tag)

    def _take_claim(self, root: str, tag: str) -> bool:
        """Claim this life's stash folder: its claim file, locked as long as this process runs and
        naming the running kernel. False where it cannot (then nothing is swept either)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no claim, nothing swept
            return False
        try:
            os.makedirs(root, exist_ok=True)
            fd = os.open(self.stash_root + CLAIM_SUFFIX, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
        except OSError as e:
            logger.warning("lorapub: cannot claim the stash folder %s (%s); earlier lives are not swept",
                           self.stash_root, e)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            logger.warning("lorapub: the stash folder %s is claimed by a running process (%s)", self.stash_root, e)
            return False
        try:
            os.ftruncate(fd, 0)
            os.write(fd, tag.encode())
        except OSError as e:  # claimed, but no sweeper will ever recognise it: freed at close only
            logger.warning("lorapub: cannot write the claim of %s (%s)", self.stash_root, e)
        self._claim = weakref.finalize(self, os.close, fd)
        _LIVE_ROOTS.add(self.stash_root)
        return True

    def _sweep_ended_lives(self, root: str, tag: str) -> None:
        """Remove the stash folders of earlier lives under this running kernel whose process is gone
        (their lock is free): a server killed without its shutdown leaves a folder the next life on
        the machine frees. A folder whose claim names another kernel (another machine sharing the
        root, or this one before a reboot), is not complete yet, or has no claim is left alone; so is
        every stash root this process itself holds."""
        import fcntl

        try:
            names = os.listdir(root)
        except OSError:
            return
        for name in names:
            claim = os.path.join(root, name)
            folder = claim[: -len(CLAIM_SUFFIX)]
            if not name.endswith(CLAIM_SUFFIX) or folder in _LIVE_ROOTS:
                continue
            try:
                other = os.open(claim, os.O_RDWR | _NOFOLLOW)
            except OSError:
                continue
            try:
                # Read before locking: a claim still being made (empty) or another machine's is
                # never locked here, so its owner's own lock cannot lose to this sweep.
                if os.pread(other, 4096, 0).decode(errors="replace") != tag:
                    continue
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # refused: that life still runs
                shutil.rmtree(folder, ignore_errors=True)
                os.unlink(claim)
                logger.info("lorapub: freed the stash folder of an ended life: %s", folder)
            except OSError:
                continue
            finally:
                os.close(other)

    # -- introspection (the state route reports it) ------------------------------------------
    def report(self) -> dict[str, Any]:
        """Every staged attempt (keyed by its token's text): its ``token``, ``lora_name``, ``phase``
        (``receiving``, ``failed`` or ``loaded``), the ``buckets`` received of ``planned``, ``bytes``
        held and ``idle_s``, the seconds since an operation last drove it (``driving``: one runs now)."""
        self._arm()
        now = time.monotonic()
        return {
            "attempts": {
                str(a.token): {"token": token_to_json(a.token), "lora_name": a.lora_name,
                               "phase": "loaded" if a.receipt is not None else "failed" if a.failed else "receiving",
                               "buckets": sorted(a.buckets), "planned": len(a.plan.buckets), "bytes": a.held_bytes,
                               "loaded": a.receipt is not None, "folder": a.folder is not None,
                               "transport": a.transport.get("kind", "http"), "load": a.load,
                               "idle_s": round(max(0.0, now - a.last_driven), 3), "driving": a.driving > 0}
                for a in self._attempts.values()
            },
            "bytes": sum(a.held_bytes for a in self._attempts.values()),
            "tombstones": len(self._tombstones),
            "collectives": self.collectives,
            "idle_timeout_s": self.idle_timeout,
            "aged_out": self.aged_out,
        }

    def close(self) -> None:
        """Free every stash of this life (the server is going away). Only in the process that made
        it: a forked child that exits must not free its parent's live stash."""
        if os.getpid() != self._pid:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            for attempt in list(self._attempts.values()):
                try:
                    self._free(attempt)
                except Exception as e:  # noqa: BLE001 - the folder and the claim go whatever one attempt does
                    logger.warning("lorapub: freeing %s at close failed: %s", attempt.token, e)
        finally:
            shutil.rmtree(self.stash_root, ignore_errors=True)
            if self._claim is not None:
                try:
                    os.unlink(self.stash_root + CLAIM_SUFFIX)
                except OSError:
                    pass
                self._claim()  # closes the claim's descriptor: the lock goes with it
                self._claim = None
                _LIVE_ROOTS.discard(self.stash_root)

    # -- aging ----------------------------------------------------------------------------------
    @contextmanager
    def _driving(self, attempt: _Attempt) -> Iterator[None]:
        """An operation on ``attempt`` runs (or waits for its lock): the sweep leaves it alone, and its
        idle time counts from when the last operation began or ended."""
        attempt.driving += 1
        attempt.last_driven = time.monotonic()
        try:
            yield
        finally:
            attempt.driving -= 1
            attempt.last_driven = time.monotonic()

    def _idle(self, attempt: _Attempt) -> bool:
        """Nobody drove it for ``idle_timeout`` and no operation on it runs or waits (nor a collective)."""
        return (not attempt.driving and not attempt.inflight
                and time.monotonic() - attempt.last_driven >= self.idle_timeout)

    def _holds_adapter(self, attempt: _Attempt, adapters: Mapping[str, Mapping[str, Any]] | None) -> bool:
        """Its ``end`` loaded the adapter now registered under its name (None: unknown, so yes)."""
        if attempt.receipt is None:
            return False
        if adapters is None:
            return True
        entry = adapters.get(attempt.lora_name)
        return entry is not None and entry.get("lora_id") == attempt.receipt.get("lora_id")

    async def sweep(self) -> list[str]:
        """Age out every attempt nobody has driven for ``idle_timeout``: tombstoned and freed as a
        cleanup would, under its lock. An attempt whose ``end`` loaded the adapter registered under
        its name now is kept (aging never unloads). Answers the tokens aged out."""
        if self._closed:
            return []
        candidates = [a for a in list(self._attempts.values()) if self._idle(a) and not a.lock.locked()]
        adapters: Mapping[str, Mapping[str, Any]] | None = None
        if any(a.receipt is not None for a in candidates):
            try:
                adapters = self.hooks.adapters()
            except Exception as e:  # noqa: BLE001 - unknown: every loaded attempt is kept
                logger.warning("lorapub: the staging sweep cannot read the engine's adapters: %s", e)
        aged = []
        for attempt in candidates:
            if self._holds_adapter(attempt, adapters) or attempt.lock.locked():
                continue
            # Free and waited for by nobody (an operation counts in ``driving`` before it waits for
            # the lock): taken at once, and no operation on the attempt starts until it is freed.
            async with attempt.lock:
                if self._attempts.get(attempt.token) is not attempt or not self._idle(attempt):
                    continue
                idle = time.monotonic() - attempt.last_driven
                self._tombstones.add(attempt.token)  # as a cleanup: late begin / bucket / end refused
                self._free(attempt)
            self.aged_out += 1
            aged.append(str(attempt.token))
            logger.warning("lorapub: staged attempt %s (%s) aged out after %.0f s undriven; %s freed",
                           attempt.token, attempt.lora_name, idle,
                           "its folder" if attempt.receipt is not None else "its stash")
        return aged

    @property
    def _sweep_every(self) -> float:
        return min(60.0, max(0.01, self.idle_timeout / 4))

    def _arm(self) -> None:
        """Make sure a sweep is due on the running event loop (a cheap timer; none without attempts,
        none once closed). Called by every route."""
        if self._closed or math.isinf(self.idle_timeout) or not self._attempts:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None:
            if self._timer_loop is loop:
                return
            self._timer.cancel()  # a loop this staging was used on before: sweep on this one
        self._timer_loop = loop
        self._timer = loop.call_later(self._sweep_every, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._closed:
            return
        if self._sweeping is None or self._sweeping.done():
            self._sweeping = asyncio.ensure_future(self.sweep())
            self._sweeping.add_done_callback(self._swept)
        self._arm()

    @staticmethod
    def _swept(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("lorapub: staging sweep failed: %r", task.exception())

    # -- helpers --------------------------------------------------------------------------------
    def _check_life(self, incarnation: Any) -> None:
        if incarnation != self.incarnation:
            raise refuse(f"message for engine life {incarnation!r}; this life is {self.incarnation!r}", "STAGE_LIFE")

    def _live(self, token: AttemptToken) -> _Attempt:
        if token in self._tombstones:
            raise refuse(f"attempt {token} was cleaned up here; refusing to recreate it", "STAGE_TOMBSTONE")
        found = self._attempts.get(token)
        if found is None:
            raise refuse(f"attempt {token} was never begun in this engine life", "STAGE_UNKNOWN")
        return found

    def _folder(self, token: AttemptToken) -> str:
        return os.path.join(self.stash_root, f"{token.version.deployment_epoch}-{token.version.version_id}-a{token.seq}")

    async def _answer(self, work) -> tuple[int, dict[str, Any]]:
        try:
            return 200, await work
        except Refused as e:
            return e.status, {"error": {"message": e.message, "code": e.code}}
        finally:
            self._arm()  # a sweep is due while anything is staged

    # -- begin ------------------------------------------------------------------------------------
    async def begin(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._answer(self._begin(body))

    async def _begin(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise bad("begin takes a JSON object")
        token = token_from_json(body.get("token"))
        # Age out what nobody drives first: a vanished publisher's stash never blocks this begin (its
        # capacity check below). Nothing after this awaits, so what it checks still holds when it acts.
        await self.sweep()
        if token in self._tombstones:
            raise refuse(f"attempt {token} was cleaned up here; late begin refused", "STAGE_TOMBSTONE")
        self._check_life(body.get("incarnation"))
        found = self._attempts.get(token)
        if found is not None:  # a duplicate begin: the same answer, nothing set up twice
            found.last_driven = time.monotonic()
            if found.digest != body.get("digest"):
                raise refuse(f"attempt {token} was begun here with digest {found.digest[:12]}")
            return {"incarnation": self.incarnation, "duplicate": True}
        digest, lora_name = body.get("digest"), body.get("lora_name")
        plan = plan_from_json(body.get("plan"))
        prefix = managed_prefix_of(self.hooks)
        try:
            expected_name = lora_name_for(token.version, digest, prefix)
        except Exception:  # noqa: BLE001
            raise bad(f"digest {digest!r:.80} is not a SHA-256 hex digest") from None
        if lora_name != expected_name:
            raise bad(f"lora_name {lora_name!r} is not the managed name of {token.version} ({expected_name}): this "
                       f"engine protects names starting with {prefix!r} (launch it with {MANAGED_PREFIX_ENV} set to the "
                       "deployment's name_prefix)")
        if plan.digest != digest or manifest_digest(plan) != digest:
            raise Refused(400, "STAGE_DIGEST", f"the bucket plan does not describe digest {str(digest)[:12]}")
        transport = dict(body.get("transport") or {"kind": "http"})
        kind = transport.get("kind", "http")
        if kind not in ("http", "shm", "torch"):
            raise bad(f"unknown transport {kind!r}")
        load = body.get("load", "dir")
        if load not in LOAD_FORMS:
            raise bad(f"unknown load form {load!r}; one of {LOAD_FORMS}")
        if load == "tensors" or kind == "torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                raise refuse(f"{kind} transport / {load} load needs torch in the engine process") from None
        adapters = self.hooks.adapters()
        if lora_name in adapters:
            raise refuse(f"{lora_name} is already loaded")
        limit = self.hooks.max_loaded_loras()
        if limit is not None and len(adapters) >= int(limit):
            raise refuse(f"no free LoRA slot ({len(adapters)} of {limit} loaded)", "STAGE_CAPACITY")
        total = sum(b.nbytes for b in plan.buckets)
        held = sum(a.held_bytes for a in self._attempts.values())
        if self.max_stash_bytes is not None and held + total > self.max_stash_bytes:
            raise refuse(f"staging {total} bytes would exceed {self.max_stash_bytes} ({held} held)", "STAGE_CAPACITY")
        if load == "dir":
            header = safetensors_header([e for b in plan.buckets for e in b.entries])  # refuses a dtype it cannot store
        attempt = _Attempt(token, lora_name, digest, plan, transport, load)
        self._attempts[token] = attempt
        if kind == "torch":
            self._start_join(attempt)
        if load == "dir":
            try:
                self._prepare_peft_file(attempt, header)
            except OSError as e:
                self._attempts.pop(token, None)
                self._free(attempt)
                raise refuse(f"the engine cannot write {attempt.lora_name}'s folder: {e}", "STAGE_DISK") from None
        return {"incarnation": self.incarnation, "duplicate": False}

    def _prepare_peft_file(self, attempt: _Attempt, header: bytes) -> None:
        """A ``dir`` load's folder on the engine's disk: the safetensors file with its header, sized for
        every tensor (a few KB of I/O here: the file is sparse until written). Each bucket is received
        into its own region of it and verified there, so ``end`` only adds the config."""
        folder = self._folder(attempt.token)
        path = os.path.join(folder, "adapter")
        shutil.rmtree(folder, ignore_errors=True)
        attempt.folder = folder
        os.makedirs(path)
        file = os.path.join(path, "adapter_model.safetensors")
        with open(file, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(b.nbytes for b in attempt.plan.buckets))
        offsets, at = {}, len(header)
        for b in attempt.plan.buckets:  # the file holds the plan's tensors back to back, in plan order
            offsets[b.index] = at
            at += b.nbytes
        attempt.peft = (file, offsets)

    # -- receive ----------------------------------------------------------------------------------
    async def receive(self, params: Mapping[str, str], chunks: AsyncIterator[bytes] | None,
                      length: int | None = None) -> tuple[int, dict[str, Any]]:
        """A bucket: ``params`` carry the token (epoch, version_id, seq), ``index``, ``incarnation`` and
        ``format``; ``chunks`` is the body (the bytes, or for shm/torch a small JSON object)."""
        status, body = await self._answer(self._receive(params, chunks, length))
        if status != 200 and chunks is not None:
            await _drain(chunks)  # the caller's stream is read to its end whatever the answer
        return status, body

    async def _receive(self, params: Mapping[str, str], chunks, length) -> dict[str, Any]:
        token = token_from_json(params)
        if token in self._tombstones:
            raise refuse(f"attempt {token} was cleaned up here; late bucket refused", "STAGE_TOMBSTONE")
        self._check_life(params.get("incarnation"))
        try:
            index = int(params.get("index", ""))
        except ValueError:
            raise bad(f"bucket index {params.get('index')!r} is not an int") from None
        fmt = params.get("format", "raw")
        if fmt not in FORMATS:
            raise bad(f"unknown bucket format {fmt!r}")
        attempt = self._live(token)
        with self._driving(attempt):  # its idle time starts again when this ends
            return await self._receive_into(attempt, token, index, fmt, chunks, length)

    async def _receive_into(self, attempt: _Attempt, token: AttemptToken, index: int, fmt: str, chunks,
                            length) -> dict[str, Any]:
        async with attempt.lock:
            attempt = self._live(token)  # a cleanup may have come while we waited
            if attempt.failed:
                raise refuse(f"attempt {token} failed here: {attempt.failed}", "STAGE_FAILED")
            if not 0 <= index < len(attempt.plan.buckets):
                raise bad(f"bucket index {index} is not in the plan of {token}")
            if index in attempt.buckets:  # duplicate: nothing stored twice, no second collective
                if chunks is not None:
                    await _drain(chunks)
                return {"incarnation": self.incarnation, "duplicate": True}
            if attempt.receipt is not None:
                raise refuse(f"attempt {token} is already loaded; bucket {index} is late")
            bucket = attempt.plan.buckets[index]
            shared = attempt.load == "tensors"
            if fmt == "torch":
                if attempt.transport.get("kind") != "torch":
                    raise bad(f"attempt {token} was begun for the {attempt.transport.get('kind')} transport")
                control = json.loads(await _read_all(chunks, 1 << 16) or b"{}")
                running = attempt.inflight.get(index)
                if running is None:  # the collective runs outside the lock: a cleanup never waits for it
                    running = attempt.inflight[index] = asyncio.ensure_future(self._collect(attempt, bucket, control))
                    duplicate = False
                else:  # a duplicate while the first runs: its outcome, never a second collective
                    duplicate = True
            elif fmt == "shm":
                control = json.loads(await _read_all(chunks, 1 << 16) or b"{}")
                buf, spans = await asyncio.to_thread(self._from_shm, attempt, bucket, control)
            elif fmt == "raw":
                if length is not None and length != bucket.nbytes:
                    raise bad(f"bucket {index} has {bucket.nbytes} bytes in the plan, the body says {length}")
                buf = await asyncio.to_thread(self._landing, attempt, bucket)
                try:
                    await _fill(buf.view, chunks, f"bucket {index}")
                except BaseException:
                    buf.close()
                    raise
                spans = raw_spans(bucket)
            else:  # a safetensors blob: its bytes in a buffer of their own size, entries found by header
                if length is None or length > bucket.nbytes + (100 << 20):
                    raise bad("a safetensors bucket needs a Content-Length within its plan's size")
                buf = await asyncio.to_thread(Buffer, length, shared, populate=True)
                try:
                    await _fill(buf.view, chunks, f"bucket {index}")
                except BaseException:
                    buf.close()
                    raise
                spans = safetensors_layout(buf.view, bucket)
            if fmt != "torch":
                return self._store(attempt, index, buf, spans)
        answer = await asyncio.shield(running)  # it runs on even if this caller goes away
        return {**answer, "duplicate": True} if duplicate else answer

    async def _collect(self, attempt: _Attempt, bucket: Bucket, control: Mapping[str, Any]) -> dict[str, Any]:
        try:
            buf, spans = await self._broadcast(attempt, bucket, control)
            return self._store(attempt, bucket.index, buf, spans)
        finally:
            attempt.inflight.pop(bucket.index, None)
            attempt.last_driven = time.monotonic()  # its caller may have gone: the collective drove it

    def _store(self, attempt: _Attempt, index: int, buf: Buffer, spans: list) -> dict[str, Any]:
        """Keep the bucket and check every tensor's SHA-256 beside the next bucket's transfer (off the
        event loop); a ``dir`` load's bucket that did not arrive in the adapter's file (a safetensors
        blob, or the publisher's shared-memory pages mapped here) is copied there once verified.
        ``end`` waits for every check and copy before anything is loaded."""
        if attempt.token in self._tombstones:  # cleaned up while the bytes arrived: keep nothing
            buf.close()
            raise refuse(f"attempt {attempt.token} was cleaned up while bucket {index} arrived", "STAGE_TOMBSTONE")
        attempt.buckets[index] = (buf, spans)
        bucket = attempt.plan.buckets[index]
        into = None if attempt.peft is None or buf.in_file else (attempt.peft[0], attempt.peft[1][index])
        check = asyncio.ensure_future(asyncio.to_thread(_verify_and_keep, buf.view, spans, bucket, into))
        check.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here; end raises it
        attempt.verifying[index] = check
        return {"incarnation": self.incarnation, "duplicate": False}

    def _landing(self, attempt: _Attempt, bucket: Bucket) -> Buffer:
        """Where a bucket's bytes are received (off the event loop: this maps and reserves memory):
        for a ``dir`` load its window of the adapter's file (received, verified and loaded in place);
        for a ``tensors`` load shared tensor memory; else an anonymous mapping, populated at once."""
        if attempt.peft is not None:
            try:
                return Buffer.file_window(attempt.peft[0], attempt.peft[1][bucket.index], bucket.nbytes)
            except OSError as e:
                raise refuse(f"bucket {bucket.index} cannot be placed in the engine's folder: {e}", "STAGE_DISK") from None
        return Buffer(bucket.nbytes, attempt.load == "tensors", populate=True)

    def _from_shm(self, attempt: _Attempt, bucket: Bucket, control: Mapping[str, Any]) -> tuple[Buffer, list]:
        shared = attempt.load == "tensors"
        name = control.get("name")
        if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
            raise bad(f"shared-memory bucket name {name!r:.80} is not a lorapub bucket file")
        path = os.path.join(self.shm_dir, name)
        try:  # read-write only where torch maps the file for SGLang's scheduler (it maps pages writable)
            fd = os.open(path, (os.O_RDWR if shared else os.O_RDONLY) | _NOFOLLOW)
        except OSError as e:
            raise refuse(f"shared-memory bucket {name} cannot be opened here ({e.strerror}); is the publisher "
                          "on this host?", "STAGE_SHM") from None
        try:
            size = os.fstat(fd).st_size
            if size != bucket.nbytes:
                raise bad(f"shared-memory bucket {name} has {size} bytes, the plan says {bucket.nbytes}")
            if shared and size:  # tensors for SGLang's scheduler: the publisher's pages, shared by descriptor
                buf = Buffer.shared_file(fd, size)
                if buf is not None:
                    return buf, raw_spans(bucket)
            if shared or not size:  # a torch without descriptor-backed storages: the engine's own shared copy
                buf, got = self._landing(attempt, bucket), 0
                try:
                    while got < size:
                        n = os.readv(fd, [buf.view[got:]])
                        if n <= 0:
                            raise bad(f"shared-memory bucket {name} ended after {got} of {size} bytes")
                        got += n
                except BaseException:
                    buf.close()
                    raise
            else:  # no copy: the engine maps the publisher's pages (they live on after it removes the file);
                # a dir load copies them into the adapter's file once verified, beside the next bucket
                buf = Buffer(size, False, mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
            return buf, raw_spans(bucket)
        finally:
            os.close(fd)

    # -- torch.distributed ----------------------------------------------------------------------
    def _start_join(self, attempt: _Attempt) -> None:
        """Connect to the attempt's group store in the background (the publisher hosts it); the group
        itself forms at the first bucket, when the publisher names the attempt's ranks."""
        t = attempt.transport
        try:
            host, port = str(t["host"]), int(t["port"])
            timeout = float(t.get("timeout", 60.0))
            backend = t.get("backend", "gloo")
            if backend not in ("gloo", "nccl") or not 0 < port < 65536 or not timeout > 0:
                raise ValueError(f"backend {backend!r}, port {port}, timeout {timeout}")
        except Exception as e:  # noqa: BLE001
            self._attempts.pop(attempt.token, None)
            raise bad(f"a torch transport needs host, port, backend (gloo|nccl) and timeout: {e}") from None
        done = threading.Event()
        attempt.group = {"done": done, "store": None, "pg": None, "error": None, "ranks": None}

        def connect() -> None:
            try:
                import torch.distributed as dist

                attempt.group["store"] = dist.TCPStore(host, port, None, False,
                                                       timeout=datetime.timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - reported at the first bucket
                attempt.group["error"] = f"{type(e).__name__}: {e}"
            finally:
                done.set()

        threading.Thread(target=connect, name=f"lorapub-store-{attempt.token}", daemon=True).start()

    async def _broadcast(self, attempt: _Attempt, bucket: Bucket, control: Mapping[str, Any]) -> tuple[Buffer, list]:
        group = attempt.group
        if group is None:
            raise refuse(f"attempt {attempt.token} has no process group here (it failed or ended)", "STAGE_FAILED")
        t = attempt.transport
        timeout = float(t.get("timeout", 60.0))
        try:
            rank, world, src = int(control["rank"]), int(control["world_size"]), int(control.get("src", 0))
            if not (0 < rank < world and 0 <= src < world and src != rank):
                raise ValueError(f"rank {rank}, world {world}, src {src}")
        except Exception as e:  # noqa: BLE001
            raise bad(f"a torch bucket names rank (1..world-1), world_size and src: {e}") from None
        if group["ranks"] not in (None, (rank, world, src)):
            raise bad(f"bucket {bucket.index} names ranks {(rank, world, src)}; the group has {group['ranks']}")
        device = t.get("device", "cpu")

        def run() -> tuple[Buffer, list]:
            import torch
            import torch.distributed as dist

            if not group["done"].wait(timeout):
                raise TimeoutError(f"the group store was not reached within {timeout:g}s")
            if group["error"]:
                raise RuntimeError(f"reaching the group store failed: {group['error']}")
            span = datetime.timedelta(seconds=timeout)
            store = dist.PrefixStore(f"lorapub/{attempt.token}", group["store"])
            group["prefixed"] = store
            if group["pg"] is None:  # the group forms once, at the first bucket, with every party there
                barrier(store, "join", world, timeout)
                if t.get("backend", "gloo") == "gloo":
                    group["pg"] = dist.ProcessGroupGloo(store, rank, world, span)
                else:  # pragma: no cover - needs GPUs
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = span
                    group["pg"] = dist.ProcessGroupNCCL(store, rank, world, opts)
                group["ranks"] = (rank, world, src)
            buf = self._landing(attempt, bucket)
            target = buf.tensor if buf.tensor is not None else torch.frombuffer(buf.view, dtype=torch.uint8)
            if device != "cpu":  # pragma: no cover - NCCL receives on the GPU
                target = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            opts.timeout = span
            barrier(store, f"bucket-{bucket.index}", world, timeout)
            group["pg"].broadcast([target], opts).wait()
            if device != "cpu":  # pragma: no cover
                buf.view[:] = memoryview(target.cpu().numpy()).cast("B")
            return buf, raw_spans(bucket)

        self.collectives += 1
        try:
            return await asyncio.to_thread(run)
        except Refused as e:
            attempt.failed = e.message
            self._drop_group(attempt, f"{self.incarnation}: {e.message}")
            raise
        except Exception as e:  # noqa: BLE001 - a failed collective fails the attempt here for good
            attempt.failed = f"collective for bucket {bucket.index} failed: {type(e).__name__}: {e}"
            self._drop_group(attempt, f"{self.incarnation}: {attempt.failed}")
            raise Refused(409, "STAGE_COLLECTIVE", attempt.failed) from None

    @staticmethod
    def _drop_group(attempt: _Attempt, reason: str | None = None) -> None:
        """Leave the attempt's group; with ``reason``, tell every party to stop waiting first."""
        group, attempt.group = attempt.group, None
        if group and reason and group.get("prefixed") is not None:
            post_abort(group["prefixed"], reason)
        if group:  # a process group's teardown joins its threads: never on the server's event loop
            threading.Thread(target=group.clear, name="lorapub-group-teardown", daemon=True).start()

    # -- end ----------------------------------------------------------------------------------------
    async def end(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._answer(self._end(body))

    async def _end(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise bad("end takes a JSON object")
        token = token_from_json(body.get("token"))
        self._check_life(body.get("incarnation"))
        attempt = self._live(token)
        with self._driving(attempt):
            return await self._end_of(attempt, token)

    async def _end_of(self, attempt: _Attempt, token: AttemptToken) -> dict[str, Any]:
        async with attempt.lock:
            attempt = self._live(token)
            if attempt.receipt is not None:  # a duplicate end: the same receipt, nothing loaded twice
                return dict(attempt.receipt, duplicate=True)
            if attempt.failed:
                raise refuse(f"attempt {token} failed here: {attempt.failed}", "STAGE_FAILED")
            missing = [b.index for b in attempt.plan.buckets if b.index not in attempt.buckets]
            if missing:
                raise refuse(f"buckets {missing[:8]} of {token} never arrived", "STAGE_INCOMPLETE")
            started = time.monotonic()
            try:  # every tensor's SHA-256, checked as its bucket arrived
                await asyncio.gather(*attempt.verifying.values())
            except Refused as e:
                attempt.failed = e.message
                raise
            verified = time.monotonic()
            if manifest_digest(attempt.plan) != attempt.digest:
                raise Refused(400, "STAGE_DIGEST", f"the staged manifest does not hash to {attempt.digest[:12]}")
            adapters = self.hooks.adapters()
            if attempt.lora_name in adapters:
                raise refuse(f"{attempt.lora_name} is already loaded (not by this attempt)")
            if attempt.load == "dir":  # the tensors are in the folder already (received and verified there)
                path = await asyncio.to_thread(self._finish_peft_dir, attempt)
                error = await self.hooks.load_dir(attempt.lora_name, path)
            else:
                path = "__tensor__"
                tensors = self._tensors(attempt)
                checksums = {e.name: e.sha256 for b in attempt.plan.buckets for e in b.entries}
                error = await self.hooks.load_tensors(attempt.lora_name, tensors, json.loads(attempt.plan.serving_config_json),
                                                      checksums)
            if error is not None:
                raise refuse(f"load of {attempt.lora_name} failed: {error}", "STAGE_LOAD")
            entry = self.hooks.adapters().get(attempt.lora_name)
            if entry is None or not entry.get("pinned"):
                raise refuse(f"{attempt.lora_name} is not registered pinned after its load", "STAGE_LOAD")
            if token in self._tombstones:  # pragma: no cover - cleanup waits for this lock
                raise refuse(f"attempt {token} was cleaned up during its load", "STAGE_TOMBSTONE")
            attempt.receipt = {"incarnation": self.incarnation, "lora_name": attempt.lora_name, "digest": attempt.digest,
                               "lora_id": entry.get("lora_id"), "lora_path": entry.get("lora_path", path),
                               "load": attempt.load,
                               # where end's time went here: the last SHA-256 checks, then SGLang's load
                               "timings": {"verify_wait": verified - started, "load": time.monotonic() - verified}}
            self._release_buckets(attempt)  # the engine holds the adapter now; the staged bytes are not needed
            self._drop_group(attempt)
            return dict(attempt.receipt, duplicate=False)

    def _ordered(self, attempt: _Attempt):
        for bucket in attempt.plan.buckets:
            buf, spans = attempt.buckets[bucket.index]
            for (start, end), e in zip(spans, bucket.entries):
                yield e, buf, buf.view[start:end], start

    @staticmethod
    def _finish_peft_dir(attempt: _Attempt) -> str:
        assert attempt.peft is not None
        path = os.path.dirname(attempt.peft[0])
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write(attempt.plan.serving_config_json)
        return path

    def _tensors(self, attempt: _Attempt) -> dict[str, Any]:
        import torch

        dtypes = {name: getattr(torch, name) for name in SAFETENSORS_DTYPES}
        out = {}
        for e, buf, view, start in self._ordered(attempt):
            if buf.tensor is not None:  # a view of the shared bucket tensor: no copy
                raw = buf.tensor[start : start + e.nbytes]
            else:
                raw = torch.frombuffer(view, dtype=torch.uint8) if e.nbytes else torch.empty(0, dtype=torch.uint8)
            out[e.name] = raw.view(dtypes[e.dtype]).reshape(e.shape)
        return out

    # -- cleanup / release ----------------------------------------------------------------------------
    async def cleanup(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Tombstone the attempt (always, whatever life it names: a tombstone only refuses), wait for
        its in-flight operation, free its stash. Answers whether it had loaded (the caller unloads)."""
        return await self._answer(self._cleanup(body))

    async def _cleanup(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise bad("cleanup takes a JSON object")
        token = token_from_json(body.get("token"))
        self._tombstones.add(token)  # from now on begin / bucket / end of it are refused
        attempt = self._attempts.get(token)
        loaded = None
        if attempt is not None:
            with self._driving(attempt):
                async with attempt.lock:
                    loaded = attempt.receipt
                    self._free(attempt)
        return {"incarnation": self.incarnation, "loaded": loaded}

    async def release(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """After ``lora_name`` was unloaded (reclaimed): free what its attempt still keeps here."""
        return await self._answer(self._release(body))

    async def _release(self, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body.get("lora_name") if isinstance(body, Mapping) else None
        if not isinstance(name, str):
            raise bad("release takes {\"lora_name\": ...}")
        if name in self.hooks.adapters():
            raise refuse(f"{name} is still loaded; unload it first")
        freed = []
        for attempt in [a for a in self._attempts.values() if a.lora_name == name]:
            with self._driving(attempt):
                async with attempt.lock:
                    self._free(attempt)
                    self._tombstones.add(attempt.token)
                    freed.append(str(attempt.token))
        return {"incarnation": self.incarnation, "freed": freed}

    @staticmethod
    def _release_buckets(attempt: _Attempt) -> None:
        for check in attempt.verifying.values():
            check.cancel()
        attempt.verifying.clear()
        close_all([buf for buf, _ in attempt.buckets.values()])
        attempt.buckets.clear()

    def _free(self, attempt: _Attempt) -> None:
        self._release_buckets(attempt)
        self._drop_group(attempt, None if attempt.receipt else f"{self.incarnation}: attempt {attempt.token} cleaned up")
        if attempt.folder is not None:
            shutil.rmtree(attempt.folder, ignore_errors=True)
        else:
            shutil.rmtree(self._folder(attempt.token), ignore_errors=True)
        self._attempts.pop(attempt.token, None)


# -- body streams -------------------------------------------------------------------------------------
async def _fill(view: memoryview, chunks: AsyncIterator[bytes] | None, what: str) -> None:
    """Read the body into ``view``: exactly its size, no more, no less."""
    got = 0
    if chunks is not None:
        async for chunk in chunks:
            n = len(chunk)
            if got + n > len(view):
                raise bad(f"{what} is longer than its {len(view)} bytes")
            view[got : got + n] = chunk
            got += n
    if got != len(view):
        raise bad(f"{what} ended after {got} of {len(view)} bytes")


async def _read_all(chunks: AsyncIterator[bytes] | None, limit: int) -> bytes:
    out = bytearray()
    if chunks is not None:
        async for chunk in chunks:
            out += chunk
            if len(out) > limit:
                raise bad(f"a control body longer than {limit} bytes")
    return bytes(out)


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    try:
        async for _ in chunks:
            pass
    except Exception:  # noqa: BLE001 - already consumed, or the client went away
        pass


# -- SGLang's TokenizerManager as the engine ------------------------------------------------------
class SGLangHooks:
    """The patched SGLang server's TokenizerManager as :class:`EngineHooks` (``tm`` is read at each
    call: the server creates it after the routes are added). The request classes are SGLang's own,
    taken from the globals of the methods that use them."""

    def __init__(self, tokenizer_manager: Callable[[], Any], serialize: Callable[[Any], bytes] | None = None) -> None:
        self._tm = tokenizer_manager
        self._serialize = serialize

    def adapters(self) -> dict[str, dict[str, Any]]:
        return {name: {"lora_id": ref.lora_id, "pinned": bool(ref.pinned), "lora_path": ref.lora_path}
                for name, ref in self._tm().lora_registry.get_all_adapters().items()}

    def max_loaded_loras(self) -> int | None:
        return max_loaded_loras(self._tm())

    def managed_prefix(self) -> str:
        return getattr(type(self._tm()), "lorapub_managed_prefix", MANAGED_PREFIX)

    async def load_dir(self, lora_name: str, path: str) -> str | None:
        tm = self._tm()
        request = type(tm).load_lora_adapter.__globals__["LoadLoRAAdapterReqInput"]
        result = await tm.load_lora_adapter(request(lora_name=lora_name, lora_path=path, pinned=True), None)
        return None if result.success else str(result.error_message)

    async def load_tensors(self, lora_name: str, tensors: dict[str, Any], config: dict[str, Any],
                           checksums: dict[str, str]) -> str | None:
        tm = self._tm()
        request = type(tm).load_lora_adapter_from_tensors.__globals__["LoadLoRAAdapterFromTensorsReqInput"]
        serialize = self._serialize
        if serialize is None:  # SGLang's own: what Engine.load_lora_adapter_from_tensors sends each TP rank
            from sglang.srt.utils import MultiprocessingSerializer

            serialize = MultiprocessingSerializer.serialize
        ranks = int(getattr(getattr(tm, "server_args", None), "tp_size", 1) or 1)
        payload = await asyncio.to_thread(serialize, tensors)
        kwargs = dict(lora_name=lora_name, config_dict=config, serialized_named_tensors=[payload] * ranks, pinned=True)
        if "expected_checksums" in getattr(request, "__struct_fields__", getattr(request, "__dataclass_fields__", ())):
            kwargs["expected_checksums"] = checksums  # every TP rank re-checks each tensor's SHA-256
        result = await tm.load_lora_adapter_from_tensors(request(**kwargs), None)
        return None if result.success else str(result.error_message)


def managed_prefix_of(hooks: Any) -> str:
    """The names the engine protects (its patch's managed prefix)."""
    prefix = getattr(hooks, "managed_prefix", None)
    return prefix() if callable(prefix) else MANAGED_PREFIX


def max_loaded_loras(tm: Any) -> Any:
    get_lora = type(tm)._resolve_lora_path.__globals__.get("get_lora")
    if get_lora is not None:  # 0.5.23 keeps LoRA settings in their own config
        return get_lora().max_loaded_loras
    return tm.server_args.max_loaded_loras


def for_server(tokenizer_manager: Callable[[], Any], incarnation: str) -> EngineStaging:
    """The staging of a patched SGLang server (both forms of the patch build it this way). Its stash
    is freed when the server's process exits normally; after a kill, by the next life on the host."""
    import atexit

    staging = EngineStaging(SGLangHooks(tokenizer_manager), incarnation=incarnation)
    atexit.register(staging.close)
    return staging


async def starlette_receive(staging: EngineStaging, request: Any) -> tuple[int, dict[str, Any]]:
    """A bucket from a Starlette/FastAPI request (SGLang's server): streamed, never buffered twice."""
    length = request.headers.get("content-length")
    return await staging.receive(dict(request.query_params), request.stream(),
                                 int(length) if length and length.isdigit() else None)


async def starlette_json(request: Any) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None
