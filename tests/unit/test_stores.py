"""Durable registry stores: resume, integrity, epoch refusal, failed saves, compaction, crashes."""

from __future__ import annotations

import math
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SOURCE
from lorapub.core.identity import SessionKey, VersionKey
from lorapub.core.registry import (
    BindFirst, CloseAndRelease, Commit, ForgetSessions, OpenSession, RecordBucketDone, RecordPrepared,
    RecordReady, Reserve,
)
from lorapub.errors import EpochMismatch, StoreCorrupted, StoreError
from lorapub.local_registry import LocalRegistry
from lorapub.adapters.stores import FileStore, SQLiteStore
from lorapub.testing.fixtures import fake_plan
from tests.unit.test_core_rows import E, EP, publish

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sk(i: int | str) -> SessionKey:
    return SessionKey(EP, f"s{i}", "n")


def publish_through(registry: LocalRegistry, v: str) -> None:
    """One publication driven command by command, so each transition goes through the store."""
    digest, plan = fake_plan(v)
    key = VersionKey(EP, v)
    token = registry.apply(Reserve(key, digest, plan)).reply.token
    for e, inc in E.items():
        registry.apply(RecordPrepared(token, e, inc))
    for i in range(len(plan)):
        for p in (SOURCE, *E):
            registry.apply(RecordBucketDone(token, p, i, E.get(p)))
    for e, inc in E.items():
        registry.apply(RecordReady(ReadyLocal(e, token, digest, inc)))
    registry.apply(Commit(key, token, registry.state.default_revision))


def sqlite_registry(path, **options) -> LocalRegistry:
    return LocalRegistry(EP, E, store=SQLiteStore(str(path), **options))


def with_sessions(path, n: int, **options) -> LocalRegistry:
    registry = sqlite_registry(path, **options)
    publish_through(registry, "A")
    for i in range(n):
        registry.apply(BindFirst(sk(i)))
    return registry


def reopen(registry: LocalRegistry, **options) -> LocalRegistry:
    path = registry.store.path
    registry.close()
    return LocalRegistry(EP, {"ignored": "x"}, store=type(registry.store)(path, **options))


# -- FileStore (the whole state per decision) --------------------------------------------------
def test_file_store_survives_a_registry_restart(tmp_path):
    path = str(tmp_path / "registry.pickle")
    first = LocalRegistry(EP, E, store=FileStore(path))
    state, token = publish(first.state, "A")
    first._state = state
    first._store.save(state)
    first.apply(BindFirst(SessionKey(EP, "s", "n")))
    receipt = state.versions[VersionKey(EP, "A")].commit
    # the process dies; a new one loads what the last transition stored
    again = LocalRegistry(EP, {"ignored": "x"}, store=FileStore(path))
    assert again.state.engines == state.engines
    assert again.apply(Commit(VersionKey(EP, "A"), token, 0)).reply == receipt  # replay after restart
    assert again.apply(BindFirst(SessionKey(EP, "s", "n"))).reply.version == VersionKey(EP, "A")
    assert again.state.versions[VersionKey(EP, "A")].session_refs == 1


def test_file_store_writes_atomically(tmp_path):
    store = FileStore(str(tmp_path / "s.pickle"))
    assert store.load() is None
    store.save({"a": 1})
    store.save({"a": 2})
    assert store.load() == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.pickle"]


def test_file_store_still_reads_a_plain_pickle(tmp_path):
    """What earlier releases wrote (a bare pickle, no checksum) still resumes."""
    path = tmp_path / "old.pickle"
    state, _ = publish(LocalRegistry(EP, E).state, "A")
    path.write_bytes(pickle.dumps(state))
    assert LocalRegistry(EP, E, store=FileStore(str(path))).state == state


@pytest.mark.parametrize("damage", ["truncate", "garble", "empty"])
def test_damaged_file_store_is_store_corrupted_naming_the_file(tmp_path, damage):
    path = tmp_path / "registry.pickle"
    registry = LocalRegistry(EP, E, store=FileStore(str(path)))
    publish_through(registry, "A")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garble":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x55]) + data[middle + 1:])
    else:
        path.write_bytes(b"")
    with pytest.raises(StoreCorrupted) as e:
        LocalRegistry(EP, E, store=FileStore(str(path)))
    assert str(path) in e.value.message


@pytest.mark.parametrize("keep", [0, 1, 5, 19, 35])  # the header is the 20-byte magic and a 16-byte checksum
def test_a_file_store_cut_shorter_than_its_header_is_store_corrupted(tmp_path, keep):
    path = tmp_path / "registry.pickle"
    registry = LocalRegistry(EP, E, store=FileStore(str(path)))
    publish_through(registry, "A")
    cut = path.read_bytes()[:keep]
    path.write_bytes(cut)
    with pytest.raises(StoreCorrupted, match="shorter than a FileStore header") as e:
        LocalRegistry(EP, E, store=FileStore(str(path)))
    assert str(path) in e.value.message and "cut short" in e.value.message
    assert path.read_bytes() == cut  # refused, not replaced by a new registry


def test_file_store_holding_something_else_is_refused(tmp_path):
    path = tmp_path / "registry.pickle"
    FileStore(str(path)).save({"not": "a registry"})
    with pytest.raises(StoreCorrupted, match="holds a dict"):
        LocalRegistry(EP, E, store=FileStore(str(path)))


def test_file_store_save_failure_is_a_store_error_and_the_state_stays(tmp_path):
    path = tmp_path / "registry.pickle"
    registry = LocalRegistry(EP, E, store=FileStore(str(path)))
    publish_through(registry, "A")
    before = registry.state
    path.unlink()
    path.mkdir()  # the file's place is taken: the rename fails
    (path / "x").write_text("x")
    with pytest.raises(StoreError) as e:
        registry.apply(BindFirst(sk(1)))
    assert str(path) in e.value.message
    assert registry.state is before  # not applied
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


class StateOnlyStore:
    """A store written against the earlier protocol: save(state), no command."""

    def __init__(self) -> None:
        self.saved: list = []
        self.fail = False

    def load(self):
        return self.saved[-1] if self.saved else None

    def save(self, state):
        if self.fail:
            raise OSError(5, "Input/output error")
        self.saved.append(state)


def test_a_store_that_takes_only_the_state_still_works_and_its_failures_are_typed():
    store = StateOnlyStore()
    registry = LocalRegistry(EP, E, store=store)
    publish_through(registry, "A")
    registry.apply(BindFirst(sk(1)))
    assert store.saved[-1] is registry.state
    store.fail = True
    before = registry.state
    with pytest.raises(StoreError, match="StateOnlyStore: save failed: OSError"):
        registry.apply(BindFirst(sk(2)))
    assert registry.state is before  # not applied
    store.fail = False
    assert LocalRegistry(EP, E, store=store).state == before


# -- both durable stores ---------------------------------------------------------------------
STORES = {
    "sqlite": lambda p: SQLiteStore(str(p / "registry.db")),
    "file": lambda p: FileStore(str(p / "registry.pickle")),
}


@pytest.mark.parametrize("kind", STORES)
def test_a_store_of_another_epoch_is_refused_and_left_untouched(tmp_path, kind):
    registry = LocalRegistry(EP, E, store=STORES[kind](tmp_path))
    publish_through(registry, "A")
    registry.apply(BindFirst(sk(1)))
    state = registry.state
    registry.close()
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(EpochMismatch) as e:
        LocalRegistry(EP + 1, E, store=STORES[kind](tmp_path))
    assert str(tmp_path) in e.value.message
    assert f"epoch {EP}" in e.value.message and f"epoch {EP + 1}" in e.value.message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    assert LocalRegistry(EP, E, store=STORES[kind](tmp_path)).state == state  # its own epoch resumes it


@pytest.mark.parametrize("kind", STORES)
def test_a_store_written_before_resumes_the_same_state(tmp_path, kind):
    registry = LocalRegistry(EP, E, store=STORES[kind](tmp_path))
    publish_through(registry, "A")
    for i in range(5):
        registry.apply(BindFirst(sk(i)))
    registry.apply(CloseAndRelease(sk(2)))
    state = registry.state
    registry.close()
    assert LocalRegistry(EP, {"other": "y"}, 7, store=STORES[kind](tmp_path)).state == state


# -- SQLiteStore --------------------------------------------------------------------------------
def test_a_file_store_file_opened_as_sqlite_store_says_so(tmp_path):
    """store_path used to mean a FileStore: an old file is named for what it is, not just 'corrupted'."""
    path = tmp_path / "registry.pickle"
    registry = LocalRegistry(EP, E, store=FileStore(str(path)))
    publish_through(registry, "A")
    data = path.read_bytes()
    with pytest.raises(StoreCorrupted, match="this is a FileStore file"):
        sqlite_registry(path)
    assert path.read_bytes() == data  # untouched
    assert LocalRegistry(EP, E, store=FileStore(str(path))).state == registry.state


def test_sqlite_store_logs_commands_not_states(tmp_path):
    registry = with_sessions(tmp_path / "r.db", 50)
    before = registry.store.stats()
    registry.apply(BindFirst(sk("new")))
    after = registry.store.stats()
    assert after["seq"] == before["seq"] + 1 and after["log_records"] == before["log_records"] + 1
    # a replay that changes nothing stores nothing
    registry.apply(BindFirst(sk("new")))
    assert registry.store.stats()["seq"] == after["seq"]


def test_sqlite_store_is_locked_to_one_registry(tmp_path):
    registry = with_sessions(tmp_path / "r.db", 1)
    with pytest.raises(StoreError, match="locked by another registry") as e:
        sqlite_registry(tmp_path / "r.db")
    assert str(tmp_path / "r.db") in e.value.message
    assert reopen(registry).state == registry.state  # once released, it opens


def _rewrite(path, sql: str, *args) -> None:
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute(sql, args)
    db.close()


def _corrupt_record(path):
    db = sqlite3.connect(str(path), isolation_level=None)
    seq, record = db.execute("SELECT seq, record FROM log ORDER BY seq DESC LIMIT 1").fetchone()
    db.execute("UPDATE log SET record = ? WHERE seq = ?", (record[:10] + bytes([record[10] ^ 1]) + record[11:], seq))
    db.close()


# The two rewrites below give a record a valid checksum; they pick one before the last: the last
# record's checksum is also in the store's mark, which refuses a rewritten last record on its own.
def _unpicklable_record(path):
    from lorapub.adapters.stores import records

    db = sqlite3.connect(str(path), isolation_level=None)
    (seq,) = db.execute("SELECT MAX(seq) - 1 FROM log").fetchone()
    record = pickle.dumps(BindFirst(sk(1))).replace(b"BindFirst", b"BindLast\x00")  # names no class
    db.execute("UPDATE log SET record = ?, checksum = ? WHERE seq = ?",
               (record, records.checksum(records.key("log", seq), record), seq))
    db.close()


def _unreplayable_record(path):
    from lorapub.adapters.stores import records

    db = sqlite3.connect(str(path), isolation_level=None)
    (seq,) = db.execute("SELECT MAX(seq) - 1 FROM log").fetchone()
    record = pickle.dumps(OpenSession(SessionKey(EP + 5, "x", "n")))  # another epoch: the core refuses it
    db.execute("UPDATE log SET record = ?, checksum = ? WHERE seq = ?",
               (record, records.checksum(records.key("log", seq), record), seq))
    db.close()


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(path):
    path.write_bytes(b"this is not a database" * 100)


def _garble_page(path):
    data = bytearray(path.read_bytes())
    for i in range(4096 + 100, len(data), 997):  # every page but the header page
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "checksum": (_corrupt_record, "checksum mismatch"),
    "unpicklable record": (_unpicklable_record, "cannot decode"),
    "record that does not replay": (_unreplayable_record, "does not replay"),
    "wrong schema": (lambda p: _rewrite(p, "UPDATE meta SET value = 'someone.else/9' WHERE key = 'schema'"), "schema"),
    "missing log record": (lambda p: _rewrite(p, "DELETE FROM log WHERE seq = (SELECT MIN(seq) FROM log)"), "missing"),
    "missing snapshot part": (lambda p: _rewrite(p, "DELETE FROM snapshot_parts WHERE part = 1"), "parts"),
    "foreign tables": (lambda p: _rewrite(p, "DROP TABLE log"), "not a lorapub registry log"),
    "truncated file": (_truncate, None),
    "emptied file": (lambda p: p.write_bytes(b""), "empty"),
    "not a database": (_garbage, None),
    "garbled pages": (_garble_page, None),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corrupted_sqlite_store_is_store_corrupted_naming_the_file(tmp_path, corruption):
    damage, says = CORRUPTIONS[corruption]
    registry = with_sessions(tmp_path / "r.db", 600, part_entries=50)
    registry.close()
    damage(tmp_path / "r.db")
    with pytest.raises(StoreCorrupted, match=says) as e:
        sqlite_registry(tmp_path / "r.db")
    assert str(tmp_path / "r.db") in e.value.message


@pytest.mark.parametrize("keep", [1, 2, 100, 511])
def test_a_sqlite_store_cut_shorter_than_one_page_is_store_corrupted_not_a_new_registry(tmp_path, keep):
    """SQLite takes a one-byte file for a new database: the registry would have started afresh."""
    path = tmp_path / "r.db"
    with_sessions(path, 5).close()
    cut = path.read_bytes()[:keep]
    path.write_bytes(cut)
    with pytest.raises(StoreCorrupted, match="shorter than the smallest SQLite database") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message and f"{keep} bytes" in e.value.message
    assert path.read_bytes() == cut  # nothing written into it


def test_an_empty_sqlite_store_is_refused_even_with_a_write_ahead_log(tmp_path):
    """A store's file holds a page from its creation on; an empty one beside a log was cut."""
    path = tmp_path / "r.db"
    registry = with_sessions(path, 5)
    wal = (tmp_path / "r.db-wal").read_bytes()  # the registry is open: its log holds the decisions
    registry.close()
    path.write_bytes(b"")
    (tmp_path / "r.db-wal").write_bytes(wal)
    with pytest.raises(StoreCorrupted, match="empty") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message


def test_a_store_missing_beside_its_write_ahead_log_is_refused(tmp_path):
    path = tmp_path / "r.db"
    registry = with_sessions(path, 5)
    wal = (tmp_path / "r.db-wal").read_bytes()
    registry.close()
    path.unlink()
    (tmp_path / "r.db-mark").unlink()  # the log alone tells (the mark would too: next test)
    (tmp_path / "r.db-wal").write_bytes(wal)
    with pytest.raises(StoreCorrupted, match="missing but its write-ahead log") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message and not path.exists()


def test_a_store_missing_beside_its_mark_is_refused_not_started_afresh(tmp_path):
    path = tmp_path / "r.db"
    with_sessions(path, 5).close()
    path.unlink()
    with pytest.raises(StoreCorrupted, match="is missing, but its mark") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message and "move the mark away to start a new store" in e.value.message
    assert not path.exists()
    (tmp_path / "r.db-mark").unlink()  # as the message says: a new store
    assert len(sqlite_registry(path).state.sessions) == 0


def test_a_new_sqlite_store_never_appears_at_its_path_unfinished(tmp_path, monkeypatch):
    """SQLite creates a database file empty: a creation cut short in place would leave an empty file,
    refused as a store cut to nothing. The store is built beside its path and linked into place."""
    from lorapub.adapters.stores import sqlite_store

    path = tmp_path / "r.db"
    monkeypatch.setattr(sqlite_store, "TABLES", sqlite_store.TABLES + ("CREATE TABLE broken (",))  # creation fails midway
    with pytest.raises(StoreError, match="cannot create it") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message
    assert list(tmp_path.iterdir()) == []  # nothing at the path, no temporary file left
    monkeypatch.undo()
    registry = with_sessions(path, 3)  # the next open creates it whole
    state = registry.state
    assert reopen(registry).state == state


def test_sqlite_save_failure_is_a_store_error_and_nothing_advances(tmp_path):
    registry = with_sessions(tmp_path / "r.db", 3)
    db = registry.store._db
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
    failed = None
    for i in range(10_000):
        before, seq = registry.state, registry.store.stats()["seq"]
        try:
            registry.apply(BindFirst(sk(f"x{i}")))
        except StoreError as e:
            failed = (i, e)
            break
    assert failed is not None, "the store never filled up"
    i, e = failed
    assert str(tmp_path / "r.db") in e.message and "BindFirst not stored" in e.message
    assert registry.state is before and registry.store.stats()["seq"] == seq
    db.execute("PRAGMA max_page_count = 1073741823")  # space again: the same command applies once
    bound = registry.apply(BindFirst(sk(f"x{i}"))).reply
    again = reopen(registry)
    assert again.state == registry.state
    assert again.apply(BindFirst(sk(f"x{i}"))).reply == bound


def test_compaction_keeps_the_state_and_shrinks_the_log(tmp_path):
    path = tmp_path / "r.db"
    registry = with_sessions(path, 200, snapshot_every=50, part_entries=16, gc_batch=40)
    states, most = [], 0
    for i in range(600):
        registry.apply(BindFirst(sk(f"c{i}")) if i % 2 == 0 else CloseAndRelease(sk(f"c{i - 1}")))
        stats = registry.store.stats()
        most = max(most, stats["log_records"])
        if i % 97 == 0:
            states.append(registry.state)
    stats = registry.store.stats()
    assert stats["seq"] > 800 and stats["snapshot"] > 700
    # the log holds what the latest snapshot does not cover, plus garbage not yet collected
    assert most < 150 and stats["log_records"] < 150
    registry.apply(ForgetSessions(tuple(sk(f"c{i}") for i in range(0, 600, 2))))
    state = registry.state
    assert reopen(registry).state == state
    assert len(state.sessions) == 200


def test_compaction_through_a_reopen_mid_snapshot(tmp_path):
    """A snapshot left half-written by a restart is ignored, then collected; the state is kept."""
    registry = with_sessions(tmp_path / "r.db", 100, snapshot_every=20, part_entries=5)
    for i in range(23):
        registry.apply(OpenSession(sk(f"o{i}")))
    assert registry.store.stats()["building"]
    for round_ in range(5):
        registry = reopen(registry, snapshot_every=20, part_entries=5)
        for i in range(17):
            registry.apply(BindFirst(sk(f"r{round_}-{i}")))
    state = registry.state
    again = reopen(registry, snapshot_every=20, part_entries=5)
    assert again.state == state
    for i in range(200):
        again.apply(OpenSession(sk(f"late{i}")))
    stats = again.store.stats()
    per_snapshot = (len(again.state.sessions) + 4) // 5 + 4  # its maps in parts of 5, and the header
    assert stats["snapshot_parts"] <= 2 * per_snapshot  # the latest snapshot and the one being written
    assert reopen(again).state == again.state


_CRASH = textwrap.dedent("""
    import os, sys
    from lorapub.core.identity import SessionKey
    from lorapub.core.registry import BindFirst, CloseAndRelease
    from lorapub.local_registry import LocalRegistry
    from lorapub.adapters.stores import SQLiteStore
    registry = LocalRegistry(3, {"e0": "x"}, store=SQLiteStore(sys.argv[1]))
    command = {"bind": BindFirst, "close": CloseAndRelease}[sys.argv[2]](SessionKey(3, "victim", "n"))
    registry.apply(command)  # durable on return
    os._exit(0)  # the process dies before the reply reaches anyone: no close, the WAL is left as is
""")


@pytest.mark.parametrize("command", ["bind", "close"])
def test_a_crash_between_append_and_reply_leaves_the_command_applied_and_replay_safe(tmp_path, command):
    path = tmp_path / "r.db"
    registry = with_sessions(path, 10)
    if command == "close":
        registry.apply(BindFirst(SessionKey(EP, "victim", "n")))
    refs = registry.state.versions[VersionKey(EP, "A")].session_refs
    registry.close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), REPO]))
    subprocess.run([sys.executable, "-c", _CRASH, str(path), command], check=True, env=env, timeout=60)
    assert os.path.exists(str(path) + "-wal")  # it really died without closing
    again = sqlite_registry(path)
    seq = again.store.stats()["seq"]
    victim = again.state.sessions[SessionKey(EP, "victim", "n")]
    expected = refs + 1 if command == "bind" else refs - 1
    assert again.state.versions[VersionKey(EP, "A")].session_refs == expected  # the command is in
    # the caller never saw a reply and replays the same command: same answer, no second effect
    replay = {"bind": BindFirst, "close": CloseAndRelease}[command](SessionKey(EP, "victim", "n"))
    reply = again.apply(replay).reply
    assert again.state.versions[VersionKey(EP, "A")].session_refs == expected
    assert again.state.sessions[SessionKey(EP, "victim", "n")] == victim
    assert again.store.stats()["seq"] <= seq + 1  # at most a record that changes nothing
    assert reopen(again).state == again.state
    if command == "bind":
        assert reply.version == VersionKey(EP, "A")


# -- the high-water mark: a damaged write-ahead log never reopens with fewer decisions -----------
_ACKNOWLEDGE = textwrap.dedent("""
    import sys, time
    from lorapub.core.identity import SessionKey
    from lorapub.core.registry import BindFirst
    from lorapub.local_registry import LocalRegistry
    from lorapub.adapters.stores import SQLiteStore
    registry = LocalRegistry(3, {"e0": "x"}, store=SQLiteStore(sys.argv[1]))
    for i in range(int(sys.argv[2])):
        registry.apply(BindFirst(SessionKey(3, f"acked{i}", "n")))  # durable on return
        print(i, flush=True)  # acknowledged
    time.sleep(600)  # killed here: never closed, never checkpointed
""")


def acknowledged_then_killed(path, n: int) -> None:
    """A real registry process acknowledges ``n`` decisions, then is SIGKILLed before any checkpoint."""
    with_sessions(path, 0).close()  # one version published; closed, so the child starts a fresh log
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), REPO]))
    child = subprocess.Popen([sys.executable, "-c", _ACKNOWLEDGE, str(path), str(n)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        acks = [child.stdout.readline().strip() for _ in range(n)]
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert acks == [str(i) for i in range(n)], acks
    assert child.returncode == -signal.SIGKILL
    assert os.path.getsize(str(path) + "-wal") > 0  # every decision is in the log, none checkpointed


def acked(i: int) -> SessionKey:
    return SessionKey(EP, f"acked{i}", "n")


def _wal_frames(data: bytes) -> tuple[int, int]:
    """(frame size, frames) of a SQLite write-ahead log: a 32-byte header, then 24-byte headers + pages."""
    frame = 24 + int.from_bytes(data[8:12], "big")
    return frame, (len(data) - 32) // frame


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


def _flip_middle_frame(data: bytes) -> bytes:
    frame, frames = _wal_frames(data)
    return _flip(data, 32 + (frames // 2) * frame + 24 + 100)  # one bit of a page in the middle of the log


def _flip_last_frame(data: bytes) -> bytes:
    frame, frames = _wal_frames(data)
    return _flip(data, 32 + (frames - 1) * frame + 24 + 100)  # one bit of the last commit's page


WAL_DAMAGE = {
    "one bit flipped mid-log": _flip_middle_frame,
    "one bit flipped in the last commit": _flip_last_frame,
    "one bit flipped in the log header": lambda data: _flip(data, 17),  # a salt: the whole log is dropped
    "cut in half": lambda data: data[: len(data) // 2],
    "cut to its header": lambda data: data[:32],
}


@pytest.mark.parametrize("damage", WAL_DAMAGE)
def test_a_damaged_write_ahead_log_after_a_kill_is_store_corrupted_never_fewer_decisions(tmp_path, damage):
    """SQLite stops recovering a log at its first bad frame and opens without error; the mark outside
    the log says what was acknowledged, and the store is refused instead of resumed with less."""
    path, wal = tmp_path / "r.db", tmp_path / "r.db-wal"
    acknowledged_then_killed(path, 40)
    damaged = WAL_DAMAGE[damage](wal.read_bytes())
    wal.write_bytes(damaged)
    before = path.read_bytes()
    # what SQLite itself makes of it (on a copy): it opens without error, holding fewer decisions
    witness = tmp_path / "witness"
    witness.mkdir()
    (witness / "r.db").write_bytes(before)
    (witness / "r.db-wal").write_bytes(damaged)
    db = sqlite3.connect(str(witness / "r.db"), isolation_level=None)
    (held,) = db.execute("SELECT MAX(seq) FROM log").fetchone()
    db.close()
    assert held < stores_mark(tmp_path / "r.db-mark").seq
    with pytest.raises(StoreCorrupted, match="were acknowledged") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message and str(tmp_path / "r.db-mark") in e.value.message
    assert "missing" in e.value.message and "write-ahead log" in e.value.message
    # refused on a read-only look: the damage is left exactly as found, for whoever repairs it
    assert wal.read_bytes() == damaged and path.read_bytes() == before
    with pytest.raises(StoreCorrupted, match="were acknowledged"):  # and stays refused
        sqlite_registry(path)


def test_a_kill_without_damage_reopens_with_every_acknowledged_decision(tmp_path):
    path = tmp_path / "r.db"
    acknowledged_then_killed(path, 40)
    registry = sqlite_registry(path)
    assert all(registry.state.sessions[acked(i)].version == VersionKey(EP, "A") for i in range(40))
    assert registry.state.versions[VersionKey(EP, "A")].session_refs == 40
    seq = registry.store.stats()["seq"]
    state = registry.state
    assert reopen(registry).state == state
    assert stores_mark(tmp_path / "r.db-mark").seq == seq


def stores_mark(path):
    from lorapub.adapters.stores.mark import Mark

    return Mark.decode(path.read_bytes())


def test_a_store_without_its_mark_opens_and_gets_one(tmp_path):
    """A store an earlier release wrote has no mark: accepted as it is, and marked from then on."""
    path, mark = tmp_path / "r.db", tmp_path / "r.db-mark"
    acknowledged_then_killed(path, 5)
    mark.unlink()
    registry = sqlite_registry(path)
    assert registry.state.versions[VersionKey(EP, "A")].session_refs == 5
    assert stores_mark(mark).seq == registry.store.stats()["seq"]
    registry.apply(BindFirst(acked(99)))
    assert stores_mark(mark).seq == registry.store.stats()["seq"]  # kept current


@pytest.mark.parametrize("damage", ["bit", "cut", "empty", "longer"])
def test_a_damaged_mark_is_store_corrupted_naming_it(tmp_path, damage):
    path, mark = tmp_path / "r.db", tmp_path / "r.db-mark"
    with_sessions(path, 5).close()
    data = mark.read_bytes()
    mark.write_bytes({"bit": _flip(data, 30), "cut": data[:20], "empty": b"", "longer": data + b"\0"}[damage])
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(StoreCorrupted, match="is damaged") as e:
        sqlite_registry(path)
    assert str(mark) in e.value.message and "move it away to accept the store" in e.value.message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files
    mark.unlink()  # as the message says: accepted as it is
    assert len(sqlite_registry(path).state.sessions) == 5


def test_a_last_record_rewritten_under_a_valid_checksum_is_refused_by_the_mark(tmp_path):
    from lorapub.adapters.stores import records

    path = tmp_path / "r.db"
    with_sessions(path, 5).close()
    db = sqlite3.connect(str(path), isolation_level=None)
    (seq,) = db.execute("SELECT MAX(seq) FROM log").fetchone()
    record = pickle.dumps(BindFirst(sk("forged")))
    db.execute("UPDATE log SET record = ?, checksum = ? WHERE seq = ?",
               (record, records.checksum(records.key("log", seq), record), seq))
    db.close()
    with pytest.raises(StoreCorrupted, match=f"log record {seq} is not the one acknowledged") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message


def test_a_mark_that_cannot_be_written_stops_the_next_decision_not_the_acknowledged_one(tmp_path, monkeypatch):

    registry = with_sessions(tmp_path / "r.db", 2)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    registry.apply(BindFirst(sk("in")))  # committed before its mark failed: durable, acknowledged
    before = registry.state
    with pytest.raises(StoreError, match="cannot write its mark") as e:
        registry.apply(BindFirst(sk("out")))
    assert str(tmp_path / "r.db-mark") in e.value.message
    assert registry.state is before  # not applied
    monkeypatch.setattr(os, "pwrite", real)
    registry.apply(BindFirst(sk("out")))  # writable again: the mark catches up, decisions go on
    assert stores_mark(tmp_path / "r.db-mark").seq == registry.store.stats()["seq"]
    state = registry.state
    assert reopen(registry).state == state and sk("in") in state.sessions


@pytest.mark.parametrize("every, synced", [(0, 6), (3600, 0)])
def test_the_mark_is_written_after_every_commit_and_fsynced_as_often_as_asked(tmp_path, monkeypatch, every, synced):
    from lorapub.adapters.stores import records

    registry = with_sessions(tmp_path / "r.db", 2)
    registry = reopen(registry, mark_sync_every=every)
    syncs = []
    real = records.fdatasync
    monkeypatch.setattr(records, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    for i in range(6):
        registry.apply(BindFirst(sk(f"m{i}")))
        assert stores_mark(tmp_path / "r.db-mark").seq == registry.store.stats()["seq"]  # written every time
    assert len(syncs) == synced
    registry.close()
    assert len(syncs) == synced + 1  # and on close


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "1", True, None])
def test_mark_sync_every_must_be_a_finite_number_of_seconds(tmp_path, bad):
    from lorapub.errors import InvalidInput

    with pytest.raises(InvalidInput, match="mark_sync_every"):
        SQLiteStore(str(tmp_path / "r.db"), mark_sync_every=bad)


def test_group_commit_stores_a_batch_in_one_transaction_each_answered_on_its_own(tmp_path):
    from lorapub.core.commands import CloseAndRelease
    from lorapub.errors import NoPublishedVersion

    registry = with_sessions(tmp_path / "r.db", 3)
    before = registry.store.stats()["seq"]
    commits = []
    real = registry.store.save_many
    registry.store.save_many = lambda items: (commits.append(len(items)), real(items))[1]
    other = LocalRegistry(EP + 1, E)  # a registry with nothing published: its binds are refused
    answers = registry.apply_many([BindFirst(sk("x")), CloseAndRelease(sk(0)), BindFirst(sk("x")), CloseAndRelease(sk(1))])
    assert commits == [3]  # one transaction; the replayed bind changed nothing and is not stored
    assert all(not isinstance(a, Exception) for a in answers)
    assert registry.store.stats()["seq"] == before + commits[0]
    assert isinstance(other.apply_many([BindFirst(SessionKey(EP + 1, "s", "n"))])[0], NoPublishedVersion)
    state = registry.state
    assert reopen(registry).state == state  # the batch is durable exactly as applied


def test_a_failed_group_commit_applies_none_of_the_batch(tmp_path):
    from lorapub.core.commands import CloseAndRelease

    registry = with_sessions(tmp_path / "r.db", 2)
    state = registry.state

    def broken(items):
        raise OSError("disk full")

    registry.store.save_many = broken
    answers = registry.apply_many([CloseAndRelease(sk(0)), BindFirst(sk("y"))])
    assert all(isinstance(a, StoreError) for a in answers)
    assert registry.state is state


def test_a_stored_capacity_too_small_for_its_max_lag_resumes_with_a_warning(tmp_path, caplog):
    import attrs

    registry = LocalRegistry(EP, E, store=FileStore(str(tmp_path / "r.pickle")))
    state = attrs.evolve(registry.state, capacity=2, max_lag=1)  # what a release before the check could store
    registry._save(state, None)
    registry.close()
    with caplog.at_level("WARNING", logger="lorapub.local_registry"):
        resumed = LocalRegistry(EP, E, store=FileStore(str(tmp_path / "r.pickle")))
    assert (resumed.state.capacity, resumed.state.max_lag) == (2, 1)  # resumed, not refused
    assert "capacity 2 cannot serve max_lag=1" in caplog.text and "capacity=3 or more" in caplog.text


@pytest.mark.parametrize("cut", [1, 100, 4095])
def test_a_sqlite_store_cut_by_a_few_bytes_is_store_corrupted(tmp_path, cut):
    """SQLite writes whole pages: a file that is not a whole number of pages lost its tail."""
    path = tmp_path / "r.db"
    with_sessions(path, 5).close()
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises(StoreCorrupted, match="not a whole number of") as e:
        sqlite_registry(path)
    assert str(path) in e.value.message and f"{len(data) - cut} bytes" in e.value.message
    assert path.read_bytes() == data[:-cut]  # refused, nothing written into it
