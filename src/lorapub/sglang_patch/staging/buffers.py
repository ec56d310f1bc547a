"""Where a bucket's bytes live on the engine (:class:`Buffer`), and the check every bucket passes.

A buffer is an anonymous mapping, a read-only mapping of the publisher's shared-memory bucket file
(no copy at all), a window of the adapter's own safetensors file on the engine's disk (a ``dir``
load: received, verified and loaded in place), or a uint8 torch tensor in shared memory when the
load form hands tensors to SGLang's scheduler processes. No state of the staging lives here.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

from lorapub.core.manifest import Bucket
from lorapub.wire.refusal import refuse
from lorapub.wire.safetensors import verify_spans

__all__ = ["Buffer", "NOFOLLOW", "close_all", "verify_and_keep"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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

            # torch's stubs leave Tensor.share_memory_ unannotated
            self.tensor = torch.empty(nbytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
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
        fd = os.open(path, os.O_RDWR | NOFOLLOW)  # never created: a removed folder stays removed
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
    def free() -> None:
        for b in buffers:
            b.close()

    if buffers:
        threading.Thread(target=free, name="lorapub-stash-free", daemon=True).start()


def verify_and_keep(buf: memoryview, spans: list[tuple[int, int]], bucket: Bucket,
                    into: tuple[str, int] | None) -> None:
    """Check the bucket (:func:`verify_spans`). With ``into`` (file, offset), its tensors are copied
    there, back to back in plan order, through a shared mapping of that file region (a ``write`` into
    a disk file's page cache costs several times more here), and the copy is what is checked, each
    tensor on the hash threads as it is copied. The file is opened, never created: a folder a cleanup
    removed stays removed."""
    if into is None:
        verify_spans(buf, spans, bucket)
        return
    path, at = into
    try:
        window = Buffer.file_window(path, at, bucket.nbytes)
    except OSError as e:
        raise refuse(f"writing bucket {bucket.index} into the engine's folder failed: {e}", "STAGE_DISK") from None
    try:
        verify_spans(buf, spans, bucket, window.view)
    finally:
        window.close()
