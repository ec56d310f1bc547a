"""Pickling for the core's attrs values that a durable store keeps, across releases.

A store written by an earlier release holds values pickled with the fields that release had.
attrs' own ``__setstate__`` leaves a field the pickle lacks unset (an ``AttributeError`` at the
first read); these give it its default instead. A class opts in by naming both in its body
(attrs then generates neither)::

    __getstate__ = getstate
    __setstate__ = setstate
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
