"""Pickling for the core's attrs values that a durable store keeps, across releases.

A field an earlier release's pickle lacks gets its default (attrs' own ``__setstate__`` leaves it unset).
A class opts in by naming both in its body: ``__getstate__ = getstate``, ``__setstate__ = setstate``.
See docs/design.md, "Durable store".
"""

from __future__ import annotations

import attrs
from attrs import AttrsInstance


def getstate(self: AttrsInstance) -> dict[str, object]:
    return {a.name: getattr(self, a.name) for a in attrs.fields(type(self))}


def setstate(self: AttrsInstance, state: dict[str, object] | tuple[object, ...]) -> None:
    if isinstance(state, tuple):  # attrs before 22.2 pickled the values in field order
        state = {a.name: v for a, v in zip(attrs.fields(type(self)), state)}
    for a in attrs.fields(type(self)):
        if a.name in state:
            value = state[a.name]
        elif isinstance(a.default, attrs.Factory):  # type: ignore[arg-type]
            value = a.default.factory()
        elif a.default is not attrs.NOTHING:
            value = a.default
        else:
            raise TypeError(f"a pickled {type(self).__name__} lacks {a.name!r}, which has no default")
        object.__setattr__(self, a.name, value)
