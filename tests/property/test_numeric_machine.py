"""The numeric READY gate under Hypothesis: a whole Deployment over MemoryEngines publishes snapshots
with probes, some of which the engines do not reproduce (a trainer on another ``lora_alpha``, an engine
that scales one tensor at load), while engines restart (re-provisioning runs the gate too), fail, and
drift after commit (the canary). Invariant after every step: no version is committed, or held by an
engine as the registry routes it, unless that engine reproduced its probe; bindings never move.
"""

from __future__ import annotations

import asyncio

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lorapub.core.version import VersionState
from lorapub.errors import LorapubError
from lorapub.runtime.deployment import Deployment
from lorapub.probe import compare
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.runner import Deadlines
from lorapub.testing import MemoryEngine, lora_snapshot, peft_config, reference_probe
from lorapub.testing.numeric import model_logprobs

ENGINES = ("e0", "e1")
SNAPSHOTS = [lora_snapshot(seed, layers=1, hidden=16, rank=2) for seed in range(4)]
GOOD = [s.with_probe(reference_probe(s)) for s in SNAPSHOTS]
# the trainer computed its reference with another lora_alpha than the config the engines load
BAD = [s.with_probe(reference_probe(s, serving_config={**peft_config(2), "lora_alpha": 16})) for s in SNAPSHOTS]
QUICK = Deadlines(begin=0.5, bucket=0.5, end=0.5, cleanup=0.5, commit=0.5, reclaim=2)
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}


class NumericMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.loop = asyncio.new_event_loop()
        self.engines = {name: MemoryEngine(name) for name in ENGINES}
        self.local = LocalRegistry(1, {n: e.incarnation_id for n, e in self.engines.items()})
        self.dep = self.run(Deployment(
            self.engines, epoch=1, registry=self.local, deadlines=QUICK, bucket_cap_bytes=256,
            reconcile_interval=None, canary_interval=1e-6, own_engines=False,
        ).start())
        self.next_version = 0
        self.snapshots = {}  # version id -> the snapshot published under it
        self.drifted = set()  # (engine, life, lora_name) that drift was injected into after commit
        self.sessions = []

    def teardown(self):
        if hasattr(self, "loop"):
            try:
                self.run(self.dep.close())
            finally:
                self.loop.close()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def attempt(self, coro):
        try:
            return self.run(coro)
        except LorapubError as e:
            return e

    @rule(seed=st.integers(0, len(SNAPSHOTS) - 1), bad=st.booleans())
    def publish(self, seed, bad):
        version_id = f"v{self.next_version}"
        self.next_version += 1
        self.snapshots[version_id] = (BAD if bad else GOOD)[seed]
        result = self.attempt(self.dep.publish(self.snapshots[version_id], version_id))
        if bad or any(e.scale_tensor for e in self.engines.values()):
            assert isinstance(result, LorapubError), f"{version_id} committed although an engine mismatches"

    @rule(engine=st.sampled_from(ENGINES), on=st.booleans())
    def scale_switch(self, engine, on):
        self.engines[engine].scale_tensor = "lora_B=3.0" if on else None

    @rule(engine=st.sampled_from(ENGINES))
    def restart(self, engine):
        self.engines[engine].restart()

    @rule(engine=st.sampled_from(ENGINES), op=st.sampled_from(["end", "generate", "begin"]))
    def fault(self, engine, op):
        self.engines[engine].fail_next(op, "error")

    @rule(engine=st.sampled_from(ENGINES))
    def drift(self, engine):
        e = self.engines[engine]
        for name in list(e.numeric):
            e.drift(name, 1.5)
            self.drifted.add((engine, e.incarnation_id, name))

    @rule()
    def reconcile(self):
        self.run(self.dep.reconcile(wait=0.5))

    @rule()
    def open_and_generate(self):
        session = self.dep.session(f"s{len(self.sessions)}")
        self.sessions.append(session)
        self.attempt(session.generate(GEN))

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def generate(self, data):
        self.attempt(data.draw(st.sampled_from(self.sessions)).generate(GEN))

    @invariant()
    def never_ready_with_a_mismatch(self):
        state = self.local.state
        for key, v in state.versions.items():
            probe = self.snapshots[key.version_id].probe
            if v.commit is not None:
                assert self.snapshots[key.version_id] in GOOD, f"{key} committed with a probe no engine reproduces"
            if v.state not in (VersionState.PUBLISHED, VersionState.RETIRED):
                continue
            for name in v.engines:
                e = self.engines[name]
                if state.engines[name] != e.incarnation_id or v.lora_name not in e.numeric:
                    continue  # a restart the registry has not seen yet
                if (name, e.incarnation_id, v.lora_name) in self.drifted:
                    continue  # drift after commit: the canary's business
                observed = [model_logprobs(e.numeric[v.lora_name], seq) for seq in probe.sequences]
                assert compare(probe, observed) is None, f"{key} routed to {name}, which computes differently"

    @invariant()
    def bindings_never_move(self):
        for s in self.sessions:
            record = self.local.state.sessions.get(s.key)
            if s.binding is not None and record is not None and record.version is not None:
                assert record.version == s.binding.version


NumericMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestNumericMachine = NumericMachine.TestCase
