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


def test_both_machines_speak_one_dialect_and_refuse_a_stranger_as_invalid_input():
    """The registry and the staging machine: ``handle(state, command) -> Outcome`` through a Table of
    ``on(Command, handler)`` rows; a value no row takes is InvalidInput, and nothing changed."""
    import pytest

    from lorapub.core.door import Table
    from lorapub.core.staging import machine as M
    from lorapub.errors import InvalidInput

    assert isinstance(R.TRANSITIONS, Table) and isinstance(R.QUERY_HANDLERS, Table) and isinstance(M.COMMANDS, Table)
    for query in C.QUERIES:
        assert R.QUERY_HANDLERS[query] is getattr(R, _snake(query.__name__)), query
    for command in M.COMMANDS:
        assert M.COMMANDS[command] is getattr(M, _snake(command.__name__)), command
    registry, staging = R.new_registry(1, {"e0": "life"}), M.new_state("life")
    for handle, state, stranger in ((R.handle, registry, M.Close()), (M.handle, staging, C.ReadState()),
                                    (R.handle, registry, object()), (M.handle, staging, "Close")):
        with pytest.raises(InvalidInput, match="is not a"):
            handle(state, stranger)


def test_a_table_takes_one_row_per_command():
    import pytest

    from lorapub.core.door import Table, on

    with pytest.raises(ValueError, match="two"):
        Table("registry", on(C.ReadState, R.read_state), on(C.ReadState, R.read_state))

