"""Where an attempt's bytes land on the engine, and what its ``end`` hands SGLang's load:
:class:`Stash`, the I/O side of one staged attempt (the machine keeps its state).
See docs/design.md, "Engine-side staging".
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import threading
from typing import TYPE_CHECKING, Any, Mapping, NotRequired, TypedDict

from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.sglang_patch.staging.buffers import NOFOLLOW, Buffer, close_all
from lorapub.wire.dtypes import SAFETENSORS_DTYPES
from lorapub.wire.messages import ShmControl, StageReply
from lorapub.wire.refusal import bad, refuse
from lorapub.wire.safetensors import raw_spans

if TYPE_CHECKING:  # torch is imported only where a torch transport is used
    from torch._C._distributed_c10d import Backend, PrefixStore, TCPStore

__all__ = ["Group", "Stash", "finish_peft_dir", "from_shm", "landing", "prepare_peft_file", "release_buckets",
           "tensors"]


class Group(TypedDict):
    """An attempt's torch process group (the torch transport): ``done`` is set once its ``store`` was
    reached, or not (``error``); ``pg`` forms at the first bucket, with ``ranks`` (rank, world, src);
    ``prefixed``: the attempt's keys on the store."""

    done: threading.Event
    store: TCPStore | None
    pg: Backend | None
    error: str | None
    ranks: tuple[int, int, int] | None
    prefixed: NotRequired[PrefixStore]


class Stash:
    """What one staged attempt keeps on the engine, its I/O side (the machine keeps its state):
    ``lock`` (what its operations take), ``buckets`` (index -> buffer and the spans of its
    tensors), ``verifying`` (index -> its running SHA-256 check), ``inflight`` (index -> its running
    collective), ``folder`` and ``peft`` (a dir load: its safetensors file, bucket -> offset) and
    ``group`` (the torch transport: its store and, once formed, its process group).

    A ``dir`` load receives each bucket straight into its place in the adapter's safetensors file on
    the engine's disk (an ``shm`` bucket is mapped, verified, then copied there), so the folder is
    complete when the last bucket is checked; a ``tensors`` load lands in shared memory SGLang's
    scheduler maps (for ``shm``: the publisher's own pages, no copy)."""

    def __init__(self, token: AttemptToken, plan: BucketPlan, transport: Mapping[str, Any], load: str) -> None:
        self.token, self.plan, self.transport, self.load = token, plan, dict(transport), load
        self.lock = asyncio.Lock()
        self.buckets: dict[int, tuple[Buffer, list[tuple[int, int]]]] = {}
        self.verifying: dict[int, asyncio.Future[None]] = {}
        self.inflight: dict[int, asyncio.Future[StageReply]] = {}
        self.folder: str | None = None
        self.peft: tuple[str, dict[int, int]] | None = None
        self.group: Group | None = None

    @property
    def held_bytes(self) -> int:
        return sum(buf.nbytes for buf, _ in self.buckets.values())


def prepare_peft_file(stash: Stash, folder: str, header: bytes) -> None:
    """A ``dir`` load's folder on the engine's disk: the safetensors file with its header, sized for
    every tensor (a few KB of I/O here: the file is sparse until written). Each bucket is received
    into its own region of it and verified there, so ``end`` only adds the config."""
    path = os.path.join(folder, "adapter")
    shutil.rmtree(folder, ignore_errors=True)
    stash.folder = folder
    os.makedirs(path)
    file = os.path.join(path, "adapter_model.safetensors")
    with open(file, "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(b.nbytes for b in stash.plan.buckets))
    offsets, at = {}, len(header)
    for b in stash.plan.buckets:  # the file holds the plan's tensors back to back, in plan order
        offsets[b.index] = at
        at += b.nbytes
    stash.peft = (file, offsets)


def finish_peft_dir(stash: Stash) -> str:
    """The folder SGLang loads: its tensors are in place already; the config is added now."""
    assert stash.peft is not None
    path = os.path.dirname(stash.peft[0])
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write(stash.plan.serving_config_json)
    return path


def landing(stash: Stash, bucket: Bucket) -> Buffer:
    """Where a bucket's bytes are received (off the event loop: this maps and reserves memory):
    for a ``dir`` load its window of the adapter's file (received, verified and loaded in place);
    for a ``tensors`` load shared tensor memory; else an anonymous mapping, populated at once."""
    if stash.peft is not None:
        try:
            return Buffer.file_window(stash.peft[0], stash.peft[1][bucket.index], bucket.nbytes)
        except OSError as e:
            raise refuse(f"bucket {bucket.index} cannot be placed in the engine's folder: {e}", "STAGE_DISK") from None
    return Buffer(bucket.nbytes, stash.load == "tensors", populate=True)


def from_shm(stash: Stash, bucket: Bucket, control: Mapping[str, Any],
             shm_dir: str) -> tuple[Buffer, list[tuple[int, int]]]:
    """A bucket the publisher wrote once, for every engine on its host, into a shared-memory file."""
    shared = stash.load == "tensors"
    name = ShmControl.from_json(control).name
    path = os.path.join(shm_dir, name)
    try:  # read-write only where torch maps the file for SGLang's scheduler (it maps pages writable)
        fd = os.open(path, (os.O_RDWR if shared else os.O_RDONLY) | NOFOLLOW)
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
            buf, got = landing(stash, bucket), 0
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
            # (mapped populated: one call maps every page, instead of a fault per page in the hash threads)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            buf = Buffer(size, False, mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ))
        return buf, raw_spans(bucket)
    finally:
        os.close(fd)


def tensors(stash: Stash) -> dict[str, Any]:
    """The plan's tensors as torch tensors viewing the staged bytes (no copy), for SGLang's tensor load."""
    import torch

    dtypes = {name: getattr(torch, name) for name in SAFETENSORS_DTYPES}
    out = {}
    for bucket in stash.plan.buckets:
        buf, spans = stash.buckets[bucket.index]
        for (start, end), e in zip(spans, bucket.entries):
            if buf.tensor is not None:  # a view of the shared bucket tensor: no copy
                raw = buf.tensor[start : start + e.nbytes]
            else:
                view = buf.view[start:end]
                raw = torch.frombuffer(view, dtype=torch.uint8) if e.nbytes else torch.empty(0, dtype=torch.uint8)
            out[e.name] = raw.view(dtypes[e.dtype]).reshape(e.shape)
    return out


def release_buckets(stash: Stash) -> None:
    """The staged bytes go: every check cancelled, every buffer closed (off the event loop)."""
    for check in stash.verifying.values():
        check.cancel()
    stash.verifying.clear()
    close_all([buf for buf, _ in stash.buckets.values()])
    stash.buckets.clear()
