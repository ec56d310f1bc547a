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

from .file_store import FileStore
from .sqlite_store import SQLiteStore

__all__ = ["FileStore", "SQLiteStore"]
