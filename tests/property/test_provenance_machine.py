"""Provenance, model-based (docs/provenance.md, "Stamp"): sessions generate on two stamping engines
while publications, restarts and stamp faults (missing, another name, another digest, another life,
other weights under the right name) come in any order. Invariant, after every step: a turn without a
valid stamp never returned success, and every faulty turn raised ``ProvenanceMismatch``.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lorapub import LorapubError, ProvenanceMismatch
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.runner import Deadlines
from lorapub.testing import MemoryEngine
from lorapub.testing.fixtures import lora_snapshot

ENGINES = ("e0", "e1")
FAULTS = ("none", "missing", "name", "digest", "life", "weights")
FAST = Deadlines(begin=2, bucket=2, end=2, cleanup=2, commit=1, reclaim=5)
TURN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}


class StampedEngine(MemoryEngine):
    """A MemoryEngine whose next response's stamp may be tampered with."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.next_fault = "none"
        self.faulty_turns = 0  # responses it tampered with

    async def generate(self, payload):
        out = await super().generate(payload)
        fault, self.next_fault = self.next_fault, "none"
        stamp = out["meta_info"].get("lorapub")
        if fault == "none" or stamp is None:
            return out
        self.faulty_turns += 1
        if fault == "missing":
            del out["meta_info"]["lorapub"]
        elif fault == "name":
            stamp["lora_name"] = stamp["lora_name"] + "-other"
        elif fault == "digest":
            stamp["digest"] = "f" * 64
        elif fault == "life":
            stamp["incarnation"] = "a-life-never-seen"
        elif fault == "weights":  # another version's weights under the right name: its digest
            others = [d for n, d in self.loaded.items() if n != stamp["lora_name"]]
            stamp["digest"] = others[0] if others else "0" * 64
        return out


class ProvenanceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engines = {n: StampedEngine(n) for n in ENGINES}
        self.dep = self.run(Deployment(self.engines, epoch=1, deadlines=FAST).start())
        self.published = 0
        self.sessions = 0
        self.successes: list[tuple[dict, object]] = []  # (result, binding) of every turn that returned
        self.tampered_ok = 0  # tampered turns that returned success (must stay 0)
        self.mismatches = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(self.dep.close())
        finally:
            self.loop.close()

    @initialize()
    def first_version(self):
        self.publish()

    @rule()
    def publish(self):
        self.published += 1
        try:
            self.run(self.dep.publish(lora_snapshot(self.published), f"v{self.published}"))
        except LorapubError:
            pass  # capacity, a restart mid-publication: not what this machine checks

    @rule(engine=st.sampled_from(ENGINES), fault=st.sampled_from(FAULTS), close=st.booleans())
    def turn(self, engine, fault, close):
        for e in self.engines.values():
            e.next_fault = "none"
        self.engines[engine].next_fault = fault
        before = sum(e.faulty_turns for e in self.engines.values())
        self.sessions += 1
        session = self.dep.session(f"s{self.sessions}")
        try:
            out = self.run(session.generate(TURN))
        except ProvenanceMismatch:
            self.mismatches += 1
            out = None
        except LorapubError:
            out = None  # nothing published yet, an engine away
        tampered = sum(e.faulty_turns for e in self.engines.values()) > before
        if out is not None:
            self.successes.append((out, session.binding))
            self.tampered_ok += tampered
        if close:
            try:
                self.run(session.close())
            except LorapubError:
                pass

    @rule(engine=st.sampled_from(ENGINES))
    def restart(self, engine):
        self.engines[engine].restart()

    @rule()
    def settle(self):
        try:
            self.run(self.dep.reconcile())
        except LorapubError:
            pass

    @invariant()
    def no_unattested_success(self):
        assert self.tampered_ok == 0
        for out, binding in self.successes:
            stamp = out["lorapub"]["stamp"]
            assert stamp is not None  # every engine here stamps
            assert stamp["lora_name"] == binding.lora_name and stamp["digest"] == binding.digest


ProvenanceMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck),
)
test_provenance_machine = ProvenanceMachine.TestCase
