"""The core's three lifecycles each have one transition table, and every move goes through it: a move the
table lacks is InvalidTransition, never a silent state change (version.py, attempt.py, session.py)."""

from __future__ import annotations

import pytest

from lorapub.core import attempt as att
from lorapub.core import session as ses
from lorapub.core import version as ver
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey
from lorapub.errors import InvalidTransition


def reachable(table, start):
    seen, todo = {start}, [start]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("table, start, ends", [
    (ver._ALLOWED, ver.VersionState.LOADING, {ver.VersionState.RECLAIMED}),
    (att._ALLOWED, att.Phase.BEGINNING, {att.Phase.COMMITTED, att.Phase.CLEAN}),
    (ses._ALLOWED, ses.SessionState.OPEN, {ses.SessionState.CLOSED, ses.SessionState.EXPIRED}),
])
def test_each_table_covers_its_states_and_ends_only_in_its_final_states(table, start, ends):
    states = set(type(start))
    assert set(table) == states  # every state has a row
    assert reachable(table, start) == states  # and every state is reachable from the first
    assert {s for s, moves in table.items() if not moves} == ends


def test_an_attempt_moves_only_along_its_table():
    token = AttemptToken(VersionKey(1, "v"), 1)
    aborted = att.Attempt(token, "n", "d" * 64, None, 0, (), phase=att.Phase.ABORTED)  # type: ignore[arg-type]
    with pytest.raises(InvalidTransition):
        att.mark_committed(aborted)  # ABORTED -> COMMITTED is no move
    with pytest.raises(InvalidTransition):
        att._move(aborted, att.Phase.BEGINNING)
    assert att._move(aborted, att.Phase.CLEAN).phase is att.Phase.CLEAN


def test_a_session_moves_only_along_its_table_and_a_tombstone_stays_one():
    key = SessionKey(1, "s", "n0")
    bound = ses.bound(None, key, VersionKey(1, "v"))
    closed, release = ses.closed(bound, key)
    assert closed.state is ses.SessionState.CLOSED and release == VersionKey(1, "v")
    with pytest.raises(InvalidTransition):
        ses._move(closed, ses.SessionState.BOUND)
    assert ses.expired(closed) == (closed, None)  # expiring a tombstone changes nothing and releases nothing
    expired, release = ses.expired(bound)
    assert expired.state is ses.SessionState.EXPIRED and release == VersionKey(1, "v")
