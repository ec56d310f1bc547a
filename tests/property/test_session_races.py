"""Hypothesis drives the asyncio SessionService through bind / cancel / generate / close races.

One event loop per example; rules start tasks and let the loop run a few steps, so
waiters, binds, dispatches, closes and reclaims interleave in every order Hypothesis
finds. Invariants are checked after every step.
"""

from __future__ import annotations

import asyncio

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SOURCE
from lorapub.core.identity import VersionKey
from lorapub.core.session import SessionState
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError
from lorapub.runtime.reclaimer import Reclaimer
from lorapub.core.registry import Commit, RecordBucketDone, RecordPrepared, RecordReady, Reserve
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.sessions import LocalState, SessionService
from lorapub.testing.fixtures import fake_plan

EPOCH = 2


class FakeEngine:
    """Serves any loaded name; records every dispatch with the registry's view at that moment."""

    def __init__(self, name, machine):
        self.name, self.machine = name, machine
        self.inflight: dict[str, int] = {}

    async def incarnation(self):
        return "life"

    async def generate(self, payload):
        m = self.machine
        v = next(v for v in m.service.state.versions.values() if v.lora_name == payload["lora_path"])
        local = next(h.state for h in m.handles if str(h.key) == payload["rid"])  # the session, at dispatch
        m.dispatched.append((payload["rid"], v.key, v.state, local))
        self.inflight[v.lora_name] = self.inflight.get(v.lora_name, 0) + 1
        try:
            for _ in range(payload.get("steps", 2)):
                await asyncio.sleep(0)
            return {"output_ids": [1], "meta_info": {"lora_id": v.lora_name}}
        finally:
            self.inflight[v.lora_name] -= 1

    async def reclaim(self, lora_name, reclaim_id):
        while self.inflight.get(lora_name, 0):  # native wait_for_unload
            await asyncio.sleep(0)
        self.machine.unloaded.append((self.name, lora_name))


class RemoteLikeRegistry(LocalRegistry):
    """Every call suspends once before and once after the decision, like a registry actor."""

    async def handle(self, command):
        await asyncio.sleep(0)
        reply = self.apply(command)
        await asyncio.sleep(0)
        return reply


class SessionRaces(RuleBasedStateMachine):
    sessions_ = Bundle("sessions")  # local Session handles, so a shrunk failure names which one

    @initialize()
    def setup(self):
        self.loop = asyncio.new_event_loop()
        self.service = self.registry = RemoteLikeRegistry(EPOCH, {"e0": "life", "e1": "life"})
        self.engines = {n: FakeEngine(n, self) for n in ("e0", "e1")}
        self.sessions = SessionService(self.registry, self.engines, epoch=EPOCH)
        self.reclaimer = Reclaimer(self.registry, self.engines)
        self.handles = []
        self.tasks: list[asyncio.Task] = []
        self.dispatched: list = []
        self.unloaded: list = []
        self.bound_once: dict = {}
        self.versions = 0

    def teardown(self):
        if hasattr(self, "loop"):
            for t in self.tasks:
                t.cancel()

            async def drain():
                await asyncio.gather(*self.tasks, return_exceptions=True)

            self.loop.run_until_complete(drain())
            self.loop.close()

    def steps(self, n):
        for _ in range(n):
            self.loop.run_until_complete(asyncio.sleep(0))

    def spawn(self, coro):
        task = self.loop.create_task(coro)
        self.tasks.append(task)
        return task

    # -- rules ---------------------------------------------------------------------
    @rule()
    def publish(self):
        """A whole publication decided at once (its I/O is not what this machine explores)."""
        s = self.service.state
        if s.slots_held >= s.capacity:
            return
        key = VersionKey(EPOCH, f"v{self.versions}")
        digest, plan = fake_plan(key.version_id, 1)
        out = self.service.apply(Reserve(key, digest, plan))
        token = out.reply.token
        for e in ("e0", "e1"):
            self.service.apply(RecordPrepared(token, e, "life"))
        for p in (SOURCE, "e0", "e1"):
            self.service.apply(RecordBucketDone(token, p, 0, None if p == SOURCE else "life"))
        for e in ("e0", "e1"):
            self.service.apply(RecordReady(ReadyLocal(e, token, digest, "life")))
        self.service.apply(Commit(key, token, self.service.state.default_revision))
        self.versions += 1

    @rule(target=sessions_, i=st.integers(0, 3), nonce=st.integers(0, 1))
    def open_session(self, i, nonce):
        h = self.sessions.session(f"s{i}", nonce=f"n{nonce}")
        self.handles.append(h)
        return h

    @rule(h=sessions_, waiters=st.integers(1, 3))
    def bind(self, h, waiters):
        for _ in range(waiters):
            self.spawn(self._swallow(h.bind))

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def cancel_a_waiter(self, data):
        data.draw(st.sampled_from(self.tasks)).cancel()

    @rule(h=sessions_, steps=st.integers(0, 4))
    def generate(self, h, steps):
        self.spawn(self._swallow(h.generate, {"rid": str(h.key), "steps": steps}))

    @rule(h=sessions_)
    def close(self, h):
        self.spawn(self._swallow(h.close))

    @rule(n=st.integers(1, 6))
    def run_loop(self, n):
        self.steps(n)

    @rule()
    def reclaim(self):
        self.spawn(self._swallow(self.reclaimer.reclaim_eligible))

    async def _swallow(self, fn, *args):
        try:
            return await fn(*args)
        except (LorapubError, asyncio.CancelledError):
            return None

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def refs_match_registry_sessions(self):
        state = self.service.state
        held = {}
        for record in state.sessions.values():
            if record.holds_ref:
                held[record.version] = held.get(record.version, 0) + 1
        for key, v in state.versions.items():
            assert v.session_refs == held.get(key, 0) >= 0

    @invariant()
    def bindings_are_made_once(self):
        for h in self.handles:
            if h.binding is not None:
                first = self.bound_once.setdefault(h.key, h.binding)
                assert first == h.binding
                record = self.service.state.sessions[h.key]
                assert record.version == h.binding.version
            if h.state is LocalState.CLOSED:
                assert self.service.state.sessions[h.key].state is SessionState.CLOSED

    @invariant()
    def dispatch_only_on_live_bound_versions(self):
        for rid, version, vstate, local in self.dispatched:
            assert vstate in (VersionState.PUBLISHED, VersionState.RETIRED), (rid, version, vstate)
            assert local not in (LocalState.FINALIZING, LocalState.CLOSED), f"{rid} dispatched after close began"

    @invariant()
    def unload_only_after_reclaim_started(self):
        for engine, name in self.unloaded:
            v = next(v for v in self.service.state.versions.values() if v.lora_name == name)
            assert v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED)
            assert v.session_refs == 0
        assert len(self.unloaded) == len(set(self.unloaded)), "an engine unloaded a version twice"


TestSessionRaces = SessionRaces.TestCase
