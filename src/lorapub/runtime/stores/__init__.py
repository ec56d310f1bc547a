"""Moved to :mod:`lorapub.adapters.stores` (the stores are adapters of the RegistryStore port).
This old path stays importable, its submodules too: each is the very module of the new path.
"""

from __future__ import annotations

import importlib
import sys

# Looked up by name, not imported: the runtime sits beneath the adapters and never depends on them;
# only an embedder's import of this old path loads them.
__all__ = ["FileStore", "SQLiteStore"]
_NEW = "lorapub.adapters.stores"
for _sub in ("file_store", "mark", "records", "sqlite_store"):
    sys.modules[f"{__name__}.{_sub}"] = importlib.import_module(f"{_NEW}.{_sub}")
sys.modules[__name__] = importlib.import_module(_NEW)
