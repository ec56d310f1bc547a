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
    assert set(C.QUERIES) == set(R.QUERY_HANDLERS)
    for cls in set(R.COMMANDS) - set(C.QUERIES):
        assert R.TRANSITIONS[cls] is getattr(R, _snake(cls.__name__)), cls


def test_a_query_never_changes_the_state():
    state = R.new_registry(1, {"e0": "life"})
    for query in (C.ReadState(), C.ListReclaimable()):
        assert R.handle(state, query).state is state



def test_every_command_that_takes_the_clock_is_stamped():
    from lorapub.core.identity import SessionKey

    assert set(C.STAMPED) == {cls for cls in R.COMMANDS if "now" in attrs.fields_dict(cls)}
    key = SessionKey(1, "s", "n")
    assert C.stamped(C.ExpireLeases(), 5.0) == C.ExpireLeases(now=5.0)
    assert C.stamped(C.OpenSession(key), 5.0) == C.OpenSession(key, now=5.0)
    assert C.stamped(C.OpenSession(key, now=1.0), 5.0) == C.OpenSession(key, now=1.0)  # stamped once
    assert C.stamped(C.ReadState(), 5.0) == C.ReadState()
