"""The registry machine with an elastic fleet: engines join, drain and leave between any two steps.

Every rule of :mod:`tests.property.test_registry_machine` still runs (publications, faults, restarts,
sessions, reclaims); three more add, drain and remove engines, and the invariants below are checked
after every step besides the registry machine's own.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from lorapub.core import registry as R
from lorapub.core.attempt import ACTIVE
from lorapub.core.registry import Membership
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError

from .test_registry_machine import ENGINES, RegistryMachine

POOL = (*ENGINES, "e2")


class MembershipMachine(RegistryMachine):
    def _setup_members(self):
        if not hasattr(self, "ever_removed"):
            self.ever_removed: set[str] = set()
            self.held_default: dict[tuple, str] = {}  # (version, engine) -> the life it held it in

    # -- membership rules --------------------------------------------------------------
    @rule(engine=st.sampled_from(POOL))
    def add_engine(self, engine):
        self._setup_members()
        if engine not in self.state.engines:  # a fresh process: a new life
            self.lives[engine] = self.lives.get(engine, -1) + 1
            self.incarnations[engine] = f"{engine}-life{self.lives[engine]}"
        elif self.state.engines[engine] != self.incarnations[engine]:  # it restarted unnoticed: AddEngine notices
            for key, v in self.state.versions.items():
                if v.state is VersionState.RECLAIMING and engine in v.reclaim_pending:
                    self.unloaded.add((key, engine))
        before = self.state.membership(engine) if engine in self.state.engines else None
        result = self.try_apply(R.AddEngine(engine, self.incarnations[engine]))
        assert not isinstance(result, LorapubError), result
        assert result is self.state.membership(engine)
        if before is None or before is Membership.DRAINING:
            needs = [v for v in self.state.needed() if engine not in v.engines]
            assert (result is Membership.SERVING) == (not needs and self._not_left_out(engine)), result

    def _not_left_out(self, engine):
        running = self.state.unresolved_attempt()
        return running is None or running.phase not in ACTIVE or running.target(engine) is not None

    @rule(engine=st.sampled_from(POOL))
    def drain_engine(self, engine):
        self._setup_members()
        before = self.state
        result = self.try_apply(R.DrainEngine(engine))
        if isinstance(result, LorapubError):
            assert self.state is before
            assert result.code in ("UNKNOWN_ENGINE", "INVALID_INPUT"), result
            if result.code == "INVALID_INPUT":
                assert before.in_state(Membership.SERVING) - {engine} == frozenset()
            return
        assert self.state.membership(engine) is Membership.DRAINING

    @rule(engine=st.sampled_from(POOL), force=st.booleans())
    def remove_engine(self, engine, force):
        self._setup_members()
        before = self.state
        result = self.try_apply(R.RemoveEngine(engine, force))
        if isinstance(result, LorapubError):
            assert self.state is before
            assert result.code in ("UNKNOWN_ENGINE", "ENGINE_NOT_DRAINED", "INVALID_INPUT", "PUBLICATION_BLOCKED"), result
            if result.code == "ENGINE_NOT_DRAINED":
                assert not force and before.membership(engine) is not Membership.DRAINING
            return
        self.ever_removed.add(engine)
        assert engine not in self.state.engines and engine not in self.state.members
        for v in self.state.versions.values():
            assert engine not in v.reclaim_pending
            if v.state in (VersionState.PUBLISHED, VersionState.RETIRED):
                assert engine not in v.engines
        assert all(e != engine for e, _ in self.state.reprovisions)

    @rule(engine=st.sampled_from(ENGINES))
    def notice_restart(self, engine):
        if engine in self.state.engines:  # a removed engine is no member to notice
            super().notice_restart(engine)

    @rule(target=RegistryMachine.versions, tensors=st.integers(1, 4))
    def reserve_new(self, tensors):
        targets = self.state.publication_targets()
        key = super().reserve_new(tensors)
        if key in self.state.versions and self.state.versions[key].state is VersionState.LOADING:
            a = self.state.attempts[self.state.versions[key].attempt]
            assert dict((t.engine, t.incarnation) for t in a.targets) == targets  # never a draining engine
        return key

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def members_are_engines_and_one_takes_traffic(self):
        assert set(self.state.members) <= set(self.state.engines)
        assert all(m is not Membership.SERVING for m in self.state.members.values())  # SERVING is implicit
        assert self.state.in_state(Membership.SERVING), "no member takes traffic"

    @invariant()
    def routing_never_places_on_joining_or_draining(self):
        fleet = R.handle(self.state, R.ReadFleet()).reply
        for key, routes in fleet.routing().items():
            assert not routes & fleet.joining, f"{key} routed to a joining engine"
            if routes & fleet.draining:
                # only where no member that takes traffic holds it: its sessions stay until it ends
                assert routes <= fleet.draining, f"{key} routed to a draining engine beside others"
        assert not fleet.routable & (fleet.joining | fleet.draining)
        assert all(e not in fleet.draining for e, _ in fleet.missing)

    @invariant()
    def the_default_is_on_every_member_that_takes_traffic(self):
        """A SERVING member lacks the default only if it lost it in a restart since it held it."""
        self._setup_members()
        s = self.state
        if s.default is None:
            return
        holders = s.versions[s.default].engines
        for e in holders:
            self.held_default[(s.default, e)] = s.engines[e]
        for e in s.in_state(Membership.SERVING) - set(holders):
            life = self.held_default.get((s.default, e))
            assert life is not None and life != s.engines[e], f"SERVING {e} never held the default {s.default}"

    # the registry machine's release checks, less the engines that left (their part counts as cleaned)
    @invariant()
    def nothing_released_on_unknown(self):
        self._setup_members()
        for key, v in self.state.versions.items():
            if v.state is VersionState.FAILED_CLEAN:
                for t in self.state.attempts[v.attempt].targets:
                    if t.engine not in self.ever_removed:
                        assert (v.attempt, t.engine, t.incarnation) in self.cleaned, f"{key} freed without {t.engine}"
            if v.state is VersionState.RECLAIMED:
                for e in v.engines:
                    if e not in self.ever_removed:
                        assert (key, e) in self.unloaded, f"{key} reclaimed without {e} receipt"


MembershipMachine.TestCase.settings = settings(MembershipMachine.TestCase.settings,
                                               max_examples=min(MembershipMachine.TestCase.settings.max_examples, 150))
TestMembershipMachine = MembershipMachine.TestCase
