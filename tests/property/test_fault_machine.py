"""The fault machine: Hypothesis drives a whole Deployment through faults of every kind.

Engines are :class:`lorapub.testing.MemoryEngine` (SGLang's observed behaviour, in
process) that can lose any request or reply, refuse, stall past the deadline or
restart; the registry is wrapped in :class:`lorapub.testing.FaultyRegistry`, which can
lose any request or reply. Rollout workers crash (their sessions stop renewing), the
publisher dies with its in-memory registry (a new trainer takes over at the next epoch),
publish calls are cancelled, the registry's clock steps forward and back, an operator
unloads a version behind lorapub's back. Invariants hold after every step; at the end,
with the faults stopped, no session whose version an engine still holds gets a version
error, and once every session closed or expired the deployment heals by itself within a
bounded number of passes: healthy, every retired version reclaimed, at most the default
loaded (a dead publisher's orphans too), its frozen copy the only one kept, capacity free.
"""

from __future__ import annotations

import asyncio

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lorapub.core.commands import (
    BeginClose,
    BindFirst,
    ClaimReclaim,
    CloseAndRelease,
    Commit,
    RecordReady,
    RenewLeases,
    Reserve,
)
from lorapub.core.session import SessionState
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError
from lorapub.runtime.deployment import Deployment
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.runner import Deadlines
from lorapub.runtime.sessions import LocalState
from lorapub.testing import FaultyRegistry, MemoryEngine, lora_snapshot
from lorapub.testing.memory_engine import FAULTS, OPS

ENGINES = ("e0", "e1")
TTL = 100.0
SNAPSHOTS = [lora_snapshot(seed, layers=1, hidden=16, rank=2) for seed in range(5)]
TINY = Deadlines(begin=0.02, bucket=0.02, end=0.02, cleanup=0.02, commit=0.02, reclaim=0.5)
REGISTRY_FAULTS = (Reserve, RecordReady, Commit, BindFirst, BeginClose, CloseAndRelease, ClaimReclaim, RenewLeases)
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}


class FaultMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.loop = asyncio.new_event_loop()
        self.now = 1000.0
        self.engines = {name: MemoryEngine(name) for name in ENGINES}
        self.epoch = 3
        self.operator_unloaded: set[tuple[str, str, str]] = set()  # (engine, life, adapter) unloaded behind us
        self.stepped_back = 0.0  # how far the registry's clock was set back in all (leases last that much longer)
        self.start_publisher()
        self.next_version = 0
        self.next_session = 0

    def start_publisher(self):
        """A trainer process: its in-memory registry and its deployment."""
        self.local = LocalRegistry(
            self.epoch, {n: e.incarnation_id for n, e in self.engines.items()}, lease_ttl=TTL, clock=lambda: self.now,
        )
        self.registry = FaultyRegistry(self.local)
        for tries in range(8):  # an engine fault may refuse a start: the trainer starts again
            try:
                self.dep = self.run(Deployment(
                    self.engines, epoch=self.epoch, registry=self.registry, deadlines=TINY, bucket_cap_bytes=256,
                    reconcile_interval=None, reclaim_retries=2, reclaim_backoff=0.001, stale_attempt_after=0.05,
                    own_engines=False,
                ).start())
                break
            except LorapubError:
                assert tries < 7, "a trainer could not start on engines whose faults are single-shot"
        self.sessions = []  # every Session object ever made by this trainer (crashed ones too)

    def teardown(self):
        if hasattr(self, "loop"):
            try:
                self.check_heals()  # liveness at the end of every run
                self.run(self.dep.close())
            finally:
                # what dead trainers left running (their processes are gone) ends with the loop
                tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in tasks:
                    t.cancel()
                if tasks:
                    self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                self.loop.close()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def attempt(self, coro):
        """Run a user-facing call: it may fail, but only ever with a typed lorapub error."""
        try:
            return self.run(coro)
        except LorapubError as e:
            return e

    # -- the workload -------------------------------------------------------------
    @rule(seed=st.integers(0, len(SNAPSHOTS) - 1), replay=st.booleans())
    def publish(self, seed, replay):
        version_id = f"v{max(self.next_version - 1, 0)}" if replay and self.next_version else f"v{self.next_version}"
        if version_id == f"v{self.next_version}":
            self.next_version += 1
            self.seeds = getattr(self, "seeds", {})
            self.seeds[version_id] = seed
        self.attempt(self.dep.publish(SNAPSHOTS[self.seeds[version_id]], version_id))

    @rule()
    def open_and_generate(self):
        session = self.dep.session(f"s{self.next_session}")
        self.next_session += 1
        self.sessions.append(session)
        self.generate_on(session)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def generate(self, data):
        self.generate_on(data.draw(st.sampled_from(self.sessions)))

    def generate_on(self, session):
        before = {n: len(e.generations) for n, e in self.engines.items()}
        result = self.attempt(session.generate(GEN))
        ran = [(n, g) for n, e in self.engines.items() for g in e.generations[before[n]:]]
        # a generation runs at most once, and only on the session's exact bound version
        assert len(ran) <= 1, ran
        for _, (_, name) in ran:
            assert session.binding is not None and name == session.binding.lora_name, (name, session.binding)
        if not isinstance(result, LorapubError):
            assert len(ran) == 1

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def close(self, data):
        self.attempt(data.draw(st.sampled_from(self.sessions)).close())

    @precondition(lambda self: any(s.key in self.dep.sessions.sessions for s in self.sessions))
    @rule(data=st.data())
    def worker_crashes(self, data):
        live = [s for s in self.sessions if s.key in self.dep.sessions.sessions]
        session = data.draw(st.sampled_from(live))
        del self.dep.sessions.sessions[session.key]  # its worker is gone: nobody renews or closes it

    @rule()
    def heartbeat(self):
        self.attempt(self.dep.sessions.renew_leases())

    @rule(seconds=st.sampled_from([1.0, 50.0, 150.0]))
    def time_passes(self, seconds):
        self.now += seconds

    # -- faults ----------------------------------------------------------------------
    @rule(engine=st.sampled_from(ENGINES))
    def restart(self, engine):
        self.engines[engine].restart()

    @rule()
    def publisher_dies(self):
        """SIGKILL: the trainer's registry (in memory) dies with it and nothing it started is cleaned;
        a new trainer starts at the next epoch on the same engines."""
        self.registry.enabled, self.registry.rate, self.registry.queries = True, 1.0, True  # gone
        self.registry.clear_faults()
        tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self.run(asyncio.gather(*tasks, return_exceptions=True))
        self.epoch += 1
        self.next_version = 0
        self.start_publisher()

    @rule(seed=st.integers(0, len(SNAPSHOTS) - 1), steps=st.integers(0, 40))
    def publish_cancelled(self, seed, steps):
        """The caller gives up on a publication (asyncio.wait_for, a shutdown) at some point of it."""
        version_id = f"v{self.next_version}"
        self.next_version += 1
        self.seeds = getattr(self, "seeds", {})
        self.seeds[version_id] = seed

        async def go():
            task = asyncio.ensure_future(self.dep.publish(SNAPSHOTS[seed], version_id))
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self.run(go())

    @rule(seconds=st.sampled_from([5.0, 60.0]))
    def clock_steps_back(self, seconds):
        self.now -= seconds  # the registry's clock stepped back (a correction): leases only last longer
        self.stepped_back += seconds

    @rule(engine=st.sampled_from(ENGINES), pick=st.integers(0, 7))
    def operator_unloads(self, engine, pick):
        """An operator unloads an idle managed adapter through SGLang, behind lorapub's back."""
        e = self.engines[engine]
        idle = sorted(n for n in e.loaded if not e.refs.get(n) and n not in e.unregistered)
        if not idle:
            return
        name = idle[pick % len(idle)]  # (drawn whatever the engine holds: the draws never depend on timing)
        del e.loaded[name]
        self.operator_unloaded.add((engine, e.incarnation_id, name))

    @rule(engine=st.sampled_from(ENGINES), op=st.sampled_from(OPS), fault=st.sampled_from(FAULTS))
    def engine_fault(self, engine, op, fault):
        self.engines[engine].fail_next(op, fault)

    @rule(command=st.sampled_from(REGISTRY_FAULTS), mode=st.sampled_from(["request", "reply"]))
    def registry_fault(self, command, mode):
        self.registry.fail_next(command, mode)

    @rule()
    def reconcile(self):
        health = self.run(self.dep.reconcile())
        assert health.passes >= 1

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def capacity_and_refs(self):
        state = self.local.state
        assert state.slots_held <= state.capacity
        held = {}
        for record in state.sessions.values():
            if record.holds_ref:
                assert record.state in (SessionState.OPEN, SessionState.BOUND, SessionState.CLOSING)
                held[record.version] = held.get(record.version, 0) + 1
        for key, v in state.versions.items():
            assert v.session_refs == held.get(key, 0), key
            if v.session_refs:
                assert v.state in (VersionState.PUBLISHED, VersionState.RETIRED)
        assert len([a for a in state.attempts.values() if not a.resolved and not a.reprovision]) <= 1

    @invariant()
    def holders_hold(self):
        """The registry routes a version only to engines that hold it (in the life it knows)."""
        state = self.local.state
        for v in state.versions.values():
            if v.state not in (VersionState.PUBLISHED, VersionState.RETIRED):
                continue
            for name in v.engines:
                engine = self.engines[name]
                if (name, engine.incarnation_id, v.lora_name) in self.operator_unloaded:
                    continue  # unloaded behind lorapub's back: noticed by the next check of that engine
                if state.engines[name] == engine.incarnation_id:
                    assert v.lora_name in engine.loaded, f"{v.key} routed to {name}, which lacks it"

    @invariant()
    def bindings_never_move(self):
        for s in self.sessions:
            record = self.local.state.sessions.get(s.key)
            if s.binding is not None and record is not None and record.version is not None:
                assert record.version == s.binding.version

    # -- liveness ----------------------------------------------------------------------
    def check_heals(self):
        """Faults stop, every live session closes, crashed ones expire: the system heals."""
        self.registry.enabled = False
        for e in self.engines.values():
            e.clear_faults()
        self.run(self.dep.reconcile())
        self.run(self.dep.settle(1.0))
        for s in self.sessions:  # faults stopped: no version error while an engine holds the version
            if s.binding is not None and s.key in self.dep.sessions.sessions and s.state is LocalState.BOUND:
                result = self.attempt(s.generate(GEN))
                if getattr(result, "code", None) == "VERSION_MISSING":
                    held = [n for n, e in self.engines.items() if e.serves(s.binding.lora_name)
                            and self.local.state.engines[n] == e.incarnation_id]
                    assert not held, f"{s.key} got VERSION_MISSING while {held} hold {s.binding.version}"
        for s in self.sessions:
            if s.key in self.dep.sessions.sessions or s.state is LocalState.FINALIZING:
                for _ in range(3):
                    if not isinstance(self.attempt(s.close()), LorapubError):
                        break
        self.now += TTL * 2 + self.stepped_back  # crashed workers' leases run out (a step back delayed them)
        self.run(self.dep.settle())  # background reclaims end within their deadline (a stalled unload too)
        for _ in range(12):
            health = self.run(self.dep.reconcile())
            if health.healthy and not self.local.state.reclaimable():
                break
            self.run(asyncio.sleep(0.06))  # past the stale-attempt time, for a publisher cut short
        assert health.healthy, health.describe()
        state = self.local.state
        for key, v in state.versions.items():
            if key != state.default:
                assert v.state in (VersionState.RECLAIMED, VersionState.FAILED_CLEAN), (key, v.state)
        assert state.slots_held == (1 if state.default else 0)
        default = state.versions[state.default] if state.default else None
        for name, engine in self.engines.items():
            managed = set(engine.loaded)
            assert managed == ({default.lora_name} if default else set()), (name, managed)
        assert set(self.dep.publisher.frozen.keys()) <= ({state.default} if state.default else set())

    @rule()
    def heal_now(self):
        # Liveness inside the run too (it shrinks better than a teardown failure), then the
        # faults resume.
        self.check_heals()
        self.registry.enabled = True


TestFaultMachine = FaultMachine.TestCase
