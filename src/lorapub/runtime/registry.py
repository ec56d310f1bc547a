"""Moved to :mod:`lorapub.local_registry` (beside the ports: the Ray actor's adapter runs it too).
Importing a name from this old path fails, naming the new one.
"""

from __future__ import annotations

from lorapub._moved import moved

__all__: list[str] = []
__getattr__ = moved(__name__, dict.fromkeys(("LocalRegistry", "MemoryStore"), "lorapub.local_registry"))
