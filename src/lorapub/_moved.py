"""Names that moved: an old module's ``__getattr__`` that fails with an ImportError naming where each
name lives now (the old path is never a second way to the same thing)."""

from __future__ import annotations

from typing import Callable, Mapping

__all__ = ["moved"]


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module``, whose ``names`` moved, each to the module it maps to."""

    def __getattr__(name: str) -> object:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        # ImportError (not AttributeError, which ``from … import`` would replace with its own words)
        raise ImportError(f"{module}.{name} moved: use `from {where} import {name}`", name=name)

    return __getattr__
