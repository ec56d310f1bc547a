"""Moved to :mod:`lorapub.clock` (beside the ports: the registry in this process reads its clock too).
Importing a name from this old path fails, naming the new one.
"""

from __future__ import annotations

from lorapub._moved import moved

__all__: list[str] = []
__getattr__ = moved(__name__, dict.fromkeys(("SystemClock", "RegistryClock", "Elapsed"), "lorapub.clock"))
