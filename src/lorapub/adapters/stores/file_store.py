"""FileStore: the whole state in one file, rewritten (write, fsync, rename) on every decision."""

from __future__ import annotations

import os
import pickle
import tempfile
from typing import Any

from lorapub.core.commands import Command
from lorapub.errors import StoreCorrupted, StoreError

from .records import checksum, encode, fsync_dir

__all__ = ["FileStore", "looks_like_file_store"]

_FILE_MAGIC = b"LORAPUB-FILESTORE/1\n"
_FILE_HEAD = len(_FILE_MAGIC) + 16  # the magic and the body's checksum


class FileStore:
    """The whole state in one file, replaced atomically (write, fsync, rename) on every save.

    The file is ``MAGIC + blake2b(pickle) + pickle``; a plain pickle (what earlier
    releases wrote) is still read.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as e:
            raise StoreError(f"registry store {self.path}: cannot create its folder: {e}") from None

    def load(self) -> Any | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"registry store {self.path}: cannot read it: {e}") from None
        if len(data) < _FILE_HEAD:
            # the store never leaves a partial file (it writes a temporary one and renames it), and
            # no registry state pickles to so few bytes: the file was cut short or overwritten
            raise StoreCorrupted(
                f"registry store {self.path}: the file is {'empty (cut to nothing)' if not data else f'{len(data)} bytes'}"
                f", shorter than a FileStore header ({_FILE_HEAD} bytes): it was cut short or overwritten; restore "
                f"it from a copy, or move it away to start a new store"
            )
        if data.startswith(_FILE_MAGIC):
            head = len(_FILE_MAGIC)
            digest, body = data[head:head + 16], data[head + 16:]
            if checksum(body) != digest:
                raise StoreCorrupted(
                    f"registry store {self.path}: checksum mismatch ({len(data)} bytes; truncated or overwritten)"
                )
        else:
            body = data  # a plain pickle from an earlier release: no checksum to verify
        try:
            return pickle.loads(body)
        except Exception as e:  # any unpickling failure means the bytes are not what was saved
            raise StoreCorrupted(f"registry store {self.path}: cannot decode it: {type(e).__name__}: {e}") from None

    def save(self, state: Any, command: Command | None = None) -> None:
        """Replace the file with ``state``; ``command`` is not needed (the whole state is kept)."""
        try:
            body = encode(state)
        except Exception as e:
            raise StoreError(f"registry store {self.path}: cannot encode the state: {type(e).__name__}: {e}") from None
        tmp = None
        try:
            # write-then-rename: a crash leaves either the old state or the new one, never half
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".registry-")
            with os.fdopen(fd, "wb") as f:
                f.write(_FILE_MAGIC + checksum(body) + body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
            fsync_dir(os.path.dirname(self.path))
        except OSError as e:
            raise StoreError(f"registry store {self.path}: save failed, state not stored: {e}") from None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def close(self) -> None:
        pass


def looks_like_file_store(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_FILE_MAGIC))
    except OSError:
        return False
    return head == _FILE_MAGIC or head[:1] == b"\x80"  # FileStore's header, or an older plain pickle
