"""The engine-side staging's pure machine, explored by Hypothesis under every interleaving the engine
allows.

Operations run as the engine runs them (:class:`~lorapub.sglang_patch.staging.engine.EngineStaging`):
an admission, the steps taken under the attempt's lock (one holder at a time), what the I/O did
(bytes stored or lost, a collective that failed, a load that registered the adapter or did not),
then ``Leave``; begins, cleanups, releases, sweeps and an operator's unload come at any point. A
fake engine keeps the ledger of every buffer (landed, held, closed) and every adapter loaded.
Invariants, after every step:

* an attempt's bytes are never both held and released: the buffers the machine says an attempt holds
  are exactly the live buffers the effects kept for it, and no buffer is closed twice;
* a tombstoned attempt never becomes loadable: no load starts for it, and it stays staged only while
  the cleanup (or release) that tombstoned it waits for the lock;
* the bytes held plus those reserved never exceed the byte budget;
* a late or duplicate message never changes a terminal attempt (loaded, or tombstoned);
* no adapter is loaded that nobody was told of: every adapter the engine registered was answered by
  an ``end`` or by a cleanup, or its attempt still keeps the receipt a cleanup will answer (a cleanup
  during ``end`` included).
"""

from __future__ import annotations

import itertools

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.staging import machine as M
from lorapub.core.staging import messages as m

LIFE = "life-1"
BUDGET = 900
SLOTS = 3
# seq 1 and seq 2 of a version share a name (a re-provisioning attempt of the same version)
TOKENS = [AttemptToken(VersionKey(1, f"v{v}"), seq) for v in range(4) for seq in (1, 2)]
NAMES = sorted({f"lora-{t.version.version_id}" for t in TOKENS})
FORMATS = ["raw", "safetensors", "shm", "torch"]
MESSAGES = (m.Begin, m.Receive, m.Arrive, m.End, m.Finish)  # what a publisher sends, late or twice


def name_of(token: AttemptToken) -> str:
    return f"lora-{token.version.version_id}"


@attrs.define
class Op:
    """An operation the engine runs: ``stage`` admitted -> locked (its I/O runs under the lock) or
    awaiting (a collective it started runs outside the lock) -> over."""

    id: int
    kind: str  # receive | end | cleanup | release
    token: AttemptToken
    index: int = 0
    fmt: str = "raw"
    length: int | None = None
    stage: str = "admitted"


class StagingMachine(RuleBasedStateMachine):
    @initialize(budget=st.sampled_from([BUDGET, None]))
    def setup(self, budget):
        self.state = M.new_state(LIFE, budget, idle_timeout=50.0)
        self.budget = budget
        self.now = 0.0
        self.ids = itertools.count()
        self.ops: list[Op] = []
        self.locks: dict[AttemptToken, int] = {}  # token -> the op holding its lock
        self.collectives: dict[tuple[AttemptToken, int], Op] = {}  # running outside the lock
        self.landed: dict[tuple[AttemptToken, int], int] = {}  # buffers the machine decides on -> buffer id
        self.held: dict[tuple[AttemptToken, int], int] = {}  # buffers kept for an attempt -> buffer id
        self.closed: set[int] = set()
        self.adapters: dict[str, str] = {}  # the engine's registered adapters: name -> lora_id
        self.told: set[str] = set()  # lora_ids an end or a cleanup answered
        self.loads_begun_tombstoned: list[AttemptToken] = []

    # -- the door, with the engine's side of every effect ---------------------------------------------
    def apply(self, command):
        before = self.state
        out = M.handle(self.state, command)
        self.state = out.state
        token = getattr(command, "token", None)
        if isinstance(command, MESSAGES) and token is not None:
            old, new = before.attempts.get(token), self.state.attempts.get(token)
            if token in before.tombstones:  # a late message recreates nothing
                assert new is None or old is not None, command
            if old is not None and old.phase is M.Phase.LOADED:  # nor changes what was loaded (only who drives it)
                assert attrs.evolve(new, driving=old.driving, last_driven=old.last_driven) == old, command
        for effect in out.effects:
            self.run(effect)
        return out.reply, out.effects

    def close(self, key) -> None:
        buffer = self.held.pop(key)
        assert buffer not in self.closed
        self.closed.add(buffer)

    def run(self, effect) -> None:
        if isinstance(effect, m.Verify):
            self.held[(effect.token, effect.index)] = self.landed.pop((effect.token, effect.index))
        elif isinstance(effect, m.CloseBuffer):
            buffer = self.landed.pop((effect.token, effect.index))
            assert buffer not in self.closed
            self.closed.add(buffer)
        elif isinstance(effect, (m.ReleaseBytes, m.Free)):
            for key in [k for k in self.held if k[0] == effect.token]:
                self.close(key)

    def pick(self, data) -> AttemptToken:
        """Mostly a staged attempt (so work progresses), else any token (late, unknown, tombstoned)."""
        live = sorted(self.state.attempts, key=str)
        if live and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(live))
        return data.draw(st.sampled_from(TOKENS))

    def op(self, kind, token, **kwargs) -> Op:
        op = Op(next(self.ids), kind, token, **kwargs)
        self.ops.append(op)
        return op

    def over(self, op: Op) -> None:
        if self.locks.get(op.token) == op.id:
            del self.locks[op.token]
        self.ops.remove(op)
        self.apply(m.Leave(op.token, self.now))

    # -- what publishers send ------------------------------------------------------------------------------
    @rule(data=st.data(), sizes=st.lists(st.integers(0, 300), min_size=1, max_size=3),
          load=st.sampled_from(["dir", "tensors"]), transport=st.sampled_from(["http", "shm", "torch"]),
          other_digest=st.sampled_from([False] * 5 + [True]),
          wrong=st.sampled_from([None] * 5 + ["problem", "late", "life"]), disk_fails=st.sampled_from([False] * 5 + [True]))
    def begin(self, data, sizes, load, transport, other_digest, wrong, disk_fails):
        token = data.draw(st.sampled_from(TOKENS))
        problem = m.invalid("malformed") if wrong == "problem" else None
        late = m.invalid("a dtype no folder stores") if wrong == "late" else None
        life = "another-life" if wrong == "life" else LIFE
        reply, effects = self.apply(m.Begin(
            token, life, "d-other" if other_digest else f"d-{token}", name_of(token), tuple(sizes), load, transport,
            problem, late, frozenset(self.adapters), SLOTS, self.now))
        if token in self.state.tombstones:
            assert isinstance(reply, m.Refusal) and reply.code == "STAGE_TOMBSTONE"
        if reply == m.Accepted(False):
            assert wrong is None and (m.PrepareFolder(token) in effects) == (load == "dir")
            if load == "dir" and disk_fails:
                self.apply(m.Abandon(token))
                assert token not in self.state.attempts and token not in self.state.tombstones

    @rule(data=st.data(), fmt=st.sampled_from(FORMATS), bad=st.sampled_from([False] * 5 + [True]))
    def start_receive(self, data, fmt, bad):
        token = self.pick(data)
        attempt = self.state.attempts.get(token)
        missing = attempt.missing if attempt is not None else []
        if missing and not bad:
            index = data.draw(st.sampled_from(missing))
        else:
            index = data.draw(st.integers(-1, len(attempt.sizes) if attempt else 2))
        if attempt is not None and fmt == "torch" and attempt.transport != "torch" and not bad:
            fmt = "raw"
        length = None
        if fmt == "raw" and attempt is not None and 0 <= index < len(attempt.sizes):
            length = attempt.sizes[index] + (1 if bad else 0)
        elif fmt == "safetensors" and attempt is not None and 0 <= index < len(attempt.sizes):
            length = attempt.sizes[index] + data.draw(st.integers(8, 64))
        reply, _ = self.apply(m.Receive(token, LIFE, m.invalid("bad index") if bad and fmt == "shm" else None, self.now))
        if isinstance(reply, m.Proceed):
            self.op("receive", token, index=index, fmt=fmt, length=length)

    @rule(data=st.data())
    def send_bucket(self, data):
        """A bucket sent and stored without anything in between (the common case)."""
        token = self.pick(data)
        attempt = self.state.attempts.get(token)
        if attempt is None or token in self.locks or not attempt.missing:
            return
        index = data.draw(st.sampled_from(attempt.missing))
        fmt = "torch" if attempt.transport == "torch" else "raw"
        if isinstance(self.apply(m.Receive(token, LIFE, None, self.now))[0], m.Proceed):
            op = self.op("receive", token, index=index, fmt=fmt, length=attempt.sizes[index])
            self.locks[token] = op.id
            reply, effects = self.apply(m.Arrive(token, index, fmt, op.length, self.now))
            if isinstance(reply, m.Proceed):
                self.deliver(token, index, True)
            self.over(op)

    @rule(data=st.data())
    def end_now(self, data):
        """An attempt every bucket of which arrived is ended at once: its load runs (under the lock)."""
        ready = sorted((t for t, a in self.state.attempts.items()
                        if not a.missing and a.phase is M.Phase.RECEIVING and t not in self.locks), key=str)
        if not ready:
            return
        token = data.draw(st.sampled_from(ready))
        if isinstance(self.apply(m.End(token, LIFE, self.now))[0], m.Proceed):
            self.op("end", token)
            self.take(self.ops[-1])

    @rule(data=st.data())
    def start_end(self, data):
        token = self.pick(data)
        reply, _ = self.apply(m.End(token, LIFE, self.now))
        if isinstance(reply, m.Proceed):
            self.op("end", token)

    @rule(data=st.data())
    def start_cleanup(self, data):
        self.cleanup(data.draw(st.sampled_from(TOKENS)))

    @precondition(lambda self: any(o.stage == "locked" and o.kind == "end" for o in self.ops))
    @rule(data=st.data())
    def cleanup_during_end(self, data):
        """The publisher gives the attempt up while its end's load runs."""
        self.cleanup(data.draw(st.sampled_from([o.token for o in self.ops if o.stage == "locked" and o.kind == "end"])))

    def cleanup(self, token):
        reply, _ = self.apply(m.Cleanup(token, self.now))
        assert token in self.state.tombstones
        if isinstance(reply, m.Wait):
            self.op("cleanup", token)
        else:
            assert reply == m.Cleaned(None) and token not in self.state.attempts

    @rule(name=st.sampled_from(NAMES))
    def start_release(self, name):
        reply, _ = self.apply(m.Release(name, name in self.adapters, self.now))
        if isinstance(reply, m.Refusal):
            assert name in self.adapters
            return
        for token in reply.tokens:
            self.op("release", token)

    # -- the engine runs them -------------------------------------------------------------------------------
    @precondition(lambda self: any(o.stage == "admitted" and o.token not in self.locks for o in self.ops))
    @rule(data=st.data())
    def take_lock(self, data):
        self.take(data.draw(st.sampled_from([o for o in self.ops if o.stage == "admitted" and o.token not in self.locks])))

    def take(self, op: Op) -> None:
        self.locks[op.token] = op.id
        token = op.token
        if op.kind == "receive":
            reply, effects = self.apply(m.Arrive(token, op.index, op.fmt, op.length, self.now))
            if isinstance(reply, m.Proceed) and isinstance(effects[0], m.Collect):
                op.stage = "awaiting"  # the collective runs outside the lock
                self.collectives[(token, op.index)] = op
                del self.locks[token]
            elif isinstance(reply, m.Proceed):
                op.stage = "locked"  # the bytes arrive under the lock
            elif isinstance(reply, m.Join):
                assert (token, op.index) in self.collectives
                self.over(op)
            else:
                self.over(op)
        elif op.kind == "end":
            tombstoned = token in self.state.tombstones
            reply, effects = self.apply(m.Finish(token, self.now))
            if isinstance(reply, m.Proceed):
                assert effects == (m.Load(token),)
                if tombstoned:
                    self.loads_begun_tombstoned.append(token)
                op.stage = "locked"  # the load runs under the lock
            else:
                if isinstance(reply, m.Receipted):
                    assert reply.duplicate
                    self.told.add(reply.receipt.lora_id)
                self.over(op)
        elif op.kind == "cleanup":
            reply, _ = self.apply(m.Discard(token))
            if reply.loaded is not None:  # its caller unloads exactly what this attempt loaded
                self.told.add(reply.loaded.lora_id)
                if self.adapters.get(reply.loaded.lora_name) == reply.loaded.lora_id:
                    del self.adapters[reply.loaded.lora_name]
            assert token not in self.state.attempts
            self.over(op)
        else:
            reply, _ = self.apply(m.Forget(token, dict(self.adapters)))
            if isinstance(reply, m.Kept):  # its end loaded the name again meanwhile: what it loaded stays told
                receipt = self.state.attempts[token].receipt
                assert self.adapters.get(receipt.lora_name) == receipt.lora_id
            else:
                assert reply == m.Freed(token) and token not in self.state.attempts and token in self.state.tombstones
            self.over(op)

    @precondition(lambda self: any(o.stage == "locked" and o.kind == "receive" for o in self.ops))
    @rule(data=st.data(), arrived=st.booleans())
    def bytes_arrive(self, data, arrived):
        op = data.draw(st.sampled_from([o for o in self.ops if o.stage == "locked" and o.kind == "receive"]))
        self.deliver(op.token, op.index, arrived)
        self.over(op)

    @precondition(lambda self: self.collectives)
    @rule(data=st.data(), outcome=st.sampled_from(["stored", "failed", "lost"]))
    def collective_ends(self, data, outcome):
        key = data.draw(st.sampled_from(sorted(self.collectives, key=str)))
        op = self.collectives.pop(key)
        if outcome == "failed":
            _, effects = self.apply(m.CollectFailed(key[0], key[1], "broadcast timed out", self.now))
            if key[0] in self.state.attempts:
                assert self.state.attempts[key[0]].phase is M.Phase.FAILED
        else:
            self.deliver(key[0], key[1], outcome == "stored")
        self.over(op)

    def deliver(self, token, index, arrived):
        attempt = self.state.attempts.get(token)
        if not arrived:
            self.apply(m.Lost(token, index, self.now))
            return
        nbytes = attempt.arriving[index] if attempt is not None else 1
        self.landed[(token, index)] = next(self.ids)
        reply, effects = self.apply(m.Stored(token, index, nbytes, self.now))
        if token in self.state.tombstones or token not in self.state.attempts:
            assert isinstance(reply, m.Refusal) and effects == (m.CloseBuffer(token, index),)
        else:
            assert reply == m.Accepted(False) and self.state.attempts[token].held[index] == nbytes
        assert (token, index) not in self.landed

    @precondition(lambda self: any(o.stage == "locked" and o.kind == "end" for o in self.ops))
    @rule(data=st.data(), outcome=st.sampled_from(["loaded", "loaded", "refused", "unverified"]),
          given_up=st.booleans())
    def load_ends(self, data, outcome, given_up):
        op = data.draw(st.sampled_from([o for o in self.ops if o.stage == "locked" and o.kind == "end"]))
        token, name = op.token, name_of(op.token)
        if given_up:  # its publisher gave it up meanwhile: a cleanup came during the load
            self.cleanup(token)
        if outcome == "loaded" and name not in self.adapters:
            lora_id = f"id-{next(self.ids)}"
            self.adapters[name] = lora_id  # the engine registered it, pinned
            receipt = m.Receipt(LIFE, name, f"d-{token}", lora_id, "/stash", "dir")
            reply, effects = self.apply(m.Loaded(token, receipt))
            assert m.ReleaseBytes(token) in effects
            if isinstance(reply, m.Receipted):
                self.told.add(lora_id)
            else:  # a cleanup came during the load: it will answer the adapter
                assert reply.code == "STAGE_TOMBSTONE" and token in self.state.tombstones
                assert self.state.attempts[token].receipt == receipt
        else:
            fails = outcome == "unverified"
            self.apply(m.LoadFailed(token, m.Refusal(400, "STAGE_DIGEST", "a tensor does not verify"), fails))
            assert self.state.attempts[token].phase is (M.Phase.FAILED if fails else M.Phase.RECEIVING)
        self.over(op)

    # -- time, the registry, an operator -------------------------------------------------------------------
    @rule(advance=st.sampled_from([0.0, 0.0, 10.0, 10.0, 60.0]), known=st.booleans())
    def sweep(self, advance, known):
        self.now += advance
        adapters = dict(self.adapters) if known else None
        before = self.state
        reply, _ = self.apply(m.Sweep(self.now, adapters))
        for aged in reply:
            assert aged.token not in self.state.attempts and aged.token in self.state.tombstones
            assert not any(o.token == aged.token for o in self.ops)  # never while an operation drives it
            assert self.now - before.attempts[aged.token].last_driven >= before.idle_timeout
            receipt = before.attempts[aged.token].receipt
            if receipt is not None:  # aging never drops an attempt whose adapter is registered (nor when unknown)
                assert adapters is not None and adapters.get(receipt.lora_name) != receipt.lora_id

    @precondition(lambda self: self.adapters)
    @rule(data=st.data())
    def reclaim_unloads(self, data):
        """The registry reclaims (or an operator unloads) an adapter it was told of."""
        name = data.draw(st.sampled_from(sorted(self.adapters)))
        if self.adapters[name] in self.told:
            del self.adapters[name]

    def teardown(self):
        """The server life ends: every attempt is freed, every buffer it held closed."""
        if not hasattr(self, "state"):
            return
        self.apply(m.Close())
        assert not self.state.attempts and not self.held and self.state.closed
        assert self.apply(m.Sweep(self.now + 1e6, None))[0] == ()

    # -- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def bytes_are_held_or_released_never_both(self):
        for token, attempt in self.state.attempts.items():
            kept = {i for (t, i) in self.held if t == token}
            assert kept == set(attempt.held), (token, kept, dict(attempt.held))
            assert not set(attempt.held) & set(attempt.arriving)
        assert all(t in self.state.attempts for (t, _) in self.held)
        assert not set(self.held.values()) & self.closed
        assert not self.landed  # every landed buffer was kept or closed in the same step

    @invariant()
    def a_tombstoned_attempt_never_loads(self):
        assert self.loads_begun_tombstoned == []
        for token in self.state.tombstones & set(self.state.attempts):
            attempt = self.state.attempts[token]
            assert attempt.driving > 0  # its cleanup or release waits for the lock, then frees it
            assert attempt.phase is not M.Phase.LOADING or self.locks.get(token) is not None

    @invariant()
    def the_budget_holds(self):
        if self.budget is not None:
            assert self.state.held_bytes + self.state.reserved_bytes <= self.budget

    @invariant()
    def loaded_attempts_hold_no_bytes(self):
        for attempt in self.state.attempts.values():
            if attempt.phase is M.Phase.LOADED:
                assert not attempt.held and not attempt.arriving and attempt.receipt is not None
            else:
                assert attempt.receipt is None
            if attempt.phase is M.Phase.LOADING:
                assert any(o.kind == "end" and o.stage == "locked" and o.token == attempt.token for o in self.ops)

    @invariant()
    def no_adapter_is_loaded_that_nobody_was_told_of(self):
        receipts = {a.receipt.lora_id for a in self.state.attempts.values() if a.receipt is not None}
        for name, lora_id in self.adapters.items():
            assert lora_id in self.told or lora_id in receipts, (name, lora_id)


TestStagingMachine = StagingMachine.TestCase
