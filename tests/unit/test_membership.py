"""Fleet membership in the core: AddEngine, DrainEngine, RemoveEngine through the one door."""

from __future__ import annotations

import pickle

import pytest

from lorapub.core import registry as R
from lorapub.core.attempt import Phase, ReadyLocal
from lorapub.core.effects import SOURCE, SendBegin, SendCleanup, SendEnd, SendReclaim, TransferBucket
from lorapub.core.identity import SessionKey, VersionKey
from lorapub.core.registry import Membership
from lorapub.core.version import VersionState
from lorapub.errors import EngineNotDrained, InvalidInput, PublicationBlocked, UnknownEngine
from lorapub.testing.fixtures import fake_plan

EP = 4


def key(v: str) -> VersionKey:
    return VersionKey(EP, v)


class Net:
    """Delivers effects happily, as engines that answer would."""

    def __init__(self, engines):
        self.lives = dict(engines)
        self.state = R.new_registry(EP, engines)
        self.commits = []

    def do(self, command):
        if isinstance(command, (R.AddEngine, R.RegisterEngine)):
            self.lives[command.engine] = command.incarnation
        out = R.handle(self.state, command)
        self.state = out.state
        self.run(out.effects)
        return out.reply

    def run(self, effects, skip=()):
        queue = list(effects)
        while queue:
            fx = queue.pop(0)
            out = None
            if getattr(fx, "engine", None) in skip:
                continue
            if isinstance(fx, SendBegin):
                out = R.handle(self.state, R.RecordPrepared(fx.token, fx.engine, self.lives[fx.engine]))
            elif isinstance(fx, TransferBucket):
                for p in (SOURCE, *fx.engines):
                    o = R.handle(self.state, R.RecordBucketDone(fx.token, p, fx.index, self.lives.get(p)))
                    self.state = o.state
                    queue += o.effects
                continue
            elif isinstance(fx, SendEnd):
                a = self.state.attempts[fx.token]
                out = R.handle(self.state, R.RecordReady(ReadyLocal(fx.engine, fx.token, a.digest, self.lives[fx.engine])))
            elif isinstance(fx, SendCleanup):
                out = R.handle(self.state, R.RecordCleaned(fx.token, fx.engine, self.lives[fx.engine]))
            elif isinstance(fx, SendReclaim):
                out = R.handle(self.state, R.RecordUnloaded(fx.version, fx.reclaim_id, fx.engine))
            elif type(fx).__name__ == "ReadyToCommit":
                self.commits.append(fx)
            if out is not None:
                self.state = out.state
                queue += out.effects

    def publish(self, v: str, skip=()):
        digest, plan = fake_plan(v)
        reply = R.handle(self.state, R.Reserve(key(v), digest, plan))
        self.state = reply.state
        self.run(reply.effects, skip)
        return reply.reply.token

    def commit(self, token):
        return self.do(R.Commit(token.version, token, self.state.default_revision))

    def reprovision(self):
        for engine, k in self.state.missing():
            self.do(R.StartReprovision(k, engine))


def serving(state):
    return state.in_state(Membership.SERVING)


def test_a_joining_engine_takes_no_traffic_until_it_holds_every_needed_version():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    assert net.do(R.AddEngine("e2", "c")) is Membership.JOINING
    fleet = R.handle(net.state, R.ReadFleet()).reply
    assert fleet.joining == {"e2"} and "e2" not in fleet.routable
    assert net.state.missing() == [("e2", key("A"))]
    assert all("e2" not in h for h in fleet.routing().values())
    net.reprovision()
    assert net.state.membership("e2") is Membership.SERVING
    fleet = R.handle(net.state, R.ReadFleet()).reply
    assert fleet.routing()[key("A")] == {"e0", "e1", "e2"} and "e2" in fleet.routable


def test_an_engine_joins_at_once_when_nothing_is_needed_and_add_is_idempotent():
    net = Net({"e0": "a"})
    assert net.do(R.AddEngine("e1", "b")) is Membership.SERVING
    assert net.do(R.AddEngine("e1", "b")) is Membership.SERVING
    assert dict(net.state.engines) == {"e0": "a", "e1": "b"}
    with pytest.raises(InvalidInput):
        net.do(R.AddEngine("bad name", "x"))


def test_a_publication_that_started_before_the_join_keeps_the_joiner_out_until_it_is_loaded_there():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    token = net.publish("B")  # READY on e0 and e1, not committed yet
    net.do(R.AddEngine("e2", "c"))
    net.reprovision()  # e2 gets A
    assert key("A") in net.state.versions and "e2" in net.state.versions[key("A")].engines
    assert net.state.membership("e2") is Membership.JOINING  # B would become the default without it
    net.commit(token)
    assert net.state.membership("e2") is Membership.JOINING
    assert ("e2", key("B")) in net.state.missing()
    net.reprovision()
    assert net.state.membership("e2") is Membership.SERVING
    assert "e2" in net.state.versions[key("B")].engines


def test_a_publication_that_starts_while_an_engine_joins_includes_it():
    net = Net({"e0": "a"})
    net.commit(net.publish("A"))
    net.do(R.BindFirst(SessionKey(EP, "s", "n"), now=1.0))  # keeps A needed after B
    net.do(R.AddEngine("e1", "b"))
    token = net.publish("B")
    assert net.state.attempts[token].engines == ("e0", "e1")
    net.commit(token)
    assert set(net.state.versions[key("B")].engines) == {"e0", "e1"}
    # still joining: A (which a session still uses) is not there yet
    assert net.state.membership("e1") is Membership.JOINING
    net.reprovision()
    assert net.state.membership("e1") is Membership.SERVING


def test_drain_leaves_the_engine_out_of_new_publications_and_routing():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    assert net.do(R.DrainEngine("e1")) is Membership.DRAINING
    assert net.do(R.DrainEngine("e1")) is Membership.DRAINING  # idempotent
    fleet = R.handle(net.state, R.ReadFleet()).reply
    assert fleet.routing()[key("A")] == {"e0"} and fleet.holders[key("A")] == {"e0", "e1"}
    token = net.publish("B")
    assert net.state.attempts[token].engines == ("e0",)
    net.commit(token)
    assert net.state.missing() == []  # nothing is loaded on a draining engine


def test_a_version_held_only_by_a_draining_engine_keeps_its_sessions_there():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    net.do(R.RegisterEngine("e0", "a2"))  # e0 restarted: only e1 holds A now
    net.do(R.DrainEngine("e1"))
    fleet = R.handle(net.state, R.ReadFleet()).reply
    assert fleet.routing()[key("A")] == {"e1"}


def test_the_last_member_that_takes_traffic_cannot_be_drained_or_removed():
    net = Net({"e0": "a", "e1": "b"})
    net.do(R.DrainEngine("e1"))
    with pytest.raises(InvalidInput):
        net.do(R.DrainEngine("e0"))
    with pytest.raises(InvalidInput):
        net.do(R.RemoveEngine("e0", force=True))
    net.do(R.AddEngine("e2", "c"))  # joins at once: nothing is needed
    net.do(R.DrainEngine("e0"))
    assert serving(net.state) == {"e2"}


def test_remove_needs_a_drain_or_force_and_names_unknown_engines():
    net = Net({"e0": "a", "e1": "b"})
    with pytest.raises(EngineNotDrained) as e:
        net.do(R.RemoveEngine("e1"))
    assert e.value.code == "ENGINE_NOT_DRAINED"
    with pytest.raises(UnknownEngine) as e:
        net.do(R.RemoveEngine("e9"))
    assert e.value.code == "UNKNOWN_ENGINE"
    with pytest.raises(UnknownEngine):
        net.do(R.DrainEngine("e9"))
    net.do(R.DrainEngine("e1"))
    assert net.do(R.RemoveEngine("e1")) is True
    assert dict(net.state.engines) == {"e0": "a"} and not net.state.members


def test_remove_keeps_slot_accounting_and_reclaim_stops_waiting_for_it():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    net.commit(net.publish("B"))  # A retired, reclaimable
    out = R.handle(net.state, R.ClaimReclaim(key("A")))
    net.state = out.state  # the unloads are not answered yet
    assert net.state.versions[key("A")].reclaim_pending == {"e0", "e1"}
    net.do(R.DrainEngine("e1"))
    net.do(R.RemoveEngine("e1"))
    assert net.state.versions[key("A")].reclaim_pending == {"e0"}
    assert net.state.versions[key("B")].engines == ("e0",)
    net.do(R.RecordUnloaded(key("A"), net.state.versions[key("A")].reclaim_id, "e0"))
    assert net.state.versions[key("A")].state is VersionState.RECLAIMED
    assert net.state.slots_held == 1
    # a late receipt from the removed engine changes nothing
    net.do(R.RecordUnloaded(key("A"), net.state.versions[key("A")].reclaim_id, "e1"))
    assert net.state.versions[key("A")].state is VersionState.RECLAIMED


def test_remove_of_the_last_pending_unload_finishes_the_reclaim():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    net.commit(net.publish("B"))
    net.state = R.handle(net.state, R.ClaimReclaim(key("A"))).state
    net.do(R.RecordUnloaded(key("A"), net.state.versions[key("A")].reclaim_id, "e0"))
    net.do(R.DrainEngine("e1"))
    net.do(R.RemoveEngine("e1"))
    assert net.state.versions[key("A")].state is VersionState.RECLAIMED


def test_remove_during_a_publication_is_refused_unless_forced_then_the_attempt_aborts_and_cleans():
    net = Net({"e0": "a", "e1": "b", "e2": "c"})
    token = net.publish("A", skip={"e2"})  # e2 never answers its begin
    net.do(R.DrainEngine("e2"))
    with pytest.raises(PublicationBlocked) as e:
        net.do(R.RemoveEngine("e2"))
    assert e.value.details["attempt"] == token and e.value.details["phase"] == "BEGINNING"  # what blocks it, named
    net.do(R.RemoveEngine("e2", force=True))
    a = net.state.attempts[token]
    assert a.phase is Phase.CLEAN and net.state.versions[key("A")].state is VersionState.FAILED_CLEAN
    assert net.state.slots_held == 0


def test_remove_ends_reprovisioning_there():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    net.do(R.AddEngine("e2", "c"))
    out = R.handle(net.state, R.StartReprovision(key("A"), "e2"))
    net.state = out.state  # its begin is never answered
    assert ("e2", key("A")) in net.state.reprovisions
    net.do(R.RemoveEngine("e2", force=True))
    assert not net.state.reprovisions and net.state.attempts[out.reply].resolved


def test_a_late_register_engine_never_re_adds_a_removed_engine():
    net = Net({"e0": "a", "e1": "b"})
    net.do(R.DrainEngine("e1"))
    net.do(R.RemoveEngine("e1"))
    net.do(R.RegisterEngine("e1", "b2"))
    assert "e1" not in net.state.engines


def test_a_draining_engine_added_again_rejoins():
    net = Net({"e0": "a", "e1": "b"})
    net.commit(net.publish("A"))
    net.do(R.DrainEngine("e1"))
    net.commit(net.publish("B"))  # left out of B
    assert net.do(R.AddEngine("e1", "b")) is Membership.JOINING
    net.reprovision()
    assert net.state.membership("e1") is Membership.SERVING


def test_membership_survives_a_pickle_and_an_old_state_has_every_engine_serving():
    net = Net({"e0": "a", "e1": "b"})
    net.do(R.DrainEngine("e1"))
    again = pickle.loads(pickle.dumps(net.state))
    assert again.membership("e1") is Membership.DRAINING
    state = dict(net.state.__getstate__())
    del state["members"]
    old = R.RegistryState.__new__(R.RegistryState)
    old.__setstate__(state)
    assert old.membership("e1") is Membership.SERVING
