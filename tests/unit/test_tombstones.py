"""Bounded registry memory: tombstones are forgotten after their window, late messages stay refused."""

from __future__ import annotations

import pytest

from lorapub.core import registry as R
from lorapub.core.commands import BeginClose, BindFirst, CloseAndRelease, ExpireLeases, OpenSession, RenewLeases
from lorapub.core.identity import SessionKey, new_nonce
from lorapub.core.session import SessionState
from lorapub.errors import InvalidInput, SessionExpired
from tests.unit.test_core_rows import EP, E, publish

BORN = 10_000


def born_key(i: int, born: int = BORN) -> SessionKey:
    return SessionKey(EP, f"s{i}", new_nonce(born, f"{i:08x}"))


@pytest.fixture
def state():
    s, _ = publish(R.new_registry(EP, E, lease_ttl=100.0, tombstone_window=300.0), "A")
    return s


def test_memory_holds_live_sessions_and_only_the_window_of_tombstones(state):
    keys = [born_key(i) for i in range(50)]
    for k in keys:
        state = R.handle(state, BindFirst(k, now=BORN)).state
    for k in keys[:40]:
        state = R.handle(state, CloseAndRelease(k, now=BORN + 5)).state
    # live sessions renew their leases; 40 tombstones wait for the window
    state = R.handle(state, RenewLeases(tuple(keys[40:]), now=BORN + 250)).state
    state = R.handle(state, ExpireLeases(now=BORN + 260)).state
    assert len(state.sessions) == 50
    state = R.handle(state, RenewLeases(tuple(keys[40:]), now=BORN + 290)).state
    state = R.handle(state, ExpireLeases(now=BORN + 301)).state
    assert len(state.sessions) == 10 and state.forgotten_sessions == 40  # only the live ones are kept
    assert all(state.sessions[k].state is SessionState.BOUND for k in keys[40:])


def test_late_messages_for_a_forgotten_session_are_still_refused(state):
    k = born_key(1)
    state = R.handle(state, BindFirst(k, now=BORN)).state
    state = R.handle(state, CloseAndRelease(k, now=BORN + 1)).state
    state = R.handle(state, ExpireLeases(now=BORN + 400)).state
    assert k not in state.sessions
    for command in (BindFirst(k, now=BORN + 400), OpenSession(k, now=BORN + 400)):
        with pytest.raises(SessionExpired):
            R.handle(state, command)
    # a late close is answered and records nothing (no tombstone comes back)
    for command in (CloseAndRelease(k, now=BORN + 400), BeginClose(k, now=BORN + 400)):
        out = R.handle(state, command)
        assert out.reply is SessionState.CLOSED and out.state is state
    assert R.handle(state, RenewLeases((k,), now=BORN + 400)).reply == (k,)


def test_a_caller_nonce_keeps_its_tombstone_for_the_epoch(state):
    k = SessionKey(EP, "own", "my-nonce")
    state = R.handle(state, BindFirst(k, now=BORN)).state
    state = R.handle(state, CloseAndRelease(k, now=BORN)).state
    state = R.handle(state, ExpireLeases(now=BORN + 10**6)).state
    assert state.sessions[k].state is SessionState.CLOSED  # still refused by its tombstone
    with pytest.raises(Exception):
        R.handle(state, BindFirst(k, now=BORN + 10**6))


def test_a_fresh_session_binds_normally_and_a_window_shorter_than_two_leases_is_refused(state):
    k = born_key(2, born=BORN + 1000)
    assert R.handle(state, BindFirst(k, now=BORN + 1000)).reply.version.version_id == "A"
    with pytest.raises(InvalidInput):
        R.new_registry(EP, E, lease_ttl=100.0, tombstone_window=150.0)
