"""The core at training cadence, model-based: capacity N, waiting and superseded publications,
bounded staleness (``max_lag``, both ``on_stale`` policies), session groups and idle expiry,
racing everything the registry machine already races (lost, late and duplicate messages,
engine restarts, failed attempts, reclaims).

Invariants, after every step: slots <= N; a superseded publication is never reserved or
committed; a version's refs are exactly its bound solo sessions and groups; no session is
served by two versions unless it was rebound on purpose; a group never spans two versions;
a session told BINDING_STALE never dispatches again; no dispatch is authorized beyond
``max_lag``; every retiring version is reclaimable, and reclaimed once its receipts come.

One worker process is modelled too, with the runtime's own fleet view: its binds' replies may
outrun its view of the registry (ReadFleet answers arrive late and in any order). No result it
serves has a lag above ``max_lag``, and it never treats as stale a version the registry keeps.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, initialize, invariant, multiple, precondition, rule

from lorapub.core import registry as R
from lorapub.core.group import GroupState
from lorapub.core.identity import SessionKey, VersionKey
from lorapub.core.session import Binding, SessionState
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError
from lorapub.runtime.fleet import FleetView
from lorapub.testing.fixtures import fake_plan
from tests.property.test_registry_machine import EPOCH, SESSION_POOL, WINDOW, RegistryMachine

GROUPS = ("G0", "G1")


class FreshnessMachine(RegistryMachine):
    members = Bundle("members")

    @initialize(
        capacity=st.integers(2, 4), max_lag=st.sampled_from([None, 0, 1, 2]),
        on_stale=st.sampled_from(["error", "rebind"]),
    )
    def setup(self, capacity, max_lag, on_stale):
        RegistryMachine.setup.__wrapped__(self)
        if max_lag is not None:  # max_lag k needs k + 2 slots (smaller is refused: R.check_room_for_lag)
            capacity = max(capacity, max_lag + 2)
        self.state = R.new_registry(EPOCH, self.incarnations, capacity=capacity, lease_ttl=120.0,
                                    tombstone_window=WINDOW, max_lag=max_lag, on_stale=on_stale)
        self.waiting: list[VersionKey] = []  # every key that was answered Waiting once
        self.served: dict[SessionKey, list[VersionKey]] = {}  # versions each session dispatched on, in order
        self.stale_told: set[SessionKey] = set()  # told BINDING_STALE under on_stale="error"
        self.group_of: dict[SessionKey, str] = {}
        self.plans: dict = {}
        # the worker process: its fleet view (as Deployment.start leaves it), the ReadFleet answers
        # on their way to it, the binding it holds for each session, and what it served
        self.view = FleetView(None, {}, deadline=1.0)  # type: ignore[arg-type]  # only its pure part is used
        self.view.update(R.handle(self.state, R.ReadFleet(self.now)).reply)
        self.fleet_answers: list = []
        self.local: dict[SessionKey, Binding] = {}
        self.results: list[tuple[SessionKey, VersionKey, int]] = []  # (session, version, lag) served

    # the parent's session rules act without groups and assume a binding never moves: here they
    # are the group-aware ones
    def bind_first(self, key, lost_reply):
        self.bind_member(key)

    def dispatch(self, key):
        self.dispatch_member(key)

    # -- publication: waiting and superseded ---------------------------------------------
    @rule(target=RegistryMachine.versions, tensors=st.integers(1, 3))
    def reserve_waiting(self, tensors):
        """A publication that waits: answered Waiting (no slot, or an attempt runs) or reserved."""
        key = VersionKey(EPOCH, f"v{self.next_version}")
        self.next_version += 1
        digest, plan = fake_plan(key.version_id, tensors, cap=128)
        self.plans[key] = plan
        before = self.state.waiter
        result = self.try_apply(R.Reserve(key, digest, plan, wait=30.0))
        if isinstance(result, R.Waiting):
            assert self.state.waiter.key == key and key not in self.state.versions
            if before is not None and before.key != key:  # the newer call supersedes the older waiter
                assert self.state.superseded[before.key] == key
            self.waiting.append(key)
            self.digests[key] = digest
            return multiple()
        assert not isinstance(result, LorapubError), result
        if before is not None:
            assert self.state.superseded.get(before.key) == key
        self.digests[key] = digest
        return key

    @precondition(lambda self: self.state.waiter is not None)
    @rule()
    def waiter_asks_again(self):
        waiter = self.state.waiter
        result = self.try_apply(R.Reserve(waiter.key, waiter.digest, self.plans[waiter.key], wait=30.0))
        if not isinstance(result, (R.Waiting, LorapubError)):
            assert self.state.waiter is None and waiter.key in self.state.versions

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def superseded_call_asks_again(self, data):
        key = data.draw(st.sampled_from(self.waiting))
        if key in self.state.superseded:
            result = self.try_apply(R.Reserve(key, self.digests[key], self.plans[key], wait=30.0))
            assert getattr(result, "code", None) == "SUPERSEDED", result
            assert result.details["by"] == self.state.superseded[key]

    @precondition(lambda self: self.state.waiter is not None)
    @rule()
    def waiter_gives_up(self):
        key = self.state.waiter.key
        assert self.try_apply(R.CancelWait(key)) is True
        assert self.state.waiter is None


    # -- sessions, groups, staleness ----------------------------------------------------------
    @rule(target=members, i=st.integers(0, len(SESSION_POOL) - 1), group=st.sampled_from([None, *GROUPS]))
    def member(self, i, group):
        key = SESSION_POOL[i]
        self.group_of.setdefault(key, group)
        return key

    @rule(key=members)
    def open_member(self, key):
        result = self.try_apply(R.OpenSession(key, self.now, self.group_of.get(key)))
        if isinstance(result, LorapubError):
            assert result.code in ("SESSION_CLOSED", "SESSION_EXPIRED", "GROUP_CLOSED", "INVALID_INPUT"), result

    @rule(key=members)
    def bind_member(self, key):
        result = self.try_apply(R.BindFirst(key, self.now, self.group_of.get(key)))
        if isinstance(result, LorapubError):
            assert result.code in ("NO_PUBLISHED_VERSION", "SESSION_CLOSED", "SESSION_EXPIRED", "GROUP_CLOSED",
                                   "BINDING_STALE", "INVALID_INPUT"), result
            if result.code == "BINDING_STALE" and self.state.on_stale == "error":
                self.stale_told.add(key)  # (under "rebind" the worker now sends Rebind: dispatch_member)

    @rule(key=members)
    def dispatch_member(self, key):
        """AuthorizeDispatch, and (on_stale="rebind") the Rebind a worker sends after BINDING_STALE."""
        try:
            binding = R.handle(self.state, R.AuthorizeDispatch(key)).reply
        except LorapubError as e:
            if e.code == "BINDING_STALE":
                if self.state.on_stale == "error":
                    self.stale_told.add(key)
                    return
                result = self.try_apply(R.Rebind(key, self.now))
                if isinstance(result, LorapubError):
                    return
                if key in self.local:  # one of the worker's sessions: it dispatches on the new binding now
                    self._process_adopts(key, result)
                binding = R.handle(self.state, R.AuthorizeDispatch(key)).reply
            else:
                return
        assert key not in self.stale_told, f"{key} dispatched after it was told BINDING_STALE"
        v = self.state.versions[binding.version]
        assert v.state in (VersionState.PUBLISHED, VersionState.RETIRED) and not v.retiring
        lag = v.lag(self.state.default_revision)
        if self.state.max_lag is not None:
            assert lag <= self.state.max_lag, f"{key} dispatched {lag} commits behind (max_lag {self.state.max_lag})"
        served = self.served.setdefault(key, [])
        if not served or served[-1] != binding.version:
            served.append(binding.version)

    # -- the worker process: late and reordered answers ------------------------------------------
    @rule()
    def process_asks_fleet(self):
        """A refresh: the registry answers now, the answer reaches the process later."""
        self.fleet_answers.append(R.handle(self.state, R.ReadFleet(self.now)).reply)

    @precondition(lambda self: self.fleet_answers)
    @rule(data=st.data())
    def fleet_answer_arrives(self, data):
        """Any answer on its way arrives next, an older one after a newer one too."""
        self.view.update(self.fleet_answers.pop(data.draw(st.integers(0, len(self.fleet_answers) - 1))))

    def _process_adopts(self, key, reply) -> Binding | None:
        if isinstance(reply, LorapubError):
            if reply.code == "BINDING_STALE" and self.state.on_stale == "error":
                self.stale_told.add(key)
            return None
        self.local[key] = reply
        self.view.note_binding(reply)
        return reply

    @rule(data=st.data())
    def process_turns(self, data):
        """A few turns of the worker's sessions in a row (each bind's reply moves its view on)."""
        for i in data.draw(st.lists(st.integers(0, len(SESSION_POOL) - 1), min_size=1, max_size=4)):
            key = SESSION_POOL[i]
            if key not in self.group_of:
                self.group_of[key] = data.draw(st.sampled_from([None, *GROUPS]))
            self.process_turn(key)

    def process_turn(self, key):
        """One turn as Session.generate decides it: bind once, then judge the binding on the
        process's view (BINDING_STALE, or a Rebind), then serve it with the lag that view gives."""
        binding = self.local.get(key)
        if binding is None:
            binding = self._process_adopts(key, self.try_apply(R.BindFirst(key, self.now, self.group_of.get(key))))
            if binding is None:
                return
        if self.view.is_stale(binding):
            v = self.state.versions[binding.version]
            assert v.retiring or v.state not in (VersionState.PUBLISHED, VersionState.RETIRED), (
                f"{key}: the process treats {binding.version} as stale, the registry keeps it")
            if self.state.on_stale == "error":
                self.stale_told.add(key)  # the registry never authorizes it again either (dispatch_member)
                return
            binding = self._process_adopts(key, self.try_apply(R.Rebind(key, self.now)))
            if binding is None:
                return
            assert not self.view.is_stale(binding), f"{key} rebound to {binding.version}, stale already"
        record = self.state.sessions.get(key)
        if key in self.stale_told or record is None or record.state is not SessionState.BOUND:
            return  # the registry refuses it (closed, expired or stale): the engine never sees it
        self.results.append((key, binding.version, self.view.lag(binding)))
        served = self.served.setdefault(key, [])
        if not served or served[-1] != binding.version:
            served.append(binding.version)

    @rule(key=members)
    def close_member(self, key):
        self.try_apply(R.CloseAndRelease(key, self.now))
        self.closed.add(key)

    @rule(data=st.data())
    def idle_sessions_expire(self, data):
        keys = data.draw(st.lists(st.sampled_from(SESSION_POOL), max_size=3, unique=True))
        before = self.state.sessions
        self.try_apply(R.ExpireSessions(tuple(keys), self.now))
        for key in keys:
            record = self.state.sessions.get(key)
            assert record is None or record.state not in (SessionState.OPEN, SessionState.BOUND, SessionState.CLOSING)
            if record is not None and record.state is SessionState.EXPIRED and before[key].state is not SessionState.EXPIRED:
                self.expired.add(key)

    @rule(data=st.data())
    def reclaim_what_is_reclaimable(self, data):
        """The reclaimer: claim every reclaimable version and let its receipts arrive."""
        for key in self.state.reclaimable():
            self.try_apply(R.ClaimReclaim(key))
        self.deliver_all_ok(data)

    # -- invariants -------------------------------------------------------------------
    def apply(self, outcome):
        reply = outcome.reply
        self.state = outcome.state
        from lorapub.core.effects import ReclaimEligible
        for fx in outcome.effects:
            if isinstance(fx, ReclaimEligible):
                assert self.state.versions[fx.version].reclaimable
        return RegistryMachine.apply(self, R.Outcome(outcome.state, reply, [
            fx for fx in outcome.effects if not isinstance(fx, ReclaimEligible)]))

    @invariant()
    def refs_match_sessions(self):
        held: dict = {}
        for record in self.state.sessions.values():
            if record.holds_ref:
                assert record.group is None and record.state in (SessionState.BOUND, SessionState.CLOSING)
                held[record.version] = held.get(record.version, 0) + 1
        for g in self.state.groups.values():
            assert g.members >= 0
            if g.holds_ref:
                assert g.state is GroupState.BOUND and g.members > 0
                held[g.version] = held.get(g.version, 0) + 1
        for key, v in self.state.versions.items():
            assert v.session_refs == held.get(key, 0), f"{key}: refs {v.session_refs} vs holders {held.get(key, 0)}"

    @invariant()
    def one_binding_per_session(self):
        for key, record in self.state.sessions.items():
            if record.version is not None and key in self.bound and not record.rebinds:
                assert self.bound[key] == record.version or record.group is not None

    @invariant()
    def reclaiming_never_dispatchable(self):
        for key, record in self.state.sessions.items():
            if record.state is SessionState.BOUND and not self.state.versions[record.version].retiring:
                if record.group is None or self.state.groups[record.group].version == record.version:
                    assert self.state.versions[record.version].state in (VersionState.PUBLISHED, VersionState.RETIRED)

    @invariant()
    def superseded_never_commits(self):
        for key, by in self.state.superseded.items():
            assert key not in self.state.versions and key not in self.default_history
            # by a later call: reserved, still waiting, itself superseded, or one that stopped waiting
            assert by in self.state.versions or by in self.waiting  # a real, later publication

    @invariant()
    def one_version_per_session_unless_rebound(self):
        for key, served in self.served.items():
            record = self.state.sessions.get(key)
            rebinds = record.rebinds if record is not None else 0
            assert len(served) <= 1 + rebinds, f"{key} served by {served} with {rebinds} rebinds"

    @invariant()
    def a_group_never_spans_two_versions(self):
        for key, record in self.state.sessions.items():
            if record.group is None or record.state is not SessionState.BOUND:
                continue
            group = self.state.groups[record.group]
            if record.version != group.version:  # only a member that has not adopted its group's rebind
                assert self.state.on_stale == "rebind" and group.rebinds > 0

    @invariant()
    def retiring_versions_are_reclaimable(self):
        for key, v in self.state.versions.items():
            if v.retiring:
                assert v.state is not VersionState.PUBLISHED
                if v.state is VersionState.RETIRED:
                    assert key in self.state.reclaimable()
            elif self.state.max_lag is not None and v.state is VersionState.RETIRED:
                assert v.lag(self.state.default_revision) <= self.state.max_lag

    @invariant()
    def no_result_served_beyond_max_lag(self):
        if self.state.max_lag is not None:
            for key, version, lag in self.results:
                assert lag <= self.state.max_lag, f"{key} served on {version} with lag {lag} (max_lag {self.state.max_lag})"

    @invariant()
    def one_waiter_at_most(self):
        waiter = self.state.waiter
        if waiter is not None:
            assert waiter.key not in self.state.versions and waiter.key not in self.state.superseded


FreshnessMachine.TestCase.settings = settings(FreshnessMachine.TestCase.settings, max_examples=150)
TestFreshnessMachine = FreshnessMachine.TestCase


def _publish(machine: FreshnessMachine) -> None:
    """publish_cleanly without drawing: reserve, deliver every message in order, commit."""
    machine.reserve_new(tensors=1)
    while machine.network:
        machine.deliver_ok(machine.network.pop(0))
    for fx in list(machine.ready_to_commit):
        if fx.token not in machine.receipts:
            machine.commit_token(fx, lost_reply=False, stale_revision=False)


@pytest.mark.parametrize("on_stale", ["error", "rebind"])
def test_a_bind_that_outruns_the_fleet_view_is_judged_against_max_lag(on_stale):
    """The machine's shortest run to a turn served beyond max_lag, replayed (the random run reached
    it only after about 1000 examples, minutes): the process learns a default from a bind before
    its view says the old version retires."""
    machine = FreshnessMachine()
    FreshnessMachine.setup.__wrapped__(machine, capacity=3, max_lag=0, on_stale=on_stale)
    old, new = SESSION_POOL[0], SESSION_POOL[1]
    machine.group_of.update({old: None, new: None})
    _publish(machine)
    machine.process_turn(old)
    _publish(machine)
    machine.process_asks_fleet()  # its answer (the old version retiring) never arrives here
    machine.process_turn(new)
    machine.process_turn(old)
    machine.no_result_served_beyond_max_lag()
    machine.one_version_per_session_unless_rebound()
    if on_stale == "error":
        assert old in machine.stale_told and [key for key, _, _ in machine.results] == [old, new]
    else:
        assert [(key, lag) for key, _, lag in machine.results] == [(old, 0), (new, 0), (old, 0)]
        assert machine.state.sessions[old].rebinds == 1
    machine.teardown()
