"""The session table: a persistent map with lease and tombstone indexes, in untracked tuples."""

from __future__ import annotations

import gc
import math
import pickle

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pyrsistent import pmap

from lorapub.core.registry.sessions import expire_by_scan
from lorapub.core import registry as R
from lorapub.core import session_table as T
from lorapub.core.commands import BindFirst, CloseAndRelease, ExpireLeases, OpenSession, RenewLeases
from lorapub.core.identity import SessionKey, VersionKey, new_nonce
from lorapub.core.session import LEASED, TOMBSTONES, SessionRecord, SessionState
from lorapub.core.session_table import SessionTable
from lorapub.local_registry import LocalRegistry
from lorapub.adapters.stores import FileStore, SQLiteStore
from tests.unit.test_core_rows import EP, E, publish

V = [VersionKey(EP, "A"), VersionKey(EP, "B")]
KEYS = [SessionKey(EP, f"s{i}", "own") for i in range(6)] + [
    SessionKey(EP, f"t{i}", new_nonce(1000 + 10 * i, "abcdef")) for i in range(6)
]

records = st.builds(
    SessionRecord,
    key=st.just(None),  # filled in with the key it is stored under
    state=st.sampled_from(list(SessionState)),
    version=st.none() | st.sampled_from(V),
    holds_ref=st.booleans(),
    lease_until=st.none() | st.sampled_from([0.0, 5.0, 5.0, 10.5, 1e9, math.inf, -math.inf]),
)


def expected_indexes(model: dict) -> tuple[list, list]:
    """The indexes as a scan of the records defines them."""
    leases = sorted(
        (r.lease_until, (k.deployment_epoch, k.session_id, k.nonce)) for k, r in model.items()
        if r.state in LEASED and r.lease_until is not None
    )
    tombs = sorted(
        (k.born, (k.deployment_epoch, k.session_id, k.nonce)) for k, r in model.items()
        if r.state in TOMBSTONES and k.born is not None
    )
    return leases, tombs


class TableMachine(RuleBasedStateMachine):
    """Every update of the table agrees with a dict; old tables never change; the indexes
    always equal what a scan of the records gives."""

    def __init__(self):
        super().__init__()
        self.table = SessionTable()
        self.model: dict = {}
        self.history: list = []  # (table, model copy): persistence

    def _after(self, table, model):
        self.history.append((self.table, dict(self.model)))
        self.table, self.model = table, model

    @rule(key=st.sampled_from(KEYS), record=records)
    def set(self, key, record):
        record = attrs.evolve(record, key=key)
        self._after(self.table.set(key, record), {**self.model, key: record})

    @rule(pairs=st.lists(st.tuples(st.sampled_from(KEYS), records), max_size=6))
    def update(self, pairs):
        pairs = [(k, attrs.evolve(r, key=k)) for k, r in pairs]
        self._after(self.table.update(pairs), {**self.model, **dict(pairs)})

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def remove_many(self, keys):
        self._after(self.table.remove_many(keys), {k: r for k, r in self.model.items() if k not in keys})

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        if key in self.model:
            self._after(self.table.remove(key), {k: r for k, r in self.model.items() if k != key})
        else:
            with pytest.raises(KeyError):
                self.table.remove(key)

    @rule(now=st.sampled_from([-1.0, 0.0, 5.0, 7.0, 11.0, 2e9]))
    def due(self, now):
        leases, tombs = expected_indexes(self.model)
        assert self.table.leases_due(now) == [SessionKey(*k) for d, k in leases if d < now]
        assert self.table.tombstones_born_before(now + 1000) == [SessionKey(*k) for b, k in tombs if b < now + 1000]

    @invariant()
    def agrees_with_the_dict(self):
        assert len(self.table) == len(self.model)
        assert dict(self.table.items()) == self.model
        assert self.table == SessionTable(self.model) and self.table == self.model
        for k in KEYS:
            assert (k in self.table) == (k in self.model)
            assert self.table.get(k) == self.model.get(k)
        assert self.table.index_entries() == expected_indexes(self.model)

    @invariant()
    def older_tables_are_unchanged(self):
        for table, model in self.history[-3:]:
            assert dict(table.items()) == model


TestTableMachine = TableMachine.TestCase


# -- the trie, with hashes chosen to collide ------------------------------------------------------------
class Collider:
    """A key whose hash is chosen: many keys share hash bits at every depth, or the whole hash."""

    def __init__(self, name: int, hashed: int) -> None:
        self.name, self.hashed = name, hashed

    def __hash__(self) -> int:
        return self.hashed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Collider) and other.name == self.name


HASHES = [0, 1, 33, 1 << 59, (1 << 60) + 1, -2, (1 << 40) + 1, 1 << 40]


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.sampled_from(HASHES))))
def test_the_trie_under_colliding_hashes(ops):
    """Lookups, updates and removals agree with a dict whatever the hashes; removing every key
    leaves the empty node; a bulk build holds the same items."""
    root, model, keys = T._EMPTY_NODE, {}, {}
    for insert, i, hashed in ops:
        key = keys.setdefault(i, Collider(i, hashed))  # one key, one hash
        h = T._hash(key)
        if insert:
            root, added = T._assoc(root, 0, h, key, i * 10)
            assert added == (key not in model)
            model[key] = i * 10
        elif key in model:
            root = T._without(root, 0, h, key) or T._EMPTY_NODE
            del model[key]
        for k, v in model.items():
            assert T._lookup(root, T._hash(k), k) == v
        absent = Collider(-1, hashed)
        assert T._lookup(root, T._hash(absent), absent) is T._MISSING
        assert dict(T._items(root)) == model
    rebuilt = T._build([(T._hash(k), k, v) for k, v in model.items()], 0) if model else T._EMPTY_NODE
    assert dict(T._items(rebuilt)) == model
    for k in model:
        assert T._lookup(rebuilt, T._hash(k), k) == model[k]
    for k in list(model):
        root = T._without(root, 0, T._hash(k), k) or T._EMPTY_NODE
    assert root == T._EMPTY_NODE


# -- the collector does not track it ---------------------------------------------------------------
def _tuples_in(table: SessionTable) -> list[tuple]:
    found, stack = [], [table._root, table._leases, table._tombs]
    while stack:
        t = stack.pop()
        found.append(t)
        stack.extend(x for x in t if type(x) is tuple)
    return found


def test_a_full_table_is_one_tracked_object_once_the_collector_has_seen_it():
    state, _ = publish(R.new_registry(EP, E, lease_ttl=100.0, tombstone_window=300.0), "A")
    for i in range(3000):
        k = SessionKey(EP, f"x{i}", new_nonce(10_000 + i, f"{i:08x}"))
        state = R.handle(state, BindFirst(k, now=10_000 + i)).state
        if i % 3 == 0:
            state = R.handle(state, CloseAndRelease(k, now=10_000 + i)).state
    nodes = _tuples_in(state.sessions)
    assert len(nodes) > 3000
    for _ in range(8):  # a node is untracked once everything in it is: one level a pass at worst
        gc.collect()
    assert [t for t in nodes if gc.is_tracked(t)] == []
    assert gc.is_tracked(state.sessions)  # the table itself: one object


def test_the_previous_representation_tracked_several_objects_a_session():
    """The control for the test above: a PMap of attrs records keeps every session tracked."""
    old = pmap({k: SessionRecord(k, SessionState.BOUND, V[0], True, 5.0) for k in KEYS})
    gc.collect()
    assert all(gc.is_tracked(k) and gc.is_tracked(r) for k, r in old.items())


# -- values, pickling, earlier stores ----------------------------------------------------------------
def _table_of(n: int) -> SessionTable:
    return SessionTable({
        k: SessionRecord(k, SessionState.BOUND if i % 2 else SessionState.CLOSED, V[i % 2], bool(i % 2), float(i))
        for i, k in enumerate(SessionKey(EP, f"p{i}", new_nonce(500 + i, "abcdef")) for i in range(n))
    })


def test_a_table_pickles_as_its_items_and_comes_back_equal_with_its_indexes():
    table = _table_of(600)
    again = pickle.loads(pickle.dumps(table, protocol=pickle.HIGHEST_PROTOCOL))
    assert again == table and again is not table
    assert again.index_entries() == table.index_entries()
    assert again.leases_due(300.0) == table.leases_due(300.0)
    assert len(again.tombstones_born_before(800)) == 150


def test_a_record_is_stored_as_atoms_and_read_back_as_the_same_values():
    key = KEYS[0]
    record = SessionRecord(key, SessionState.BOUND, V[1], True, 12.5)
    table = SessionTable().set(key, record)
    (atoms,) = list(table.atoms())
    assert atoms == ((EP, "s0", "own"), ("BOUND", (EP, "B"), True, 12.5))
    assert table[key] == record
    assert table.get("not a key") is None and "not a key" not in table
    with pytest.raises(KeyError):
        table[KEYS[1]]


def _earlier_state(state: R.RegistryState) -> R.RegistryState:
    """``state`` as an earlier release held it: sessions in a PMap of records."""
    old = attrs.evolve(state)
    object.__setattr__(old, "sessions", pmap(dict(state.sessions.items())))
    return old


@pytest.fixture
def bound_state():
    state, _ = publish(R.new_registry(EP, E), "A")
    for i in range(40):
        state = R.handle(state, BindFirst(SessionKey(EP, f"b{i}", "n"), now=100.0)).state
    return R.handle(state, CloseAndRelease(SessionKey(EP, "b0", "n"), now=101.0)).state


def test_a_file_store_an_earlier_release_wrote_resumes_as_a_table(tmp_path, bound_state):
    FileStore(str(tmp_path / "r.pickle")).save(_earlier_state(bound_state))
    registry = LocalRegistry(EP, E, store=FileStore(str(tmp_path / "r.pickle")))
    assert isinstance(registry.state.sessions, SessionTable)
    assert registry.state == bound_state
    assert len(registry.apply(ExpireLeases(now=10**6)).reply) == 39


def test_a_sqlite_snapshot_an_earlier_release_wrote_resumes_as_a_table(tmp_path, bound_state, monkeypatch):
    from lorapub.adapters.stores import sqlite_store as stores

    def earlier_parts(state, entries):  # the snapshot layout before the session table
        old = _earlier_state(state)
        head = attrs.evolve(old, versions=pmap(), attempts=pmap(), engines=pmap(), reprovisions=pmap())
        object.__setattr__(head, "sessions", pmap())
        yield head
        for name in ("engines", "versions", "attempts", "sessions", "reprovisions"):
            items = list(getattr(old, name).items())
            for i in range(0, len(items), entries):
                yield (name, items[i:i + entries])

    monkeypatch.setattr(stores, "snapshot_parts", earlier_parts)
    store = SQLiteStore(str(tmp_path / "r.db"), part_entries=7)
    store.save(bound_state)
    store.close()
    monkeypatch.undo()
    registry = LocalRegistry(EP, E, store=SQLiteStore(str(tmp_path / "r.db")))
    assert isinstance(registry.state.sessions, SessionTable)
    assert registry.state == bound_state


# -- the expiry pass reads the indexes -----------------------------------------------------------
def test_expire_leases_reads_only_what_is_due_and_agrees_with_a_scan():
    state, _ = publish(R.new_registry(EP, E, lease_ttl=100.0, tombstone_window=300.0), "A")
    keys = [SessionKey(EP, f"e{i}", new_nonce(10_000 + i, f"{i:08x}")) for i in range(50)]
    for i, k in enumerate(keys):
        state = R.handle(state, BindFirst(k, now=10_000 + i)).state
    state = R.handle(state, RenewLeases(tuple(keys[::2]), now=10_040)).state
    state = R.handle(state, CloseAndRelease(keys[1], now=10_041)).state
    for now in (10_099.5, 10_120, 10_141, 10_400, 10_700):
        by_index = R.expire_leases(state, R.ExpireLeases(now))
        by_scan = expire_by_scan(state, now)
        assert by_index.state == by_scan.state and by_index.reply == by_scan.reply
        assert by_index.effects == by_scan.effects
        state = by_index.state
        assert state.sessions.index_entries() == expected_indexes(dict(state.sessions.items()))
    assert len(state.sessions) == 0 and state.forgotten_sessions == 50 and state.expired_sessions == 49


def test_a_clock_reading_that_is_not_a_number_takes_the_scan(bound_state):
    state = R.handle(bound_state, OpenSession(SessionKey(EP, "nan", "n"), now=math.nan)).state
    assert R.expire_leases(state, R.ExpireLeases(math.nan)) == expire_by_scan(state, math.nan)
    out = R.expire_leases(state, R.ExpireLeases(200.0))  # a NaN deadline is never ">= now": due at once, as before
    assert SessionKey(EP, "nan", "n") in {k for k, r in out.state.sessions.items() if r.state is SessionState.EXPIRED}
