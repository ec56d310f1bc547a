"""Registry stores: where the single writer keeps its state between calls.

* ``MemoryStore`` (in :mod:`lorapub.runtime.registry`) is the default: the state lives
  as long as the process.
* :class:`SQLiteStore` is the recommended durable store. It keeps a **command log**
  (each applied command, pickled with a checksum, committed before its reply leaves)
  plus **snapshots** written a slice at a time; loading is the latest snapshot plus a
  replay of the later commands through the pure core, which is deterministic, so the
  state is the one the registry had. A decision costs one small insert and one commit,
  whatever the number of sessions. A high-water mark beside it (``<path>-mark``) turns a
  write-ahead log that lost acknowledged decisions (damaged or cut after a crash: SQLite
  drops every frame after the first bad one, silently) into ``StoreCorrupted``.
* :class:`FileStore` pickles and fsyncs the whole state on every decision (write, fsync,
  rename). Simple, but a decision costs O(state): fine for small registries, and it reads
  the files it wrote before.

Every failure is typed: a store that cannot be read or written raises
:class:`~lorapub.errors.StoreError`, one whose contents fail their integrity check
raises :class:`~lorapub.errors.StoreCorrupted`; both name the file. A failed ``save``
leaves the previously saved state as the durable one.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import math
import os
import pickle
import sqlite3
import tempfile
import time
import urllib.parse
from typing import Any, Iterator

import attrs
from pyrsistent import PMap, pmap

from lorapub.core import registry as R
from lorapub.core.commands import Command
from lorapub.core.registry import RegistryState
from lorapub.core.session_table import SessionTable
from lorapub.errors import InvalidInput, LorapubError, StoreCorrupted, StoreError

__all__ = ["FileStore", "SQLiteStore"]

log = logging.getLogger(__name__)


def _checksum(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def _encode(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


class _CollectorPaused:
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


# -- FileStore: the whole state, rewritten on every decision ---------------------------------
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
            if _checksum(body) != digest:
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
            body = _encode(state)
        except Exception as e:
            raise StoreError(f"registry store {self.path}: cannot encode the state: {type(e).__name__}: {e}") from None
        tmp = None
        try:
            # write-then-rename: a crash leaves either the old state or the new one, never half
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".registry-")
            with os.fdopen(fd, "wb") as f:
                f.write(_FILE_MAGIC + _checksum(body) + body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
            _fsync_dir(os.path.dirname(self.path))
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- SQLiteStore: command log + snapshots written a slice at a time --------------------------
SCHEMA = "lorapub.registry.log/1"
#: Default for ``SQLiteStore(mark_sync_every=)``: seconds between fsyncs of the high-water mark.
MARK_SYNC_EVERY = 1.0

_TABLES = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # one row per applied command; seq is dense from 1
    "CREATE TABLE log (seq INTEGER PRIMARY KEY, record BLOB NOT NULL, checksum BLOB NOT NULL)",
    # part 0: the state with its maps emptied; parts 1..: (field, [(key, value), ...])
    "CREATE TABLE snapshot_parts (snap INTEGER NOT NULL, part INTEGER NOT NULL, record BLOB NOT NULL,"
    " checksum BLOB NOT NULL, PRIMARY KEY (snap, part))",
    # a row here means every part of snapshot `snap` (the state after log record `snap`) is written
    "CREATE TABLE snapshots (snap INTEGER PRIMARY KEY, parts INTEGER NOT NULL)",
)

_CORRUPT_CODES = {"SQLITE_CORRUPT", "SQLITE_NOTADB"}
_MIN_DB_BYTES = 512  # SQLite's smallest page: a database file that is not empty holds one page at least
_PARTS_PER_COLLECT = 8  # snapshot parts (each up to a few tens of kB) deleted per decision


def _create_tables(db: sqlite3.Connection) -> None:
    for ddl in _TABLES:
        db.execute(ddl)
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA,))


# The high-water mark: the last acknowledged log record, kept outside SQLite. SQLite's WAL
# recovery stops at the first frame that fails its checksum and drops every later frame, so a
# damaged (or cut) log reopens without error, holding fewer decisions than were acknowledged;
# only something outside the log can tell. One fixed-size record, rewritten in place.
_MARK_MAGIC = b"LORAPUB-MARK/1\n\x00"
_MARK_SIZE = len(_MARK_MAGIC) + 8 + 16 + 16  # magic, seq, tag, checksum
_NO_TAG = bytes(16)


@attrs.frozen
class _Mark:
    seq: int  # the last log record committed (or snapshot taken) when the mark was written
    tag: bytes  # that record's checksum as committed; _NO_TAG where no record was logged yet

    def encode(self) -> bytes:
        body = _MARK_MAGIC + self.seq.to_bytes(8, "big", signed=True) + self.tag
        return body + _checksum(b"mark", body)

    @classmethod
    def decode(cls, data: bytes) -> "_Mark | None":
        body, check = data[:-16], data[-16:]
        if len(data) != _MARK_SIZE or not body.startswith(_MARK_MAGIC) or _checksum(b"mark", body) != check:
            return None
        head = len(_MARK_MAGIC)
        return cls(int.from_bytes(body[head:head + 8], "big", signed=True), body[head + 8:])


_fdatasync = getattr(os, "fdatasync", os.fsync)  # data only where the platform has it: the size never changes


def _snapshot_parts(state: RegistryState, entries: int) -> Iterator[Any]:
    """The state in slices: its maps emptied first, then ``entries`` map items per slice
    (the session table's items as its atoms: tuples of str/int/float, no objects to rebuild).

    The state is immutable, so iterating it across many later decisions is safe."""
    maps = [f.name for f in attrs.fields(type(state)) if isinstance(getattr(state, f.name), (PMap, SessionTable))]
    yield attrs.evolve(state, **{name: pmap() for name in maps})
    for name in maps:
        value = getattr(state, name)
        items = iter(value.atoms() if isinstance(value, SessionTable) else value.items())
        while chunk := list(itertools.islice(items, entries)):
            yield (name, chunk)


class _Build:
    """A snapshot being written, one part per logged command, after the command's record."""

    def __init__(self, snap: int, state: RegistryState, entries: int) -> None:
        self.snap = snap
        self.parts = _snapshot_parts(state, entries)
        self.written = 0  # parts committed
        self.ready: bytes | None = None  # the next part, encoded, not yet committed
        self.exhausted = False

    def next_part(self) -> bytes | None:
        if self.ready is None and not self.exhausted:
            with _CollectorPaused():
                item = next(self.parts, None)
                if item is None:
                    self.exhausted = True
                else:
                    self.ready = _encode(item)
                del item
        return self.ready


class SQLiteStore:
    """The recommended durable store: an append-only command log with snapshots, in SQLite.

    ``save(state, command)`` appends ``command`` (pickled, with a checksum over its sequence
    number and bytes) and commits before it returns: SQLite in WAL mode with
    ``synchronous=FULL``, so the commit is on disk. Its cost does not depend on the size of
    the state. ``load()`` reads the latest complete snapshot and replays every later command
    through :func:`lorapub.core.registry.handle`.

    Compaction is spread over the hot path: once ``snapshot_every`` commands were logged
    since the last snapshot, the current (immutable) state is captured and written
    ``part_entries`` map items per later decision, in the same transaction as that
    decision's record; when its last part is in, the snapshot is complete and the log
    records it covers are deleted, ``gc_batch`` at a time. A crash mid-snapshot loses only
    the unfinished snapshot. ``save(state)`` with no command writes a whole snapshot at once
    (a checkpoint: used for a new store).

    The file is locked for the store's life (SQLite's exclusive locking mode): a second
    registry opening it gets a :class:`~lorapub.errors.StoreError`, never a shared log.

    Beside it, ``<path>-mark`` holds the **high-water mark**: the sequence number and checksum of
    the last committed record, rewritten in place after every commit. SQLite recovers a damaged
    write-ahead log silently, keeping only the frames before the first bad one; opening a store
    that holds less than its mark says was acknowledged raises
    :class:`~lorapub.errors.StoreCorrupted` instead (checked on a read-only connection, so the
    damaged log is left as it was found). The mark is written (``pwrite``) before ``save``
    returns, so a killed process leaves it exact; it is fsynced after the first commit at least
    ``mark_sync_every`` seconds after its previous fsync, and on ``close`` (0: after every
    commit, a second fsync per commit). A missing mark (a store written by an earlier release)
    is accepted and written from what the store holds; a damaged one is ``StoreCorrupted``.
    """

    def __init__(
        self, path: str, *, snapshot_every: int = 10_000, part_entries: int = 256, gc_batch: int = 1_000,
        mark_sync_every: float = MARK_SYNC_EVERY,
    ) -> None:
        if snapshot_every < 1 or part_entries < 1 or gc_batch < 1:
            raise InvalidInput(
                f"SQLiteStore: snapshot_every, part_entries and gc_batch must be >= 1, got {snapshot_every!r}, "
                f"{part_entries!r}, {gc_batch!r}"
            )
        if isinstance(mark_sync_every, bool) or not isinstance(mark_sync_every, (int, float)) or not (
                0 <= mark_sync_every < math.inf):
            raise InvalidInput(
                f"SQLiteStore: mark_sync_every must be a finite number of seconds >= 0 (0: fsync the mark after "
                f"every commit), got {mark_sync_every!r}"
            )
        self.path = os.path.abspath(path)
        self.mark_path = self.path + "-mark"
        self.snapshot_every = snapshot_every
        self.part_entries = part_entries
        self.gc_batch = gc_batch
        self.mark_sync_every = mark_sync_every
        self._db: sqlite3.Connection | None = None
        self._mark_fd: int | None = None
        self._mark_synced = 0.0  # time.monotonic() of the mark's last fsync
        self._mark_failed: OSError | None = None  # the mark write after the last commit failed
        self._tag = _NO_TAG  # checksum of log record _seq as committed
        self._seq = 0  # last committed log record
        self._snap = -1  # latest complete snapshot (-1: none)
        self._build: _Build | None = None
        self._garbage = False  # log records or parts older than the latest snapshot may remain

    # -- connection ------------------------------------------------------------------------
    def _error(self, what: str, e: BaseException) -> StoreError:
        name = getattr(e, "sqlite_errorname", "")
        if name in _CORRUPT_CODES:
            return StoreCorrupted(f"registry store {self.path}: {what}: {e}")
        if name in {"SQLITE_BUSY", "SQLITE_LOCKED"}:
            return StoreError(f"registry store {self.path}: {what}: locked by another registry ({e})")
        return StoreError(f"registry store {self.path}: {what}: {type(e).__name__}: {e}")

    def _open(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as e:
            raise StoreError(f"registry store {self.path}: cannot create its folder: {e}") from None
        mark = self._read_mark()
        size = _size(self.path)
        if size is None:
            if mark is not None:
                raise StoreCorrupted(
                    f"registry store {self.path} is missing, but its mark {self.mark_path} says decisions up to "
                    f"{mark.seq} were acknowledged; restore the store beside it, or move the mark away to start "
                    f"a new store"
                )
            if _size(self.path + "-wal"):
                # SQLite would replay the log onto a new, empty file: pages it never held would be missing
                raise StoreCorrupted(
                    f"registry store {self.path} is missing but its write-ahead log {self.path}-wal is there; "
                    f"restore the store beside it, or move the log away to start a new store"
                )
            self._create()
        elif size < _MIN_DB_BYTES:
            # SQLite would take an empty file (or, for one byte, a cut one) for a new database and the
            # registry would start afresh. A store is never created in place (see _create) and a
            # database that is not empty holds at least one whole page: this file was cut short.
            raise StoreCorrupted(
                f"registry store {self.path}: the file is {'empty (cut to nothing)' if not size else f'{size} bytes'}"
                f", shorter than the smallest SQLite database (one {_MIN_DB_BYTES}-byte page): it was cut short or "
                f"overwritten; restore it from a copy, or move it away (with its -wal file) to start a new store"
            )
        if mark is not None:
            self._verify_mark(mark)
        db = None
        try:
            # mode=rw: open the file that was checked, never create one in its place
            db = sqlite3.connect(f"file:{urllib.parse.quote(self.path)}?mode=rw", uri=True, isolation_level=None,
                                 check_same_thread=False, timeout=0)
            db.execute("PRAGMA locking_mode=EXCLUSIVE")  # before WAL: no shared memory, one owner
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise StoreError(f"registry store {self.path}: SQLite refused WAL mode (got {mode})")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")  # take the lock now, not at the first decision
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:  # a database with no tables (an earlier release's creation cut short): adopt it
                _create_tables(db)
            db.execute("COMMIT")
            check = db.execute("PRAGMA quick_check").fetchall()
            if check != [("ok",)]:
                raise StoreCorrupted(f"registry store {self.path}: integrity check failed: {check[:3]}")
            self._check_schema(db)
            self._seq = max(
                db.execute("SELECT COALESCE(MAX(seq), 0) FROM log").fetchone()[0],
                db.execute("SELECT COALESCE(MAX(snap), 0) FROM snapshots").fetchone()[0],
            )
            self._snap = db.execute("SELECT COALESCE(MAX(snap), -1) FROM snapshots").fetchone()[0]
            row = db.execute("SELECT CAST(checksum AS BLOB) FROM log WHERE seq=?", (self._seq,)).fetchone()
            self._tag = bytes(row[0]) if row else mark.tag if mark is not None and mark.seq == self._seq else _NO_TAG
            self._open_mark(mark)
        except LorapubError:
            if db is not None:
                db.close()
            raise
        except (sqlite3.Error, OSError) as e:
            if db is not None:
                db.close()
            raise self._open_error(e) from None
        self._db = db
        self._build = None
        self._garbage = True
        return db

    def _open_error(self, e: BaseException) -> StoreError:
        if _looks_like_file_store(self.path):
            return StoreCorrupted(
                f"registry store {self.path}: this is a FileStore file (a pickled state), not a "
                f"SQLiteStore; open it with FileStore (RayRegistry.create(store_factory=functools.partial("
                f"FileStore, path))) or give the SQLiteStore a new path"
            )
        return self._error("cannot open it", e)

    # -- the high-water mark ---------------------------------------------------------------
    def _read_mark(self) -> _Mark | None:
        try:
            with open(self.mark_path, "rb") as f:
                data = f.read(_MARK_SIZE + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"registry store {self.path}: cannot read its mark {self.mark_path}: {e}") from None
        mark = _Mark.decode(data)
        if mark is None:
            raise StoreCorrupted(
                f"registry store {self.path}: its mark {self.mark_path} is damaged ({len(data)} bytes that fail "
                f"their check), so whether the store still holds every acknowledged decision cannot be told; "
                f"restore the mark from a copy, or move it away to accept the store as it is (a new mark is then "
                f"written from what it holds)"
            )
        return mark

    def _verify_mark(self, mark: _Mark) -> None:
        """Refuse a store holding less than its mark says was acknowledged. Read through a read-only
        connection: closing a writable one would checkpoint what SQLite recovered into the file and
        delete the damaged log, so the damage is left exactly as found."""
        shm = self.path + "-shm"
        had_shm = os.path.exists(shm)
        probe = None
        try:
            probe = sqlite3.connect(f"file:{urllib.parse.quote(self.path)}?mode=ro", uri=True, isolation_level=None,
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
            raise self._open_error(e) from None
        finally:
            if probe is not None:
                probe.close()
            if not had_shm:
                try:
                    os.unlink(shm)  # the read-only connection's shared index; the store's own runs in memory
                except OSError:
                    pass
        wal = f"{self.path}-wal ({_size(self.path + '-wal') or 0} bytes)"
        if held is None or held < mark.seq:
            what = "holds no registry log" if held is None else f"holds decisions up to record {held}"
            first = (held or 0) + 1
            missing = f"records {first} to {mark.seq} are" if first < mark.seq else f"record {mark.seq} is"
            raise StoreCorrupted(
                f"registry store {self.path}: {what}, but decisions up to record {mark.seq} were acknowledged "
                f"(its mark {self.mark_path}): {missing} missing. Its write-ahead log {wal} was damaged or "
                f"cut short (SQLite drops every frame after the first bad one) or the store was replaced by an "
                f"older copy. Restore the store from a copy holding them, or move the mark away to accept the "
                f"store as it is, losing those decisions"
            )
        if tag is not None and mark.tag != _NO_TAG and tag != mark.tag:
            raise StoreCorrupted(
                f"registry store {self.path}: log record {mark.seq} is not the one acknowledged (its checksum "
                f"differs from the one in its mark {self.mark_path}): the store was rewritten or replaced by "
                f"another one; restore it from a copy, or move the mark away to accept it as it is"
            )

    def _open_mark(self, mark: _Mark | None) -> None:
        """Bring the mark up to what the store holds (it may be a commit behind: written after the
        commit, by a process that died between the two; or missing: an earlier release's store)."""
        self._close_mark()
        now = _Mark(self._seq, self._tag)
        if mark is None:  # written whole, then renamed into place: never a partial mark
            folder = os.path.dirname(self.mark_path)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".registry-mark-")
            try:
                os.write(fd, now.encode())
                os.fsync(fd)
                os.close(fd)
                fd = -1
                os.replace(tmp, self.mark_path)
                tmp = None
                _fsync_dir(folder)
            finally:
                if fd >= 0:
                    os.close(fd)
                if tmp is not None:
                    os.unlink(tmp)
        fd = os.open(self.mark_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            if mark is not None:  # synced now whatever it held: a killed writer may have left it unsynced
                if mark != now:
                    os.pwrite(fd, now.encode(), 0)
                _fdatasync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._mark_fd, self._mark_synced, self._mark_failed = fd, time.monotonic(), None

    def _put_mark(self, sync: bool = False) -> None:
        """After a commit: the mark says what is now committed. A failure cannot undo the commit
        (it is durable and its reply is due), so it is kept and the next save refuses until the
        mark can be written again."""
        try:
            if self._mark_fd is None:
                raise OSError("the mark is not open")
            os.pwrite(self._mark_fd, _Mark(self._seq, self._tag).encode(), 0)
            now = time.monotonic()
            if sync or now - self._mark_synced >= self.mark_sync_every:
                _fdatasync(self._mark_fd)
                self._mark_synced = now
            self._mark_failed = None
        except OSError as e:
            if self._mark_failed is None:
                log.warning("registry store %s: cannot write its mark %s: %s", self.path, self.mark_path, e)
            self._mark_failed = e

    def _close_mark(self) -> None:
        if self._mark_fd is not None:
            try:
                _fdatasync(self._mark_fd)
            except OSError:
                pass
            os.close(self._mark_fd)
            self._mark_fd = None

    def _create(self) -> None:
        """Make a new store. SQLite creates a database file empty and writes it later, so a process
        that died meanwhile would leave an empty file at the path (refused when opened: it cannot be
        told from a store cut to nothing). The store is built beside its path instead, its tables
        committed and checkpointed, then linked into place: the path never holds a partial store."""
        folder = os.path.dirname(self.path)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".registry-new-", suffix=".db")
            os.close(fd)
            db = sqlite3.connect(tmp, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                db.execute("BEGIN IMMEDIATE")
                _create_tables(db)
                db.execute("COMMIT")
            finally:
                db.close()  # the last connection: checkpoints into the file and removes its -wal
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, self.path)  # never replaces: a store another registry made meanwhile stays
            except FileExistsError:
                pass  # its lock decides which registry owns it
            except OSError:  # a filesystem without hard links
                if not os.path.exists(self.path):
                    os.replace(tmp, self.path)
            _fsync_dir(folder)
        except (sqlite3.Error, OSError) as e:
            raise self._error("cannot create it", e) from None
        finally:
            for leftover in (tmp, f"{tmp}-wal", f"{tmp}-shm", f"{tmp}-journal") if tmp else ():
                try:
                    os.unlink(leftover)
                except OSError:
                    pass

    def _check_schema(self, db: sqlite3.Connection) -> None:
        try:
            row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            for table in ("log", "snapshot_parts", "snapshots"):
                db.execute(f"SELECT * FROM {table} LIMIT 0")
        except sqlite3.OperationalError as e:
            raise StoreCorrupted(f"registry store {self.path}: not a lorapub registry log ({e})") from None
        if row is None or row[0] != SCHEMA:
            found = row[0] if row else None
            raise StoreCorrupted(f"registry store {self.path}: schema {found!r}, this lorapub reads {SCHEMA!r}")

    def close(self) -> None:
        """Release the file (and its lock); the next load or save opens it again."""
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None
            self._build = None
        self._close_mark()

    # -- reading ---------------------------------------------------------------------------
    def _decode(self, what: str, record: bytes, checksum: bytes, *key: bytes) -> Any:
        if _checksum(*key, record) != checksum:
            raise StoreCorrupted(f"registry store {self.path}: {what}: checksum mismatch")
        try:
            return pickle.loads(record)
        except Exception as e:
            raise StoreCorrupted(f"registry store {self.path}: {what}: cannot decode it: {type(e).__name__}: {e}") from None

    def load(self) -> RegistryState | None:
        """The state after the last committed command, or None for a new store."""
        db = self._open()
        try:
            return self._load(db)
        except LorapubError:
            self.close()
            raise
        except (sqlite3.Error, OSError) as e:
            self.close()
            raise self._error("cannot read it", e) from None

    def _load(self, db: sqlite3.Connection) -> RegistryState | None:
        if self._snap < 0:
            if db.execute("SELECT 1 FROM log LIMIT 1").fetchone():
                raise StoreCorrupted(f"registry store {self.path}: log records but no snapshot to replay them on")
            return None
        snap = self._snap
        (parts,) = db.execute("SELECT parts FROM snapshots WHERE snap=?", (snap,)).fetchone()
        rows = db.execute(
            "SELECT part, CAST(record AS BLOB), CAST(checksum AS BLOB) FROM snapshot_parts WHERE snap=? ORDER BY part",
            (snap,),
        ).fetchall()
        if [r[0] for r in rows] != list(range(parts)):
            raise StoreCorrupted(
                f"registry store {self.path}: snapshot {snap} has {len(rows)} of its {parts} parts"
            )
        state = self._decode(f"snapshot {snap} part 0", rows[0][1], rows[0][2], _key("part", snap, 0))
        if not isinstance(state, RegistryState):
            raise StoreCorrupted(f"registry store {self.path}: snapshot {snap} holds a {type(state).__name__}")
        maps: dict[str, dict] = {}
        for part, record, checksum in rows[1:]:
            name, items = self._decode(f"snapshot {snap} part {part}", record, checksum, _key("part", snap, part))
            maps.setdefault(name, {}).update(items)
        # every field through its converter again: a snapshot an earlier release wrote holds its
        # sessions as a PMap of records, which becomes a session table here
        state = attrs.evolve(state, **{
            name: SessionTable.from_atoms(items.items()) if isinstance(getattr(state, name), SessionTable)
            else pmap(items) for name, items in maps.items()
        })
        epoch = db.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()
        if epoch is None or int(epoch[0]) != state.epoch:
            raise StoreCorrupted(
                f"registry store {self.path}: its meta says epoch {epoch and epoch[0]}, its snapshot {state.epoch}"
            )
        expected = snap + 1
        replay = db.execute(
            "SELECT seq, CAST(record AS BLOB), CAST(checksum AS BLOB) FROM log WHERE seq > ? ORDER BY seq", (snap,)
        )
        for seq, record, checksum in replay:
            if seq != expected:
                raise StoreCorrupted(f"registry store {self.path}: log record {expected} is missing (next is {seq})")
            command = self._decode(f"log record {seq}", record, checksum, _key("log", seq))
            if type(command) not in R.COMMANDS or isinstance(command, R.QUERIES):
                raise StoreCorrupted(f"registry store {self.path}: log record {seq} is a {type(command).__name__}")
            try:
                state = R.handle(state, command).state
            except Exception as e:
                raise StoreCorrupted(
                    f"registry store {self.path}: log record {seq} ({type(command).__name__}) does not replay: {e}"
                ) from None
            expected += 1
        return state

    # -- writing ---------------------------------------------------------------------------
    def save(self, state: RegistryState, command: Command | None = None) -> None:
        """Make ``state`` durable: append ``command`` (the one that produced ``state`` from
        the last saved state), or with no command, write ``state`` whole as a checkpoint."""
        if command is None:
            return self._checkpoint(self._open(), state)
        self.save_many([(state, command)])

    def save_many(self, items: list[tuple[RegistryState, Command]]) -> None:
        """Group commit: append several commands (each with the state it produced, in order)
        in **one** transaction — one fsync for the batch. All or none are stored."""
        if not items:
            return
        db = self._open()
        records = []
        for _, command in items:
            try:
                records.append(_encode(command))
            except Exception as e:
                raise StoreError(
                    f"registry store {self.path}: cannot encode {type(command).__name__}: {type(e).__name__}: {e}"
                ) from None
        if self._snap < 0:
            raise StoreError(f"registry store {self.path}: save a whole state before logging commands on it")
        if self._mark_failed is not None:
            self._put_mark(sync=True)
            if self._mark_failed is not None:
                raise StoreError(
                    f"registry store {self.path}: cannot write its mark {self.mark_path} ({self._mark_failed}); "
                    f"nothing is stored until it can be (the mark is what tells a damaged log at the next open)"
                )
        first = self._seq + 1
        build = self._build
        if build is not None:
            try:
                part = build.next_part()
            except Exception:  # a state that cannot be encoded: drop this snapshot, keep logging
                self._build = build = None
        finished = False
        what = type(items[0][1]).__name__ if len(items) == 1 else f"a batch of {len(items)} commands"
        try:
            db.execute("BEGIN IMMEDIATE")
            for i, record in enumerate(records):
                seq = first + i
                tag = _checksum(_key("log", seq), record)
                db.execute("INSERT INTO log VALUES (?, ?, ?)", (seq, record, tag))
            if build is not None:
                if part is not None:
                    db.execute(
                        "INSERT INTO snapshot_parts VALUES (?, ?, ?, ?)",
                        (build.snap, build.written, part, _checksum(_key("part", build.snap, build.written), part)),
                    )
                else:  # every part is in: the snapshot is complete, older ones are garbage
                    db.execute("INSERT INTO snapshots VALUES (?, ?)", (build.snap, build.written))
                    db.execute("DELETE FROM snapshots WHERE snap < ?", (build.snap,))
                    finished = True
            elif self._garbage:
                self._collect(db)
            db.execute("COMMIT")
        except Exception as e:
            self._rollback(db)
            if isinstance(e, LorapubError):
                raise
            raise self._error(f"{what} not stored", e) from None
        seq = first + len(records) - 1
        self._seq, self._tag = seq, tag  # the loop's last record
        self._put_mark()
        if build is not None:
            if finished:
                self._snap, self._build, self._garbage = build.snap, None, True
            elif build.ready is not None:
                build.written += 1
                build.ready = None
        elif not self._garbage and seq - self._snap >= self.snapshot_every:
            # the previous snapshot's garbage is gone: the log never holds more than about
            # snapshot_every + (parts of one snapshot) + (collection steps) records
            self._build = _Build(seq, items[-1][0], self.part_entries)

    def _collect(self, db: sqlite3.Connection) -> None:
        """Delete up to ``gc_batch`` log records and parts the latest snapshot covers."""
        n = db.execute(
            "DELETE FROM log WHERE seq IN (SELECT seq FROM log WHERE seq <= ? ORDER BY seq LIMIT ?)",
            (self._snap, self.gc_batch),
        ).rowcount
        n += db.execute(
            "DELETE FROM snapshot_parts WHERE rowid IN (SELECT rowid FROM snapshot_parts WHERE snap < ? LIMIT ?)",
            (self._snap, _PARTS_PER_COLLECT),
        ).rowcount
        if n == 0:
            self._garbage = False

    def _checkpoint(self, db: sqlite3.Connection, state: RegistryState) -> None:
        snap = self._seq
        try:
            parts = [_encode(p) for p in _snapshot_parts(state, self.part_entries)]
        except Exception as e:
            raise StoreError(f"registry store {self.path}: cannot encode the state: {type(e).__name__}: {e}") from None
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM snapshot_parts WHERE snap >= ?", (snap,))
            db.executemany(
                "INSERT INTO snapshot_parts VALUES (?, ?, ?, ?)",
                ((snap, i, p, _checksum(_key("part", snap, i), p)) for i, p in enumerate(parts)),
            )
            db.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?)", (snap, len(parts)))
            db.execute("DELETE FROM snapshots WHERE snap < ?", (snap,))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('epoch', ?)", (str(state.epoch),))
            db.execute("COMMIT")
        except Exception as e:
            self._rollback(db)
            raise self._error("checkpoint not stored", e) from None
        self._snap, self._build, self._garbage = snap, None, True
        self._put_mark(sync=True)

    def _rollback(self, db: sqlite3.Connection) -> None:
        try:
            if db.in_transaction:
                db.execute("ROLLBACK")
        except sqlite3.Error:
            self.close()  # the connection is in an unknown state: the next call reopens

    # -- inspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for reports and tests: records logged, the latest snapshot, the file size."""
        db = self._open()
        try:
            log_records = db.execute("SELECT COUNT(*) FROM log").fetchone()[0]
            parts = db.execute("SELECT COUNT(*) FROM snapshot_parts").fetchone()[0]
        except sqlite3.Error as e:
            raise self._error("cannot read it", e) from None
        return {
            "seq": self._seq,
            "snapshot": self._snap,
            "log_records": log_records,
            "snapshot_parts": parts,
            "building": self._build is not None,
            "bytes": sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p)),
        }


def _looks_like_file_store(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_FILE_MAGIC))
    except OSError:
        return False
    return head == _FILE_MAGIC or head[:1] == b"\x80"  # FileStore's header, or an older plain pickle


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _key(kind: str, *numbers: int) -> bytes:
    """What a record's checksum binds it to besides its bytes: its place in the store."""
    return kind.encode() + b"".join(n.to_bytes(8, "big", signed=True) for n in numbers)
