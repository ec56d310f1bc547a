"""Example-based tests for the RFC's state/fault rows that live in the core."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lorapub.core import registry as R
from lorapub.core.attempt import Phase, ReadyLocal
from lorapub.core.effects import SOURCE, ReclaimEligible, SendBegin, SendCleanup, SendReclaim, TransferBucket
from lorapub.core.identity import SessionKey, VersionKey, lora_name_for
from lorapub.core.version import VersionState
from lorapub.errors import (
    CapacityError,
    NoPublishedVersion,
    NotReady,
    NotReclaimable,
    PublicationBlocked,
    SessionClosed,
    VersionConflict,
    VersionReclaiming,
)
from lorapub.testing.fixtures import fake_plan

E = {"e0": "e0-a", "e1": "e1-a"}
EP = 3


def key(v: str) -> VersionKey:
    return VersionKey(EP, v)


def sk(s: str, nonce: str = "n") -> SessionKey:
    return SessionKey(EP, s, nonce)


def run_to_ready(state, v: str, ready_on=("e0", "e1")):
    digest, plan = fake_plan(v)
    out = R.reserve(state, R.Reserve(key(v), digest, plan))
    state, token = out.state, out.reply.token
    for e, inc in E.items():
        state = R.record_prepared(state, R.RecordPrepared(token, e, inc)).state
    for i in range(len(plan)):
        for p in (SOURCE, *E):
            state = R.record_bucket_done(state, R.RecordBucketDone(token, p, i, E.get(p))).state
    for e in ready_on:
        state = R.record_ready(state, R.RecordReady(ReadyLocal(e, token, digest, E[e]))).state
    return state, token


def publish(state, v: str):
    state, token = run_to_ready(state, v)
    out = R.commit(state, R.Commit(key(v), token, state.default_revision))
    return out.state, token


@pytest.fixture
def fresh():
    return R.new_registry(EP, E)


def test_lora_name_is_immutable_and_carries_digest_prefix():
    d, _ = fake_plan("x")
    assert lora_name_for(key("v1"), d) == f"relax_policy_lora@{EP}-v1-{d[:12]}"


def test_no_published_version_before_first_commit(fresh):
    with pytest.raises(NoPublishedVersion):
        R.bind_first(fresh, R.BindFirst(sk("s")))
    state, _ = run_to_ready(fresh, "A")
    with pytest.raises(NoPublishedVersion):  # READY is not PUBLISHED
        R.bind_first(state, R.BindFirst(sk("s")))


def test_partial_ready_keeps_default_then_commit_switches(fresh):
    state, _ = publish(fresh, "A")
    state = R.bind_first(state, R.BindFirst(sk("old"))).state
    state, token_b = run_to_ready(state, "B", ready_on=("e0",))
    with pytest.raises(NotReady):
        R.commit(state, R.Commit(key("B"), token_b, state.default_revision))
    out = R.bind_first(state, R.BindFirst(sk("mid")))
    assert out.reply.version == key("A")
    state = out.state
    digest_b = state.versions[key("B")].digest
    state = R.record_ready(state, R.RecordReady(ReadyLocal("e1", token_b, digest_b, E["e1"]))).state
    state = R.commit(state, R.Commit(key("B"), token_b, state.default_revision)).state
    assert R.bind_first(state, R.BindFirst(sk("new"))).reply.version == key("B")
    # Old sessions keep A for every later turn, retry and resume.
    for s in ("old", "mid"):
        assert R.bind_first(state, R.BindFirst(sk(s))).reply.version == key("A")
        assert R.authorize_dispatch(state, R.AuthorizeDispatch(sk(s))).reply.version == key("A")
    assert state.versions[key("A")].state is VersionState.RETIRED


def test_duplicate_publication_is_idempotent_and_conflict_is_rejected(fresh):
    digest, plan = fake_plan("A")
    out = R.reserve(fresh, R.Reserve(key("A"), digest, plan))
    again = R.reserve(out.state, R.Reserve(key("A"), digest, plan))
    assert again.reply.token == out.reply.token and not again.reply.created
    assert again.effects == () and again.state.slots_held == 1
    other, other_plan = fake_plan("A-other")
    with pytest.raises(VersionConflict):
        R.reserve(out.state, R.Reserve(key("A"), other, other_plan))
    # Still a conflict after the version has long been reclaimed: the epoch remembers digests.
    state, _ = publish(fresh, "A")
    state, _ = publish(state, "B")
    state = R.claim_reclaim(state, R.ClaimReclaim(key("A"))).state
    for e in E:
        state = R.record_unloaded(state, R.RecordUnloaded(key("A"), state.versions[key("A")].reclaim_id, e)).state
    with pytest.raises(VersionConflict):
        R.reserve(state, R.Reserve(key("A"), other, other_plan))


def test_replayed_commit_returns_receipt_and_never_regresses_default(fresh):
    state, token_a = publish(fresh, "A")
    receipt_a = state.versions[key("A")].commit
    state, _ = publish(state, "B")
    replay = R.commit(state, R.Commit(key("A"), token_a, 0))
    assert replay.reply == receipt_a and replay.state is state
    assert state.default == key("B") and state.default_revision == 2


def test_single_engine_failure_aborts_and_frees_only_after_both_clean(fresh):
    state, _ = publish(fresh, "A")
    digest, plan = fake_plan("B")
    out = R.reserve(state, R.Reserve(key("B"), digest, plan))
    state, token = out.state, out.reply.token
    state = R.record_prepared(state, R.RecordPrepared(token, "e0", E["e0"])).state
    out = R.record_failure(state, R.RecordFailure(token, "e1", "out of memory"))
    state = out.state
    assert {type(fx) for fx in out.effects} == {SendCleanup}
    assert state.versions[key("B")].state is VersionState.ABORTED
    assert state.default == key("A") and state.slots_held == 2
    state = R.record_cleaned(state, R.RecordCleaned(token, "e0", E["e0"])).state
    with pytest.raises(PublicationBlocked):
        R.reserve(state, R.Reserve(key("C"), *fake_plan("C")))
    # Unknown cleanup on e1 keeps the slot and the block.
    state = R.record_unknown(state, R.RecordUnknown(token, "e1", "cleanup")).state
    assert state.versions[key("B")].state is VersionState.ABORTED and state.slots_held == 2
    out = R.retry_cleanup(state, R.RetryCleanup(token))
    assert [fx.engine for fx in out.effects] == ["e1"]
    state = R.record_cleaned(out.state, R.RecordCleaned(token, "e1", E["e1"])).state
    assert state.versions[key("B")].state is VersionState.FAILED_CLEAN and state.slots_held == 1


def test_bad_manifest_digest_in_ready_aborts(fresh):
    state, token = run_to_ready(fresh, "A", ready_on=())
    state = R.record_ready(state, R.RecordReady(ReadyLocal("e0", token, "0" * 64, E["e0"]))).state
    assert state.attempts[token].phase is Phase.ABORTED


def test_late_control_messages_after_cleanup_recreate_nothing(fresh):
    digest, plan = fake_plan("A", tensors=3, cap=64)
    out = R.reserve(fresh, R.Reserve(key("A"), digest, plan))
    state, token = out.state, out.reply.token
    state = R.record_prepared(state, R.RecordPrepared(token, "e0", E["e0"])).state
    state = R.record_failure(state, R.RecordFailure(token, "e1", "boom")).state
    for e in E:
        state = R.record_cleaned(state, R.RecordCleaned(token, e, E[e])).state
    assert state.versions[key("A")].state is VersionState.FAILED_CLEAN
    for late in (
        R.record_prepared(state, R.RecordPrepared(token, "e1", E["e1"])),
        R.record_bucket_done(state, R.RecordBucketDone(token, "e0", 0, E["e0"])),
        R.record_ready(state, R.RecordReady(ReadyLocal("e0", token, digest, E["e0"]))),
    ):
        assert late.state.versions == state.versions
        assert not [fx for fx in late.effects if not type(fx).__name__ == "Ignored"]


def test_duplicate_bucket_completion_never_starts_a_second_collective(fresh):
    digest, plan = fake_plan("A", tensors=3, cap=64)
    out = R.reserve(fresh, R.Reserve(key("A"), digest, plan))
    state, token = out.state, out.reply.token
    transfers = []
    for e in E:
        out = R.record_prepared(state, R.RecordPrepared(token, e, E[e]))
        state = out.state
        transfers += [fx for fx in out.effects if isinstance(fx, TransferBucket)]
    for p in (SOURCE, "e0", "e0", "e1", "e1", SOURCE):
        out = R.record_bucket_done(state, R.RecordBucketDone(token, p, 0, E.get(p)))
        state = out.state
        transfers += [fx for fx in out.effects if isinstance(fx, TransferBucket)]
    assert [fx.index for fx in transfers] == [0, 1]


def test_ready_from_old_incarnation_cannot_commit(fresh):
    state, token = run_to_ready(fresh, "A")
    state = R.register_engine(state, R.RegisterEngine("e1", "e1-b")).state  # restart after READY
    assert state.attempts[token].phase is Phase.ABORTED
    with pytest.raises(Exception):
        R.commit(state, R.Commit(key("A"), token, 0))
    assert state.default is None


def test_capacity_two_rejects_c_before_begin_and_reclaim_frees(fresh):
    state, _ = publish(fresh, "A")
    state = R.bind_first(state, R.BindFirst(sk("a-user"))).state
    state, _ = publish(state, "B")
    digest, plan = fake_plan("C")
    with pytest.raises(CapacityError):
        R.reserve(state, R.Reserve(key("C"), digest, plan))
    with pytest.raises(NotReclaimable):
        R.claim_reclaim(state, R.ClaimReclaim(key("A")))
    out = R.close_and_release(state, R.CloseAndRelease(sk("a-user")))
    assert ReclaimEligible(key("A")) in out.effects
    out = R.claim_reclaim(out.state, R.ClaimReclaim(key("A")))
    rid = out.reply
    assert sorted(fx.engine for fx in out.effects if isinstance(fx, SendReclaim)) == ["e0", "e1"]
    again = R.claim_reclaim(out.state, R.ClaimReclaim(key("A")))
    assert again.reply == rid and not [fx for fx in again.effects if isinstance(fx, SendReclaim)]
    state = R.record_unloaded(out.state, R.RecordUnloaded(key("A"), rid, "e0")).state
    with pytest.raises(CapacityError):  # E1 has not confirmed: slot still held
        R.reserve(state, R.Reserve(key("C"), digest, plan))
    state = R.record_unloaded(state, R.RecordUnloaded(key("A"), rid, "e0")).state  # duplicate receipt
    state = R.record_unloaded(state, R.RecordUnloaded(key("A"), rid, "e1")).state
    assert state.versions[key("A")].state is VersionState.RECLAIMED
    out = R.reserve(state, R.Reserve(key("C"), digest, plan))
    assert {type(fx) for fx in out.effects} == {SendBegin}
    assert out.state.default == key("B")


def test_bind_close_races(fresh):
    state, _ = publish(fresh, "A")
    # close before open/bind still ends CLOSED and later bind is rejected
    state = R.close_and_release(state, R.CloseAndRelease(sk("early"))).state
    with pytest.raises(SessionClosed):
        R.bind_first(state, R.BindFirst(sk("early")))
    with pytest.raises(SessionClosed):
        R.open_session(state, R.OpenSession(sk("early")))
    # one binding, one ref, repeated close releases once
    state = R.bind_first(state, R.BindFirst(sk("s"))).state
    state = R.bind_first(state, R.BindFirst(sk("s"))).state
    assert state.versions[key("A")].session_refs == 1
    state = R.begin_close(state, R.BeginClose(sk("s"))).state
    with pytest.raises(SessionClosed):
        R.bind_first(state, R.BindFirst(sk("s")))
    with pytest.raises(SessionClosed):
        R.authorize_dispatch(state, R.AuthorizeDispatch(sk("s")))
    state = R.close_and_release(state, R.CloseAndRelease(sk("s"))).state
    state = R.close_and_release(state, R.CloseAndRelease(sk("s"))).state
    assert state.versions[key("A")].session_refs == 0
    # the same session id with a new nonce is a new lifecycle
    assert R.bind_first(state, R.BindFirst(sk("s", "n2"))).reply.version == key("A")


def test_reclaiming_version_refuses_dispatch(fresh):
    state, _ = publish(fresh, "A")
    state = R.bind_first(state, R.BindFirst(sk("s"))).state
    state, _ = publish(state, "B")
    # A forced path: a session record that still points at A while A reclaims
    # cannot exist (refs > 0 blocks the claim), so check the version gate itself.
    state = R.close_and_release(state, R.CloseAndRelease(sk("s"))).state
    state = R.claim_reclaim(state, R.ClaimReclaim(key("A"))).state
    assert not state.versions[key("A")].dispatchable
    with pytest.raises(SessionClosed):
        R.authorize_dispatch(state, R.AuthorizeDispatch(sk("s")))


def test_reclaim_gate_checks_version_state_for_bound_session(fresh):
    state, _ = publish(fresh, "A")
    state = R.bind_first(state, R.BindFirst(sk("s"))).state
    import attrs

    v = state.versions[key("A")]
    hacked = attrs.evolve(state, versions=state.versions.set(key("A"), attrs.evolve(v, state=VersionState.RECLAIMING)))
    with pytest.raises(VersionReclaiming):
        R.authorize_dispatch(hacked, R.AuthorizeDispatch(sk("s")))


def test_core_imports_without_torch_ray_aiohttp_or_sglang():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'torch','ray','aiohttp','sglang','safetensors'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lorapub, lorapub.core, lorapub.core.registry, lorapub.ports, lorapub.errors\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in {'torch','ray','aiohttp','sglang'}]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
