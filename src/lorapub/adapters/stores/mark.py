"""The high-water mark: the last acknowledged log record, kept outside SQLite.

SQLite's WAL recovery stops at the first frame that fails its checksum and drops every later
frame, so a damaged (or cut) log reopens without error, holding fewer decisions than were
acknowledged; only something outside the log can tell. One fixed-size record, rewritten in place.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
import time
import urllib.parse
from typing import Callable

import attrs

from lorapub.errors import StoreCorrupted, StoreError

from . import records
from .records import checksum, fsync_dir, size

__all__ = ["HighWaterMark", "Mark", "NO_TAG"]

log = logging.getLogger("lorapub.adapters.stores")

MAGIC = b"LORAPUB-MARK/1\n\x00"
SIZE = len(MAGIC) + 8 + 16 + 16  # magic, seq, tag, checksum
NO_TAG = bytes(16)


@attrs.frozen
class Mark:
    seq: int  # the last log record committed (or snapshot taken) when the mark was written
    tag: bytes  # that record's checksum as committed; NO_TAG where no record was logged yet

    def encode(self) -> bytes:
        body = MAGIC + self.seq.to_bytes(8, "big", signed=True) + self.tag
        return body + checksum(b"mark", body)

    @classmethod
    def decode(cls, data: bytes) -> "Mark | None":
        body, check = data[:-16], data[-16:]
        if len(data) != SIZE or not body.startswith(MAGIC) or checksum(b"mark", body) != check:
            return None
        head = len(MAGIC)
        return cls(int.from_bytes(body[head:head + 8], "big", signed=True), body[head + 8:])


class HighWaterMark:
    """``<store>-mark`` beside one SQLite store: read and checked when the store opens, written
    (``pwrite``) after every commit and fsynced at least every ``sync_every`` seconds."""

    def __init__(self, store_path: str, sync_every: float) -> None:
        self.store_path = store_path
        self.path = store_path + "-mark"
        self.sync_every = sync_every
        self.fd: int | None = None
        self.synced = 0.0  # time.monotonic() of the last fsync
        self.failed: OSError | None = None  # the write after the last commit failed

    def read(self) -> Mark | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read(SIZE + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"registry store {self.store_path}: cannot read its mark {self.path}: {e}") from None
        mark = Mark.decode(data)
        if mark is None:
            raise StoreCorrupted(
                f"registry store {self.store_path}: its mark {self.path} is damaged ({len(data)} bytes that fail "
                f"their check), so whether the store still holds every acknowledged decision cannot be told; "
                f"restore the mark from a copy, or move it away to accept the store as it is (a new mark is then "
                f"written from what it holds)"
            )
        return mark

    def verify(self, mark: Mark, open_error: Callable[[BaseException], StoreError]) -> None:
        """Refuse a store holding less than its mark says was acknowledged. Read through a read-only
        connection: closing a writable one would checkpoint what SQLite recovered into the file and
        delete the damaged log, so the damage is left exactly as found."""
        store = self.store_path
        shm = store + "-shm"
        had_shm = os.path.exists(shm)
        probe = None
        try:
            probe = sqlite3.connect(f"file:{urllib.parse.quote(store)}?mode=ro", uri=True, isolation_level=None,
                                    check_same_thread=False, timeout=0)
            tables = {r[0] for r in probe.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                held, tag = None, None
            elif not {"log", "snapshots"} <= tables:
                return  # not a registry log at all: the schema check says so
            else:
                held = max(probe.execute("SELECT COALESCE(MAX(seq), 0) FROM log").fetchone()[0],
                           probe.execute("SELECT COALESCE(MAX(snap), 0) FROM snapshots").fetchone()[0])
                row = probe.execute("SELECT CAST(checksum AS BLOB) FROM log WHERE seq=?", (mark.seq,)).fetchone()
                tag = bytes(row[0]) if row else None
        except sqlite3.Error as e:
            raise open_error(e) from None
        finally:
            if probe is not None:
                probe.close()
            if not had_shm:
                try:
                    os.unlink(shm)  # the read-only connection's shared index; the store's own runs in memory
                except OSError:
                    pass
        wal = f"{store}-wal ({size(store + '-wal') or 0} bytes)"
        if held is None or held < mark.seq:
            what = "holds no registry log" if held is None else f"holds decisions up to record {held}"
            first = (held or 0) + 1
            missing = f"records {first} to {mark.seq} are" if first < mark.seq else f"record {mark.seq} is"
            raise StoreCorrupted(
                f"registry store {store}: {what}, but decisions up to record {mark.seq} were acknowledged "
                f"(its mark {self.path}): {missing} missing. Its write-ahead log {wal} was damaged or "
                f"cut short (SQLite drops every frame after the first bad one) or the store was replaced by an "
                f"older copy. Restore the store from a copy holding them, or move the mark away to accept the "
                f"store as it is, losing those decisions"
            )
        if tag is not None and mark.tag != NO_TAG and tag != mark.tag:
            raise StoreCorrupted(
                f"registry store {store}: log record {mark.seq} is not the one acknowledged (its checksum "
                f"differs from the one in its mark {self.path}): the store was rewritten or replaced by "
                f"another one; restore it from a copy, or move the mark away to accept it as it is"
            )

    def open(self, now: Mark, found: Mark | None) -> None:
        """Bring the mark up to ``now``, what the store holds (it may be a commit behind: written
        after the commit, by a process that died between the two; or missing: an earlier
        release's store)."""
        self.close()
        if found is None:  # written whole, then renamed into place: never a partial mark
            folder = os.path.dirname(self.path)
            tmp: str | None
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".registry-mark-")
            try:
                os.write(fd, now.encode())
                os.fsync(fd)
                os.close(fd)
                fd = -1
                os.replace(tmp, self.path)
                tmp = None
                fsync_dir(folder)
            finally:
                if fd >= 0:
                    os.close(fd)
                if tmp is not None:
                    os.unlink(tmp)
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if found is not None:  # synced now whatever it held: a killed writer may have left it unsynced
                if found != now:
                    os.pwrite(fd, now.encode(), 0)
                records.fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.synced, self.failed = fd, time.monotonic(), None  # fsync pacing: disk I/O, real time

    def put(self, now: Mark, sync: bool = False) -> None:
        """After a commit: the mark says ``now`` is committed. A failure cannot undo the commit
        (it is durable and its reply is due), so it is kept in ``failed`` and the store's next
        save refuses until the mark can be written again."""
        try:
            if self.fd is None:
                raise OSError("the mark is not open")
            os.pwrite(self.fd, now.encode(), 0)
            t = time.monotonic()  # fsync pacing: disk I/O, real time
            if sync or t - self.synced >= self.sync_every:
                records.fdatasync(self.fd)
                self.synced = t
            self.failed = None
        except OSError as e:
            if self.failed is None:
                log.warning("registry store %s: cannot write its mark %s: %s", self.store_path, self.path, e)
            self.failed = e

    def close(self) -> None:
        if self.fd is not None:
            try:
                records.fdatasync(self.fd)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
