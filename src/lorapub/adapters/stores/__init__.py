"""Registry stores: where the single writer keeps its state between calls.

``MemoryStore`` (in :mod:`lorapub.local_registry`) lives as long as the process; :class:`SQLiteStore`,
the recommended durable store, is a command log plus snapshots with a high-water mark beside it;
:class:`FileStore` rewrites the whole state on every decision. Every failure is typed and names the
file (:class:`~lorapub.errors.StoreError`, :class:`~lorapub.errors.StoreCorrupted`).
See docs/design.md, "Durable store".
"""

from __future__ import annotations

from .file_store import FileStore
from .sqlite_store import SQLiteStore

__all__ = ["FileStore", "SQLiteStore"]
