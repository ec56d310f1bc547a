"""The byte-level pieces both stores share: checksums bound to a record's place, pickled
encoding, file and folder syncs, and a pause of the garbage collector while a slice is encoded."""

from __future__ import annotations

import gc
import hashlib
import os
import pickle
from typing import Any

__all__ = ["CollectorPaused", "checksum", "encode", "fdatasync", "fsync_dir", "key", "size"]


def checksum(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def encode(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)



class CollectorPaused:
    """Slice and encode a part of a snapshot without starting a garbage collection.

    A slice allocates short-lived objects (its item tuples, attrs' getstate dict per
    record) and frees them all once encoded: no cycle is made. Left on, the collector
    would run meanwhile, and with a large state each young-generation pass walks the whole
    young persistent map (pyrsistent's vector reports every element to the collector):
    tens of milliseconds at 100k sessions.
    """

    def __enter__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            gc.enable()



def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



fdatasync = getattr(os, "fdatasync", os.fsync)  # data only where the platform has it: the size never changes


def size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def key(kind: str, *numbers: int) -> bytes:
    """What a record's checksum binds it to besides its bytes: its place in the store."""
    return kind.encode() + b"".join(n.to_bytes(8, "big", signed=True) for n in numbers)
