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


def test_each_decision_records_its_facts_and_a_replay_records_none():
    """A READY taken, a commit that retires, a claim, each unload counted and the reclaim: facts of the
    transition that decided them; a late READY, a replayed commit or claim and a duplicate unload: none."""
    from lorapub.core import facts as F
    from lorapub.core.attempt import ReadyLocal
    from tests.unit.test_core_rows import E, key, publish, run_to_ready

    state = R.new_registry(3, E)
    state, token_a = publish(state, "A")
    state, token_b = run_to_ready(state, "B", ready_on=("e0",))
    digest_b = state.versions[key("B")].digest
    refused = R.handle(state, C.RecordReady(ReadyLocal("e1", token_b, "f" * 64, E["e1"])))  # another digest
    assert refused.facts == () and refused.state.attempts[token_b].phase.value == "ABORTED"
    out = R.handle(state, C.RecordReady(ReadyLocal("e1", token_b, digest_b, E["e1"])))
    assert out.facts == (F.Readied(key("B"), "e1"),)
    late = R.handle(out.state, C.RecordReady(ReadyLocal("e1", token_a, state.versions[key("A")].digest, E["e1"])))
    assert late.facts == ()
    out = R.handle(out.state, C.Commit(key("B"), token_b, out.state.default_revision))
    assert out.facts == (F.Retired(key("A"), key("B")),)
    assert R.handle(out.state, C.Commit(key("B"), token_b, 0)).facts == ()  # a replay
    out = R.handle(out.state, C.ClaimReclaim(key("A")))
    rid = out.reply
    assert out.facts == (F.Claimed(key("A"), rid),)
    assert R.handle(out.state, C.ClaimReclaim(key("A"))).facts == ()
    out = R.handle(out.state, C.RecordUnloaded(key("A"), rid, "e0"))
    assert out.facts == (F.Unloaded(key("A"), "e0"),)
    assert R.handle(out.state, C.RecordUnloaded(key("A"), rid, "e0")).facts == ()  # a duplicate receipt
    out = R.handle(out.state, C.RecordUnloaded(key("A"), rid, "e1"))
    assert out.facts == (F.Unloaded(key("A"), "e1"), F.Reclaimed(key("A")))
    assert R.handle(out.state, C.ReadState()).facts == ()
