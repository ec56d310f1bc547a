"""SQLiteStore: an append-only command log with snapshots written a slice at a time, and the
high-water mark beside it (:mod:`.mark`) that tells a damaged write-ahead log."""

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import sqlite3
import tempfile
import urllib.parse
from typing import Any, Iterator

import attrs
from pyrsistent import PMap, pmap

from lorapub.core import registry as R
from lorapub.core.commands import Command
from lorapub.core.registry import RegistryState
from lorapub.core.session_table import SessionTable
from lorapub.errors import InvalidInput, LorapubError, StoreCorrupted, StoreError

from .file_store import looks_like_file_store
from .mark import NO_TAG, HighWaterMark, Mark
from .records import CollectorPaused, encode, fsync_dir
from .records import checksum as checksum_of
from .records import key as key_of
from .records import size as file_size

__all__ = ["MARK_SYNC_EVERY", "SCHEMA", "TABLES", "SQLiteStore"]

log = logging.getLogger("lorapub.adapters.stores")


SCHEMA = "lorapub.registry.log/1"
#: Default for ``SQLiteStore(mark_sync_every=)``: seconds between fsyncs of the high-water mark.
MARK_SYNC_EVERY = 1.0

TABLES = (
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
_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100  # SQLite's database header; the page size is its bytes 16-17
_MIN_DB_BYTES = 512  # SQLite's smallest page: a database file that is not empty holds one page at least
_PARTS_PER_COLLECT = 8  # snapshot parts (each up to a few tens of kB) deleted per decision


def _create_tables(db: sqlite3.Connection) -> None:
    for ddl in TABLES:
        db.execute(ddl)
    db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA,))



def snapshot_parts(state: RegistryState, entries: int) -> Iterator[RegistryState | tuple[str, list[object]]]:
    """The state in slices: its maps emptied first, then ``entries`` map items per slice
    (the session table's items as its atoms: tuples of str/int/float, no objects to rebuild).

    The state is immutable, so iterating it across many later decisions is safe."""
    maps = [f.name for f in attrs.fields(type(state)) if isinstance(getattr(state, f.name), (PMap, SessionTable))]
    # fields picked by name at run time, each a map of its own type: Any is what fits them all
    emptied: dict[str, Any] = {name: pmap() for name in maps}
    yield attrs.evolve(state, **emptied)
    for name in maps:
        value = getattr(state, name)
        items = iter(value.atoms() if isinstance(value, SessionTable) else value.items())
        while chunk := list(itertools.islice(items, entries)):
            yield (name, chunk)


class _Build:
    """A snapshot being written, one part per logged command, after the command's record."""

    def __init__(self, snap: int, state: RegistryState, entries: int) -> None:
        self.snap = snap
        self.parts = snapshot_parts(state, entries)
        self.written = 0  # parts committed
        self.ready: bytes | None = None  # the next part, encoded, not yet committed
        self.exhausted = False

    def next_part(self) -> bytes | None:
        if self.ready is None and not self.exhausted:
            with CollectorPaused():
                item = next(self.parts, None)
                if item is None:
                    self.exhausted = True
                else:
                    self.ready = encode(item)
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
        self.snapshot_every = snapshot_every
        self.part_entries = part_entries
        self.gc_batch = gc_batch
        self.mark_sync_every = mark_sync_every
        self._db: sqlite3.Connection | None = None
        self._mark = HighWaterMark(self.path, mark_sync_every)
        self._tag = NO_TAG  # checksum of log record _seq as committed
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
        mark = self._mark.read()
        size = file_size(self.path)
        if size is None:
            if mark is not None:
                raise StoreCorrupted(
                    f"registry store {self.path} is missing, but its mark {self._mark.path} says decisions up to "
                    f"{mark.seq} were acknowledged; restore the store beside it, or move the mark away to start "
                    f"a new store"
                )
            if file_size(self.path + "-wal"):
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
        if size is not None:
            self._check_whole_pages(size)
        if mark is not None:
            self._mark.verify(mark, self._open_error)
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
            self._tag = bytes(row[0]) if row else mark.tag if mark is not None and mark.seq == self._seq else NO_TAG
            self._mark.open(Mark(self._seq, self._tag), mark)
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

    def _check_whole_pages(self, size: int) -> None:
        """SQLite writes a database file in whole pages (its header says their size): a file that is
        not a whole number of them lost its tail, though what is left may still open and read."""
        try:
            with open(self.path, "rb") as f:
                header = f.read(_HEADER_BYTES)
        except OSError as e:
            raise StoreError(f"registry store {self.path}: cannot read its header: {e}") from None
        if len(header) < _HEADER_BYTES or not header.startswith(_SQLITE_MAGIC):
            return  # not SQLite at all: opening it says so (or names the FileStore it is)
        page = int.from_bytes(header[16:18], "big")
        page = 65536 if page == 1 else page  # the header's encoding of the largest page size
        if page and size % page:
            raise StoreCorrupted(
                f"registry store {self.path}: the file is {size} bytes, not a whole number of its {page}-byte "
                f"pages: it was cut short (its last {size % page} bytes are part of a page); restore it from a "
                f"copy, or move it away (with its -wal file) to start a new store"
            )

    def _open_error(self, e: BaseException) -> StoreError:
        if looks_like_file_store(self.path):
            return StoreCorrupted(
                f"registry store {self.path}: this is a FileStore file (a pickled state), not a "
                f"SQLiteStore; open it with FileStore (RayRegistry.create(store_factory=functools.partial("
                f"FileStore, path))) or give the SQLiteStore a new path"
            )
        return self._error("cannot open it", e)

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
            fsync_dir(folder)
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
        self._mark.close()

    # -- reading ---------------------------------------------------------------------------
    def _decode(self, what: str, record: bytes, checksum: bytes, *key: bytes) -> Any:
        if checksum_of(*key, record) != checksum:
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
        state = self._decode(f"snapshot {snap} part 0", rows[0][1], rows[0][2], key_of("part", snap, 0))
        if not isinstance(state, RegistryState):
            raise StoreCorrupted(f"registry store {self.path}: snapshot {snap} holds a {type(state).__name__}")
        maps: dict[str, dict[Any, Any]] = {}  # field name -> its items, as decoded
        for part, record, checksum in rows[1:]:
            name, items = self._decode(f"snapshot {snap} part {part}", record, checksum, key_of("part", snap, part))
            maps.setdefault(name, {}).update(items)
        # every field through its converter again: a snapshot an earlier release wrote holds its
        # sessions as a PMap of records, which becomes a session table here
        filled: dict[str, Any] = {  # fields by name, each a map of its own type (as above)
            name: SessionTable.from_atoms(items.items()) if isinstance(getattr(state, name), SessionTable)
            else pmap(items) for name, items in maps.items()
        }
        state = attrs.evolve(state, **filled)
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
            command = self._decode(f"log record {seq}", record, checksum, key_of("log", seq))
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
                records.append(encode(command))
            except Exception as e:
                raise StoreError(
                    f"registry store {self.path}: cannot encode {type(command).__name__}: {type(e).__name__}: {e}"
                ) from None
        if self._snap < 0:
            raise StoreError(f"registry store {self.path}: save a whole state before logging commands on it")
        if self._mark.failed is not None:
            self._mark.put(Mark(self._seq, self._tag), sync=True)
            if self._mark.failed is not None:
                raise StoreError(
                    f"registry store {self.path}: cannot write its mark {self._mark.path} ({self._mark.failed}); "
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
                tag = checksum_of(key_of("log", seq), record)
                db.execute("INSERT INTO log VALUES (?, ?, ?)", (seq, record, tag))
            if build is not None:
                if part is not None:
                    db.execute(
                        "INSERT INTO snapshot_parts VALUES (?, ?, ?, ?)",
                        (build.snap, build.written, part, checksum_of(key_of("part", build.snap, build.written), part)),
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
        self._mark.put(Mark(self._seq, self._tag))
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
            parts = [encode(p) for p in snapshot_parts(state, self.part_entries)]
        except Exception as e:
            raise StoreError(f"registry store {self.path}: cannot encode the state: {type(e).__name__}: {e}") from None
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM snapshot_parts WHERE snap >= ?", (snap,))
            db.executemany(
                "INSERT INTO snapshot_parts VALUES (?, ?, ?, ?)",
                ((snap, i, p, checksum_of(key_of("part", snap, i), p)) for i, p in enumerate(parts)),
            )
            db.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?)", (snap, len(parts)))
            db.execute("DELETE FROM snapshots WHERE snap < ?", (snap,))
            db.execute("INSERT OR REPLACE INTO meta VALUES ('epoch', ?)", (str(state.epoch),))
            db.execute("COMMIT")
        except Exception as e:
            self._rollback(db)
            raise self._error("checkpoint not stored", e) from None
        self._snap, self._build, self._garbage = snap, None, True
        self._mark.put(Mark(self._seq, self._tag), sync=True)

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

