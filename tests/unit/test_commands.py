"""The one door: every command value has exactly one transition (or query) of its name."""

from __future__ import annotations

import re

import attrs

from lorapub.core import commands as C
from lorapub.core import registry as R


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_every_command_has_one_handler_of_its_name():
    values = {cls for cls in vars(C).values() if isinstance(cls, type) and attrs.has(cls) and cls.__module__ == C.__name__}
    assert values == set(R.COMMANDS)
    assert set(C.QUERIES) == set(R._QUERIES)
    for cls in set(R.COMMANDS) - set(C.QUERIES):
        assert R._TRANSITIONS[cls] is getattr(R, _snake(cls.__name__)), cls


def test_a_query_never_changes_the_state():
    state = R.new_registry(1, {"e0": "life"})
    for query in (C.ReadState(), C.ListReclaimable()):
        assert R.handle(state, query).state is state
