"""Model-based exploration of the whole core under races.

Commands go through the one door, ``handle(state, command)``. A simulated network holds
every effect the core emitted; rules deliver them
in any order, fail them, lose their replies, duplicate them, or replay old
replies late. Engines restart. Sessions open, bind and close in any order.
Invariants are checked after every step.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from lorapub.core import registry as R
from lorapub.core.attempt import Phase, ReadyLocal
from lorapub.core.effects import (
    SOURCE,
    ReadyToCommit,
    ReclaimEligible,
    SendBegin,
    SendCleanup,
    SendEnd,
    SendReclaim,
    TransferBucket,
)
from lorapub.core.commands import stamped
from lorapub.core.identity import SessionKey, VersionKey, new_nonce
from lorapub.core.session import SessionState
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError, NotReclaimable, SessionClosed
from lorapub.testing.fixtures import fake_plan

ENGINES = ("e0", "e1")
EPOCH = 7
WINDOW = 400.0
# s*: nonces of the caller's own (tombstones kept for the epoch); t*: born at a known time
# (forgotten after the window, and then every late message for them is still refused)
SESSION_POOL = [SessionKey(EPOCH, f"s{i}", "n0") for i in range(6)] + [
    SessionKey(EPOCH, f"t{i}", new_nonce(1000 + 100 * i, "abcdef")) for i in range(4)
]


@attrs.frozen
class BucketAck:
    token: object
    party: str
    index: int
    incarnation: str | None


class RegistryMachine(RuleBasedStateMachine):
    # Bundles: a shrunk failure reads as a program (v0 = reserve_new(...); claim_reclaim(key=v0)).
    versions = Bundle("versions")
    sessions = Bundle("sessions")

    @initialize()
    def setup(self):
        self.incarnations = {e: f"{e}-life0" for e in ENGINES}
        self.lives = {e: 0 for e in ENGINES}
        self.state = R.new_registry(EPOCH, self.incarnations, lease_ttl=120.0, tombstone_window=WINDOW)
        self.network: list = []  # effects waiting for delivery
        self.history: list = []  # replies already delivered once (replayed late)
        self.ready_to_commit: list[ReadyToCommit] = []
        self.next_version = 0
        self.digests: dict[VersionKey, str] = {}
        # model
        self.bound: dict[SessionKey, VersionKey] = {}
        self.closed: set[SessionKey] = set()
        self.collectives: set[tuple] = set()
        self.cleanup_sent: set = set()
        self.cleaned: set[tuple] = set()  # (token, engine, incarnation) confirmed
        self.unloaded: set[tuple] = set()  # (version, engine) confirmed
        self.default_history: list = []
        self.receipts: dict = {}
        self.now = 1000.0  # the registry's clock, stamped into commands as the single writer does
        self.holding: set[tuple] = set()  # (engine, incarnation, lora_name) truly loaded
        self.loaded_by: dict[tuple, object] = {}  # what `holding` holds -> the attempt whose end loaded it
        self.expired: set[SessionKey] = set()

    # -- helpers ------------------------------------------------------------
    def apply(self, outcome: R.Outcome):
        self.state = outcome.state
        for fx in outcome.effects:
            if isinstance(fx, TransferBucket):
                key = (fx.token, fx.index)
                assert key not in self.collectives, f"second collective for {key}"
                assert fx.token not in self.cleanup_sent, "transfer after cleanup"
                self.collectives.add(key)
                self.network.append(BucketAck(fx.token, SOURCE, fx.index, None))
                for e in fx.engines:
                    self.network.append(BucketAck(fx.token, e, fx.index, "?"))
            elif isinstance(fx, (SendBegin, SendEnd)):
                assert fx.token not in self.cleanup_sent, f"{type(fx).__name__} after cleanup"
                self.network.append(fx)
            elif isinstance(fx, SendCleanup):
                self.cleanup_sent.add(fx.token)
                self.network.append(fx)
            elif isinstance(fx, SendReclaim):
                self.network.append(fx)
            elif isinstance(fx, ReadyToCommit):
                self.ready_to_commit.append(fx)
            elif isinstance(fx, ReclaimEligible):
                v = self.state.versions[fx.version]
                assert v.state is VersionState.RETIRED and v.session_refs == 0
        return outcome.reply

    def try_apply(self, command):
        command = stamped(command, self.now)  # as the single writer does, before every transition
        try:
            return self.apply(R.handle(self.state, command))
        except LorapubError as e:
            return e

    def deliver_ok(self, msg):
        s = self.state
        if isinstance(msg, SendBegin):
            if msg.incarnation != self.incarnations[msg.engine]:
                self.try_apply(R.RecordFailure(msg.token, msg.engine, "unknown incarnation"))
                return
            reply = ("prepared", msg.token, msg.engine, msg.incarnation)
            self.try_apply(R.RecordPrepared(msg.token, msg.engine, msg.incarnation))
        elif isinstance(msg, BucketAck):
            inc = None if msg.party == SOURCE else self.incarnations[msg.party]
            reply = ("bucket", msg.token, msg.party, msg.index, inc)
            self.try_apply(R.RecordBucketDone(msg.token, msg.party, msg.index, inc))
        elif isinstance(msg, SendEnd):
            a = s.attempts[msg.token]
            receipt = ReadyLocal(msg.engine, msg.token, a.digest, self.incarnations[msg.engine], "lid")
            reply = ("ready", receipt)
            if msg.token not in self.cleanup_sent:  # the engine loads it pinned before it answers
                held = (msg.engine, self.incarnations[msg.engine], a.lora_name)
                if held not in self.holding:
                    self.holding.add(held)
                    self.loaded_by[held] = msg.token
            self.try_apply(R.RecordReady(receipt))
        elif isinstance(msg, SendCleanup):
            inc = self.incarnations[msg.engine]
            reply = ("cleaned", msg.token, msg.engine, inc)
            # The engine cleaned the attempt in its current life, whatever the registry knew then.
            self.cleaned.add((msg.token, msg.engine, inc))
            # it unloads what this attempt loaded, never a later attempt's load of the same name (an
            # attempt of the same version reserved again once this one was cleaned: this is a late duplicate)
            held = (msg.engine, inc, msg.lora_name)
            if self.loaded_by.get(held) == msg.token:
                self.holding.discard(held)
            self.try_apply(R.RecordCleaned(msg.token, msg.engine, inc))
        elif isinstance(msg, SendReclaim):
            reply = ("unloaded", msg.version, msg.reclaim_id, msg.engine)
            if s.versions[msg.version].reclaim_id == msg.reclaim_id:
                self.unloaded.add((msg.version, msg.engine))
            self.holding.discard((msg.engine, self.incarnations[msg.engine], msg.lora_name))
            self.try_apply(R.RecordUnloaded(msg.version, msg.reclaim_id, msg.engine))
        else:
            raise AssertionError(msg)
        self.history.append(reply)

    def replay(self, reply):
        kind = reply[0]
        if kind == "prepared":
            self.try_apply(R.RecordPrepared(*reply[1:]))
        elif kind == "bucket":
            self.try_apply(R.RecordBucketDone(*reply[1:]))
        elif kind == "ready":
            self.try_apply(R.RecordReady(reply[1]))
        elif kind == "cleaned":
            self.try_apply(R.RecordCleaned(*reply[1:]))
        elif kind == "unloaded":
            self.try_apply(R.RecordUnloaded(*reply[1:]))

    # -- publication rules -----------------------------------------------------
    @rule(target=versions, tensors=st.integers(1, 4))
    def reserve_new(self, tensors):
        key = VersionKey(EPOCH, f"v{self.next_version}")
        digest, plan = fake_plan(key.version_id, tensors, cap=128)
        before_slots = self.state.slots_held
        blocked = self.state.unresolved_attempt() is not None
        result = self.try_apply(R.Reserve(key, digest, plan))
        if isinstance(result, LorapubError):
            # Rejected before any begin: nothing entered the network.
            assert result.code in {"CAPACITY_ERROR", "PUBLICATION_BLOCKED"}, result
            assert (result.code == "PUBLICATION_BLOCKED") == blocked
            if result.code == "CAPACITY_ERROR":
                assert before_slots >= self.state.capacity
            assert key not in self.state.versions
            return multiple()
        assert not blocked and before_slots < self.state.capacity
        self.digests[key] = digest
        self.next_version += 1
        return key

    @rule(key=versions, same=st.booleans())
    def reserve_again(self, key, same):
        n_effects = len(self.network)
        if same:
            digest = self.digests[key]
            plan = self.state.attempts[self.state.versions[key].attempt].plan
            if self.state.versions[key].state is VersionState.FAILED_CLEAN:
                # Nothing of the failed attempt survives: the same id and digest start afresh.
                blocked = self.state.unresolved_attempt() is not None
                result = self.try_apply(R.Reserve(key, digest, plan))
                if isinstance(result, LorapubError):
                    assert result.code in {"CAPACITY_ERROR", "PUBLICATION_BLOCKED"}, result
                    assert (result.code == "PUBLICATION_BLOCKED") == blocked
                    assert self.state.versions[key].state is VersionState.FAILED_CLEAN
                    assert len(self.network) == n_effects
                else:
                    assert result.created and self.state.versions[key].state is VersionState.LOADING
                    assert result.token == self.state.versions[key].attempt
                return
            result = self.try_apply(R.Reserve(key, digest, plan))
            if self.state.versions[key].state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
                # published and reclaimed: an id is published once per epoch, never "reused" after
                assert getattr(result, "code", None) == "VERSION_RECLAIMING", result
            else:
                assert not isinstance(result, LorapubError), result
                assert not result.created and result.token == self.state.versions[key].attempt
        else:
            digest, plan = fake_plan(key.version_id + "-other", 2)
            result = self.try_apply(R.Reserve(key, digest, plan))
            assert getattr(result, "code", None) == "VERSION_CONFLICT"
        assert len(self.network) == n_effects

    @precondition(lambda self: self.network)
    @rule(data=st.data(), mode=st.sampled_from(["ok", "ok", "ok", "fail", "unknown", "duplicate", "bad_digest"]))
    def deliver(self, data, mode):
        i = data.draw(st.integers(0, len(self.network) - 1))
        msg = self.network.pop(i)
        engine = getattr(msg, "engine", None) or getattr(msg, "party", None)
        if mode == "ok":
            self.deliver_ok(msg)
        elif mode == "duplicate":
            self.deliver_ok(msg)
            self.deliver_ok(msg)
        elif mode == "bad_digest" and isinstance(msg, SendEnd):
            receipt = ReadyLocal(msg.engine, msg.token, "f" * 64, self.incarnations[msg.engine])
            self.try_apply(R.RecordReady(receipt))
        elif isinstance(msg, SendReclaim):
            if mode == "unknown":
                return  # the receipt never arrives; reclaim stays RECLAIMING
            self.deliver_ok(msg)
        elif mode == "fail":
            self.try_apply(R.RecordFailure(msg.token, engine, "engine said no"))
        else:
            op = type(msg).__name__
            self.try_apply(R.RecordUnknown(msg.token, engine, op))

    @precondition(lambda self: self.network)
    @rule(data=st.data())
    def deliver_all_ok(self, data):
        """Let the network drain happily (in a drawn order) so runs reach commit and reclaim."""
        for _ in range(200):
            if not self.network:
                break
            i = data.draw(st.integers(0, len(self.network) - 1))
            self.deliver_ok(self.network.pop(i))

    @rule(target=versions, data=st.data())
    def publish_cleanly(self, data):
        """reserve -> drain -> commit in one step: the happy path racing everything else."""
        reserved = self.reserve_new(tensors=data.draw(st.integers(1, 3)))
        self.deliver_all_ok(data)
        for fx in list(self.ready_to_commit):
            if fx.token not in self.receipts:
                self.commit_token(fx, lost_reply=False, stale_revision=False)
        return reserved

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def late_reply(self, data):
        self.replay(data.draw(st.sampled_from(self.history)))

    @rule(engine=st.sampled_from(ENGINES))
    def restart_engine(self, engine):
        self.lives[engine] += 1
        self.incarnations[engine] = f"{engine}-life{self.lives[engine]}"
        for key, v in self.state.versions.items():
            if v.state is VersionState.RECLAIMING and engine in v.reclaim_pending:
                self.unloaded.add((key, engine))  # the new life holds nothing: nothing to unload
        self.try_apply(R.RegisterEngine(engine, self.incarnations[engine]))

    @rule(engine=st.sampled_from(ENGINES))
    def silent_restart(self, engine):
        """The engine restarts and the registry does not know yet (no RegisterEngine)."""
        self.lives[engine] += 1
        self.incarnations[engine] = f"{engine}-life{self.lives[engine]}"

    @rule(engine=st.sampled_from(ENGINES))
    def notice_restart(self, engine):
        if self.state.engines[engine] != self.incarnations[engine]:
            for key, v in self.state.versions.items():
                if v.state is VersionState.RECLAIMING and engine in v.reclaim_pending:
                    self.unloaded.add((key, engine))
        self.try_apply(R.RegisterEngine(engine, self.incarnations[engine]))

    # -- recovery ----------------------------------------------------------------
    @precondition(lambda self: self.state.missing())
    @rule(data=st.data())
    def start_reprovision(self, data):
        engine, key = data.draw(st.sampled_from(self.state.missing()))
        token = self.try_apply(R.StartReprovision(key, engine))
        assert self.state.reprovisions[(engine, key)] == token
        assert self.try_apply(R.StartReprovision(key, engine)) == token  # a replay starts nothing new

    @precondition(lambda self: any(not a.resolved and not a.reprovision for a in self.state.attempts.values()))
    @rule(data=st.data())
    def abort_stale(self, data):
        live = sorted(t for t, a in self.state.attempts.items() if not a.resolved and not a.reprovision)
        self.try_apply(R.AbortStale(data.draw(st.sampled_from(live)), "publisher stopped"))

    @rule(seconds=st.sampled_from([1.0, 60.0, 200.0]))
    def time_passes(self, seconds):
        self.now += seconds

    @rule()
    def expire_leases(self):
        before = self.state
        self.try_apply(R.ExpireLeases(self.now))
        for key, record in self.state.sessions.items():
            if record.state is SessionState.EXPIRED and before.sessions[key].state is not SessionState.EXPIRED:
                assert before.sessions[key].lease_until < self.now
                self.expired.add(key)

    @rule(data=st.data())
    def renew_leases(self, data):
        keys = data.draw(st.lists(st.sampled_from(SESSION_POOL), max_size=3))
        gone = self.try_apply(R.RenewLeases(keys, self.now))
        for key in keys:
            record = self.state.sessions.get(key)
            assert (key in gone) == (record is None or record.state is SessionState.EXPIRED)
            if record is not None and record.state in (SessionState.OPEN, SessionState.BOUND, SessionState.CLOSING):
                assert record.lease_until == self.now + self.state.lease_ttl

    @precondition(lambda self: self.ready_to_commit)
    @rule(data=st.data(), lost_reply=st.booleans(), stale_revision=st.booleans())
    def commit(self, data, lost_reply, stale_revision):
        self.commit_token(data.draw(st.sampled_from(self.ready_to_commit)), lost_reply, stale_revision)

    def commit_token(self, fx, lost_reply, stale_revision):
        rev = fx.expected_default_revision + (1 if stale_revision else 0)
        before = self.state
        result = self.try_apply(R.Commit(fx.token.version, fx.token, rev))
        if isinstance(result, LorapubError):
            assert self.state is before
            return
        if fx.token in self.receipts:
            assert result == self.receipts[fx.token], "a replayed commit changed its receipt"
        else:
            assert not stale_revision
            self.receipts[fx.token] = result
            self.default_history.append(fx.token.version)
        if lost_reply:
            again = self.try_apply(R.Commit(fx.token.version, fx.token, rev))
            assert again == result

    @precondition(lambda self: any(a.phase is Phase.ABORTED for a in self.state.attempts.values()))
    @rule()
    def retry_cleanup(self):
        for token, a in self.state.attempts.items():
            if a.phase is Phase.ABORTED:
                self.try_apply(R.RetryCleanup(token))

    # -- sessions --------------------------------------------------------------
    @rule(target=sessions, i=st.integers(0, len(SESSION_POOL) - 1))
    def session_key(self, i):
        """Name one of the pool's session keys (no registry call): later rules act on it."""
        return SESSION_POOL[i]

    @rule(key=sessions)
    def open_session(self, key):
        result = self.try_apply(R.OpenSession(key))
        record = self.state.sessions.get(key)
        beyond = key.born is not None and key.born < self.now - WINDOW
        if record is None:  # refused without a record: born before the window (its tombstone may be gone)
            assert beyond and getattr(result, "code", None) == "SESSION_EXPIRED", result
            return
        ended = key in self.closed or key in self.expired or record.state in (SessionState.CLOSING, SessionState.EXPIRED)
        assert isinstance(result, LorapubError) == ended, result
        if isinstance(result, LorapubError):
            assert result.code in ("SESSION_CLOSED", "SESSION_EXPIRED"), result

    @rule(key=sessions, lost_reply=st.booleans())
    def bind_first(self, key, lost_reply):
        default = self.state.default
        result = self.try_apply(R.BindFirst(key, self.now))
        if isinstance(result, LorapubError):
            record = self.state.sessions.get(key)
            if result.code == "NO_PUBLISHED_VERSION":
                assert default is None
            elif result.code == "SESSION_EXPIRED":
                beyond = key.born is not None and key.born < self.now - WINDOW
                assert (key in self.expired and record is not None and record.state is SessionState.EXPIRED) or (
                    record is None and beyond)
            else:
                assert result.code == "SESSION_CLOSED" and record.state in (SessionState.CLOSING, SessionState.CLOSED)
            return
        assert key not in self.closed and key not in self.expired, f"{key} bound again after it ended"
        if key in self.bound:
            assert result.version == self.bound[key], "binding changed"
        else:
            assert result.version == default
            self.bound[key] = result.version
        if lost_reply:
            assert self.try_apply(R.BindFirst(key, self.now)) == result

    @rule(key=sessions)
    def begin_close(self, key):
        self.try_apply(R.BeginClose(key))

    @rule(key=sessions, repeat=st.booleans())
    def close_and_release(self, key, repeat):
        self.try_apply(R.CloseAndRelease(key))
        self.closed.add(key)
        if repeat:
            self.try_apply(R.CloseAndRelease(key))

    @rule(key=sessions)
    def dispatch(self, key):
        try:
            result = R.handle(self.state, R.AuthorizeDispatch(key)).reply
        except LorapubError as e:
            record = self.state.sessions.get(key)
            assert record is None or record.state is not SessionState.BOUND, e
        else:
            v = self.state.versions[result.version]
            assert v.state in (VersionState.PUBLISHED, VersionState.RETIRED)
            assert key not in self.closed
            assert result.version == self.bound[key]

    # -- reclaim ---------------------------------------------------------------
    @rule(key=versions)
    def claim_reclaim(self, key):
        v = self.state.versions[key]
        result = self.try_apply(R.ClaimReclaim(key))
        if isinstance(result, NotReclaimable):
            assert v.state not in (VersionState.RECLAIMING, VersionState.RECLAIMED)
            assert v.state is not VersionState.RETIRED or v.session_refs > 0
        elif v.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
            assert result == v.reclaim_id, "repeated claim changed the reclaim id"

    @precondition(lambda self: any(v.state is VersionState.RECLAIMING for v in self.state.versions.values()))
    @rule()
    def retry_reclaim(self):
        for key, v in self.state.versions.items():
            if v.state is VersionState.RECLAIMING:
                self.try_apply(R.RetryReclaim(key))

    # -- invariants ------------------------------------------------------------
    @invariant()
    def capacity_respected(self):
        assert self.state.slots_held <= self.state.capacity
        live = [v for v in self.state.versions.values() if v.state in (VersionState.PUBLISHED, VersionState.RETIRED, VersionState.RECLAIMING)]
        assert len(live) <= self.state.capacity

    @invariant()
    def refs_match_sessions(self):
        held: dict = {}
        for record in self.state.sessions.values():
            if record.holds_ref:
                held[record.version] = held.get(record.version, 0) + 1
                assert record.state in (SessionState.BOUND, SessionState.CLOSING)
        for key, v in self.state.versions.items():
            assert v.session_refs >= 0
            assert v.session_refs == held.get(key, 0), f"{key}: refs {v.session_refs} vs sessions {held.get(key, 0)}"

    @invariant()
    def one_binding_per_session(self):
        for key, record in self.state.sessions.items():
            if record.version is not None:
                assert self.bound[key] == record.version
            if key in self.closed:
                assert record.state in (SessionState.CLOSED, SessionState.EXPIRED) and not record.holds_ref
            if key in self.expired:
                assert record.state is SessionState.EXPIRED and not record.holds_ref

    @invariant()
    def default_moves_forward_only(self):
        s = self.state
        assert s.default_revision == len(self.default_history)
        if s.default is not None:
            assert s.default == self.default_history[-1]
            assert s.versions[s.default].state is VersionState.PUBLISHED
        published = [k for k, v in s.versions.items() if v.state is VersionState.PUBLISHED]
        assert published == ([s.default] if s.default else [])

    @invariant()
    def nothing_released_on_unknown(self):
        for key, v in self.state.versions.items():
            if v.state is VersionState.FAILED_CLEAN:
                a = self.state.attempts[v.attempt]
                for t in a.targets:
                    assert (v.attempt, t.engine, t.incarnation) in self.cleaned, f"{key} freed without {t.engine} cleanup"
            if v.state is VersionState.RECLAIMED:
                for e in v.engines:
                    assert (key, e) in self.unloaded, f"{key} reclaimed without {e} receipt"

    @invariant()
    def at_most_one_unresolved_attempt(self):
        unresolved = [a for a in self.state.attempts.values() if not a.resolved and not a.reprovision]
        assert len(unresolved) <= 1
        for (engine, key), token in self.state.reprovisions.items():
            a = self.state.attempts[token]
            assert a.reprovision and not a.resolved and a.engines == (engine,)

    @invariant()
    def holders_truly_hold(self):
        """Every engine the registry routes a version to holds it in the life the registry knows."""
        for key, v in self.state.versions.items():
            if v.state in (VersionState.PUBLISHED, VersionState.RETIRED):
                for e in v.engines:
                    assert (e, self.state.engines[e], v.lora_name) in self.holding, f"{key} not held by {e}"

    @invariant()
    def reclaiming_never_dispatchable(self):
        for key, record in self.state.sessions.items():
            if record.state is SessionState.BOUND:
                assert self.state.versions[record.version].state in (VersionState.PUBLISHED, VersionState.RETIRED)


TestRegistryMachine = RegistryMachine.TestCase
