"""The registry's session records, kept where the garbage collector does not look.

A :class:`SessionTable` holds every session as plain tuples of atoms (a persistent hash trie of tuples,
with sorted lease and tombstone indexes), which CPython's cyclic collector stops tracking: a full
collection then costs the same whatever the number of sessions.
See docs/design.md, "Session records out of the collector's sight".
"""

from __future__ import annotations

import enum
import functools
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, TypeVar, overload

from lorapub.core.identity import SessionKey, VersionKey, born_of
from lorapub.core.session import LEASED, TOMBSTONES, SessionRecord, SessionState

__all__ = ["SessionTable"]

#: ``(deployment_epoch, session_id, nonce)``
KeyAtoms = tuple[int, str, str]
#: ``(deployment_epoch, version_id)``
VersionAtoms = tuple[int, str]
#: ``(state value, version atoms, holds_ref, lease_until)``, with ``group, rebinds`` after them for a
#: group member or a rebound session
RecordAtoms = (
    tuple[str, VersionAtoms | None, bool, float | None]
    | tuple[str, VersionAtoms | None, bool, float | None, str | None, int]
)
Pair = tuple[KeyAtoms, RecordAtoms]
#: ``(lease_until or born, key atoms)``
IndexEntry = tuple[float, KeyAtoms]
#: ``(chunks, maxes)``: sorted chunks of entries and the last entry of each
Index = tuple[tuple[tuple[IndexEntry, ...], ...], tuple[IndexEntry, ...]]
#: A trie node, ``(bitmap, k0, v0, k1, v1, ...)`` or ``(-1, hash, k0, v0, ...)``: an int, then key atoms
#: and record atoms in turn, a slot whose key is None holding a child node. Its items are told apart by
#: position, which no tuple type can say, hence ``Any``.
Node = tuple[Any, ...]
_T = TypeVar("_T")


class _Missing(enum.Enum):
    MISSING = enum.auto()


_EMPTY_NODE: Node = (0,)
_MISSING: Final = _Missing.MISSING
_HASH_MASK = (1 << 64) - 1
_CHUNK = 256  # index entries per chunk (a chunk is split above twice this)

_STATE_OF = {s.value: s for s in SessionState}
_LEASED = frozenset(s.value for s in LEASED)
_TOMBSTONES = frozenset(s.value for s in TOMBSTONES)


# -- values <-> atoms ---------------------------------------------------------------------
def _key_atoms(key: SessionKey) -> KeyAtoms:
    return (key.deployment_epoch, key.session_id, key.nonce)


# A version is held by many sessions: its atoms are made once and shared (and its key made
# once on the way out). Both caches hold immutable values: a few entries an epoch.
@functools.lru_cache(maxsize=1024)
def _shared_version_atoms(key: VersionKey) -> VersionAtoms:
    return (key.deployment_epoch, key.version_id)


@functools.lru_cache(maxsize=1024)
def _shared_version(atoms: VersionAtoms) -> VersionKey:
    return VersionKey(*atoms)


def _version_atoms(key: VersionKey | None) -> VersionAtoms | None:
    return None if key is None else _shared_version_atoms(key)


def _version(atoms: VersionAtoms | None) -> VersionKey | None:
    return None if atoms is None else _shared_version(atoms)


def _record_atoms(record: SessionRecord) -> RecordAtoms:
    if record.group is None and not record.rebinds:  # the common record: four atoms, as before groups
        return (record.state.value, _version_atoms(record.version), record.holds_ref, record.lease_until)
    return (record.state.value, _version_atoms(record.version), record.holds_ref, record.lease_until,
            record.group, record.rebinds)


def _record(key: SessionKey, r: RecordAtoms) -> SessionRecord:
    if len(r) == 4:
        return SessionRecord(key, _STATE_OF[r[0]], _version(r[1]), r[2], r[3])
    return SessionRecord(key, _STATE_OF[r[0]], _version(r[1]), r[2], r[3], r[4], r[5])


def _lease_entry(k: KeyAtoms, r: RecordAtoms) -> IndexEntry | None:
    """The lease index entry of a record: a lease keeps its ref alive until ``lease_until``."""
    lease = r[3]
    if lease is None or r[0] not in _LEASED:
        return None
    # a NaN deadline is never ">= now": due at every pass, as -inf is
    return (-math.inf if lease != lease else lease, k)


def _tomb_entry(k: KeyAtoms, r: RecordAtoms) -> IndexEntry | None:
    if r[0] not in _TOMBSTONES:
        return None
    born = born_of(k[2])
    return None if born is None else (born, k)


# -- the trie ---------------------------------------------------------------------------------
def _hash(k: KeyAtoms) -> int:
    return hash(k) & _HASH_MASK


def _lookup(node: Node, h: int, key: KeyAtoms) -> RecordAtoms | _Missing:
    value: RecordAtoms
    shift = 0
    while True:
        bitmap = node[0]
        if bitmap < 0:  # one full hash
            for i in range(2, len(node), 2):
                if node[i] == key:
                    value = node[i + 1]
                    return value
            return _MISSING
        bit = 1 << ((h >> shift) & 31)
        if not bitmap & bit:
            return _MISSING
        i = 2 * (bitmap & (bit - 1)).bit_count() + 1
        k = node[i]
        if k is None:
            node, shift = node[i + 1], shift + 5
        elif k == key:
            value = node[i + 1]
            return value
        else:
            return _MISSING


def _pair(shift: int, h1: int, k1: KeyAtoms, v1: RecordAtoms, h2: int, k2: KeyAtoms, v2: RecordAtoms) -> Node:
    if h1 == h2:
        return (-1, h1, k1, v1, k2, v2)
    b1, b2 = (h1 >> shift) & 31, (h2 >> shift) & 31
    if b1 == b2:
        return (1 << b1, None, _pair(shift + 5, h1, k1, v1, h2, k2, v2))
    if b1 < b2:
        return ((1 << b1) | (1 << b2), k1, v1, k2, v2)
    return ((1 << b1) | (1 << b2), k2, v2, k1, v1)


def _assoc(node: Node, shift: int, h: int, key: KeyAtoms, value: RecordAtoms) -> tuple[Node, bool]:
    """``node`` with ``key -> value``; and whether the key is new."""
    bitmap = node[0]
    if bitmap < 0:
        if h == node[1]:
            for i in range(2, len(node), 2):
                if node[i] == key:
                    return node[:i + 1] + (value,) + node[i + 2:], False
            return node + (key, value), True
        # another hash reaches this node: it becomes a child of a bitmap node
        return _assoc((1 << ((node[1] >> shift) & 31), None, node), shift, h, key, value)
    bit = 1 << ((h >> shift) & 31)
    i = 2 * (bitmap & (bit - 1)).bit_count() + 1
    if not bitmap & bit:
        return (bitmap | bit,) + node[1:i] + (key, value) + node[i:], True
    k = node[i]
    if k is None:
        child, added = _assoc(node[i + 1], shift + 5, h, key, value)
        return node[:i + 1] + (child,) + node[i + 2:], added
    if k == key:
        return node[:i + 1] + (value,) + node[i + 2:], False
    child = _pair(shift + 5, _hash(k), k, node[i + 1], h, key, value)
    return node[:i] + (None, child) + node[i + 2:], True


def _without(node: Node, shift: int, h: int, key: KeyAtoms) -> Node | None:
    """``node`` without ``key`` (``None`` when nothing is left); the caller checked it is there."""
    bitmap = node[0]
    if bitmap < 0:
        for i in range(2, len(node), 2):
            if node[i] == key:
                rest = node[:i] + node[i + 2:]
                return rest if len(rest) > 2 else None
        raise KeyError(key)
    bit = 1 << ((h >> shift) & 31)
    i = 2 * (bitmap & (bit - 1)).bit_count() + 1
    if node[i] is None:
        child = _without(node[i + 1], shift + 5, h, key)
        if child is None:
            replacement: Node = ()
        elif len(child) == 4 and child[0] == -1:  # a one-key hash node: pulled up as a plain slot
            replacement = (child[2], child[3])
        elif len(child) == 3 and child[0] >= 0 and child[1] is not None:  # one plain slot: pulled up
            replacement = (child[1], child[2])
        else:
            return node[:i + 1] + (child,) + node[i + 2:]
    else:
        replacement = ()
    if not replacement:
        bitmap &= ~bit
        if not bitmap:
            return None
        return (bitmap,) + node[1:i] + node[i + 2:]
    return node[:i] + replacement + node[i + 2:]


def _items(root: Node) -> Iterator[Pair]:
    stack = [root]
    while stack:
        node = stack.pop()
        start = 2 if node[0] < 0 else 1
        for i in range(start, len(node), 2):
            k = node[i]
            if k is None:
                stack.append(node[i + 1])
            else:
                yield k, node[i + 1]


def _build(entries: list[tuple[int, KeyAtoms, RecordAtoms]], shift: int) -> Node:
    """A node of ``entries`` ``(hash, key, value)`` (distinct keys, at least one)."""
    groups: dict[int, list[tuple[int, KeyAtoms, RecordAtoms]]] = {}
    for e in entries:
        groups.setdefault((e[0] >> shift) & 31, []).append(e)
    bitmap = 0
    slots: list[object] = []
    for b in sorted(groups):
        group = groups[b]
        bitmap |= 1 << b
        if len(group) == 1:
            slots += (group[0][1], group[0][2])
        elif all(e[0] == group[0][0] for e in group):
            node: list[object] = [-1, group[0][0]]
            for e in group:
                node += (e[1], e[2])
            slots += (None, tuple(node))
        else:
            slots += (None, _build(group, shift + 5))
    return (bitmap, *slots)


# -- the sorted indexes: (chunks, maxes), chunks a tuple of sorted tuples -----------------------
_NO_INDEX: Index = ((), ())


def _index_of(entries: list[IndexEntry]) -> Index:
    entries.sort()
    chunks = tuple(tuple(entries[i:i + _CHUNK]) for i in range(0, len(entries), _CHUNK))
    return chunks, tuple(c[-1] for c in chunks)


def _index_add(index: Index, entries: list[IndexEntry]) -> Index:
    if not entries:
        return index
    chunks, maxes = index
    if not chunks:
        return _index_of(entries)
    last = len(chunks) - 1
    groups: dict[int, list[IndexEntry]] = {}
    for e in entries:
        groups.setdefault(min(bisect_left(maxes, e), last), []).append(e)
    chunks_, maxes_ = list(chunks), list(maxes)
    for j in sorted(groups, reverse=True):
        group = groups[j]
        if len(group) < 8:  # a few entries: binary insertion
            merged = list(chunks[j])
            for e in group:
                insort(merged, e)
        else:  # many (a batch of renewals): one merge of two sorted runs
            merged = sorted(chunks[j] + tuple(group))
        if len(merged) <= 2 * _CHUNK:
            pieces = [tuple(merged)]
        else:
            pieces = [tuple(merged[i:i + _CHUNK]) for i in range(0, len(merged), _CHUNK)]
        chunks_[j:j + 1] = pieces
        maxes_[j:j + 1] = [p[-1] for p in pieces]
    return tuple(chunks_), tuple(maxes_)


def _index_drop(index: Index, entries: list[IndexEntry]) -> Index:
    """``index`` without ``entries`` (each is in it)."""
    if not entries:
        return index
    chunks, maxes = index
    groups: dict[int, list[IndexEntry]] = {}
    for e in entries:
        groups.setdefault(bisect_left(maxes, e), []).append(e)
    chunks_, maxes_ = list(chunks), list(maxes)
    for j in sorted(groups, reverse=True):
        chunk = list(chunks[j])
        for e in sorted(groups[j], reverse=True):
            i = bisect_left(chunk, e)
            if i == len(chunk) or chunk[i] != e:
                raise AssertionError(f"session index out of step: {e!r} is not in it")
            del chunk[i]
        if chunk:
            if len(chunk) < _CHUNK // 4 and j + 1 < len(chunks_) and len(chunks_[j + 1]) < _CHUNK:
                # a small chunk joins its next one: chunks stay few as entries leave
                chunk += chunks_[j + 1]
                chunks_[j:j + 2] = [tuple(chunk)]
                maxes_[j:j + 2] = [chunk[-1]]
            else:
                chunks_[j] = tuple(chunk)
                maxes_[j] = chunk[-1]
        else:
            del chunks_[j], maxes_[j]
    return tuple(chunks_), tuple(maxes_)


def _index_below(index: Index, bound: float) -> list[IndexEntry]:
    """Entries whose first item is < ``bound``, in order."""
    chunks, maxes = index
    probe = (bound,)  # sorts before every (bound, key): strictly below
    j = bisect_left(maxes, probe)
    due = [e for chunk in chunks[:j] for e in chunk]
    if j < len(chunks):
        chunk = chunks[j]
        due += chunk[:bisect_left(chunk, probe)]
    return due


def _index_entries(index: Index) -> list[IndexEntry]:
    return [e for chunk in index[0] for e in chunk]


# -- the table ------------------------------------------------------------------------------------
class SessionTable(Mapping[SessionKey, SessionRecord]):
    """``SessionKey -> SessionRecord``, persistent, with a lease index and a tombstone index.

    Reads hand out ``SessionKey`` and ``SessionRecord`` values made on the way out; a read-only
    ``Mapping`` whose updates (:meth:`set`, :meth:`remove`, :meth:`update`) return a new table, like
    ``PMap``'s. Pickled, it is the list of its items (the trie's shape depends on this process's
    string hashes); it is rebuilt on load."""

    __slots__ = ("_root", "_size", "_leases", "_tombs")
    _root: Node
    _size: int
    _leases: Index
    _tombs: Index

    def __init__(self, records: Mapping[SessionKey, SessionRecord] | None = None) -> None:
        raw = [] if records is None else [(_key_atoms(k), _record_atoms(r)) for k, r in records.items()]
        self._fill(raw)

    def _fill(self, raw: list[Pair]) -> None:
        self._root = _build([(_hash(k), k, r) for k, r in raw], 0) if raw else _EMPTY_NODE
        self._size = len(raw)
        self._leases = _index_of([e for e in (_lease_entry(k, r) for k, r in raw) if e is not None])
        self._tombs = _index_of([e for e in (_tomb_entry(k, r) for k, r in raw) if e is not None])
        if len(self._leases[0]) == 0:
            self._leases = _NO_INDEX
        if len(self._tombs[0]) == 0:
            self._tombs = _NO_INDEX

    @classmethod
    def from_atoms(cls, raw: Iterable[Pair]) -> "SessionTable":
        """A table of ``(key atoms, record atoms)`` pairs, as :meth:`atoms` gives them."""
        table = cls.__new__(cls)
        table._fill(list(raw))
        return table

    def atoms(self) -> Iterator[Pair]:
        """Every ``(key atoms, record atoms)`` pair (what a snapshot stores)."""
        return _items(self._root)

    def __reduce__(self) -> tuple[Callable[[Iterable[Pair]], SessionTable], tuple[list[Pair]]]:
        return (SessionTable.from_atoms, (list(self.atoms()),))

    # -- reads -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: SessionKey) -> SessionRecord:
        found = self.get(key, _MISSING)
        if found is _MISSING:
            raise KeyError(key)
        return found

    @overload
    def get(self, key: SessionKey, /) -> SessionRecord | None: ...

    @overload
    def get(self, key: SessionKey, default: SessionRecord | _T, /) -> SessionRecord | _T: ...

    def get(self, key: SessionKey, default: object = None) -> object:
        if not isinstance(key, SessionKey):
            return default
        k = _key_atoms(key)
        r = _lookup(self._root, _hash(k), k)
        return default if r is _MISSING else _record(key, r)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, SessionKey):
            return False
        k = _key_atoms(key)
        return _lookup(self._root, _hash(k), k) is not _MISSING

    def __iter__(self) -> Iterator[SessionKey]:
        for k, _ in _items(self._root):
            yield SessionKey(*k)

    # A list (made once), not Mapping's view that would look every key up again.
    def items(self) -> list[tuple[SessionKey, SessionRecord]]:  # type: ignore[override]
        return [(key, _record(key, r)) for key, r in ((SessionKey(*k), r) for k, r in _items(self._root))]

    def values(self) -> list[SessionRecord]:  # type: ignore[override]
        return [v for _, v in self.items()]

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, SessionTable):
            return self._size == other._size and dict(self.atoms()) == dict(other.atoms())
        if isinstance(other, Mapping):
            return len(self) == len(other) and dict(self.items()) == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self.atoms()))

    def __repr__(self) -> str:
        return f"SessionTable({len(self)} sessions)"

    # -- the indexes -------------------------------------------------------------------------
    def leases_due(self, now: float) -> list[SessionKey]:
        """Sessions a lease keeps alive whose ``lease_until < now``, soonest first."""
        return [SessionKey(*k) for _, k in _index_below(self._leases, now)]

    def tombstones_born_before(self, cutoff: float) -> list[SessionKey]:
        """Tombstones of sessions whose nonce says they were born before ``cutoff``."""
        return [SessionKey(*k) for _, k in _index_below(self._tombs, cutoff)]

    def index_entries(self) -> tuple[list[IndexEntry], list[IndexEntry]]:
        """The lease and tombstone indexes, as sorted lists (for tests)."""
        return _index_entries(self._leases), _index_entries(self._tombs)

    # -- updates: a new table --------------------------------------------------------------
    def set(self, key: SessionKey, record: SessionRecord) -> "SessionTable":
        return self.update(((key, record),))

    def update(self, pairs: Iterable[tuple[SessionKey, SessionRecord]]) -> "SessionTable":
        """A new table with every ``key -> record`` of ``pairs`` set (the last one of a key wins)."""
        return self._change([(_key_atoms(k), _record_atoms(r)) for k, r in pairs], ())

    def remove(self, key: SessionKey) -> "SessionTable":
        if key not in self:
            raise KeyError(key)
        return self._change((), (_key_atoms(key),))

    def remove_many(self, keys: Iterable[SessionKey]) -> "SessionTable":
        """A new table without ``keys`` (keys it does not hold are skipped)."""
        return self._change((), [_key_atoms(k) for k in keys])

    def _change(self, sets: Iterable[Pair], removes: Iterable[KeyAtoms]) -> "SessionTable":
        root, size = self._root, self._size
        lease_drop: list[IndexEntry] = []
        lease_add: dict[IndexEntry, None] = {}
        tomb_drop: list[IndexEntry] = []
        tomb_add: dict[IndexEntry, None] = {}
        for k, r in sets:
            h = _hash(k)
            old = _lookup(root, h, k)
            if old is not _MISSING:
                if old == r:
                    continue
                _step(lease_drop, lease_add, _lease_entry(k, old), _lease_entry(k, r))
                _step(tomb_drop, tomb_add, _tomb_entry(k, old), _tomb_entry(k, r))
            else:
                _step(lease_drop, lease_add, None, _lease_entry(k, r))
                _step(tomb_drop, tomb_add, None, _tomb_entry(k, r))
            root, added = _assoc(root, 0, h, k, r)
            size += added
        for k in removes:
            h = _hash(k)
            old = _lookup(root, h, k)
            if old is _MISSING:
                continue
            _step(lease_drop, lease_add, _lease_entry(k, old), None)
            _step(tomb_drop, tomb_add, _tomb_entry(k, old), None)
            root = _without(root, 0, h, k) or _EMPTY_NODE
            size -= 1
        if root is self._root:
            return self
        table = SessionTable.__new__(SessionTable)
        table._root, table._size = root, size
        table._leases = _index_add(_index_drop(self._leases, lease_drop), list(lease_add))
        table._tombs = _index_add(_index_drop(self._tombs, tomb_drop), list(tomb_add))
        return table


def _step(drop: list[IndexEntry], add: dict[IndexEntry, None], old: IndexEntry | None, new: IndexEntry | None) -> None:
    """Record an index entry changing from ``old`` to ``new`` (either may be None)."""
    if old == new:
        return
    if old is not None:
        if old in add:  # set twice in one update: its first entry never reached the index
            del add[old]
        else:
            drop.append(old)
    if new is not None:
        add[new] = None
