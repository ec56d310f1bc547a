"""End-to-end rows of the RFC's state/fault table that span I/O (engine contract double over HTTP)."""

from __future__ import annotations

import asyncio
from unittest.mock import ANY

import pytest

from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.core.attempt import Phase
from lorapub.core.version import VersionState
from lorapub.core.registry import CloseAndRelease, Commit
from lorapub.runtime.deployment import Deployment, deploy
from lorapub.errors import (
    EngineUnavailable,
    CapacityError,
    EngineError,
    NoPublishedVersion,
    OutcomeUnknown,
    SessionClosed,
    VersionMissing,
)
from lorapub.testing.fixtures import lora_snapshot
from lorapub.runtime.overwrite import FIXED_LORA_NAME
from lorapub.runtime.publisher import PublicationFailed
from lorapub.demo.workload import until
from lorapub.runtime.runner import Deadlines
from tests.e2e.conftest import FAST, staged_attempts, stash_folders

GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}}


async def state(dep):
    return await dep.state()


def lora_id_on(double, name):
    return double.lora_registry.get_all_adapters()[name].lora_id


async def test_partial_ready_keeps_default_and_old_sessions_keep_a(deployment, doubles):
    a = await deployment.publish(lora_snapshot(1), "A")
    s_old = deployment.session("old")
    first = await s_old.generate(GEN)
    doubles["e1"].inject("load", "slow", delay=0.3)
    publishing = asyncio.create_task(deployment.publish(lora_snapshot(2), "B"))
    await until(lambda: any(n.startswith("relax_policy_lora@1-B") for n in doubles["e0"].registered()))
    s_mid = deployment.session("mid")
    await s_mid.generate(GEN)
    assert s_mid.binding.version == a.version  # only E0 READY: default unchanged
    b = await publishing
    s_new = deployment.session("new")
    await s_new.generate(GEN)
    assert s_new.binding.version == b.version
    for s in (s_old, s_mid):  # tool turn, retry, resume all stay on A
        for _ in range(3):
            out = await s.generate({**GEN, "input_ids": GEN["input_ids"] + first["output_ids"]})
            engine = doubles[s.engine.name]
            assert out["meta_info"]["lora_id"] == lora_id_on(engine, a.lora_name)


async def test_lost_commit_reply_replays_the_same_commit(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    registry = deployment.registry
    calls = []

    class LossyCommit:
        async def handle(self, command):
            result = await registry.handle(command)  # applied in the registry...
            if isinstance(command, Commit):
                calls.append(result.reply)
                if len(calls) == 1:
                    raise OutcomeUnknown("commit reply lost")  # ...but the reply never arrives
            return result

    deployment.publisher.registry = LossyCommit()
    b = await deployment.publish(lora_snapshot(2), "B")
    assert len(calls) == 2 and calls[0] == calls[1] == b.receipt
    s = await state(deployment)
    assert s.default == b.version and s.default_revision == 2
    for d in doubles.values():
        assert b.lora_name in d.registered()  # B was not cleaned up


async def test_single_engine_failure_cleans_both_and_frees_the_slot(deployment, doubles):
    a = await deployment.publish(lora_snapshot(1), "A")
    doubles["e1"].inject("load", "error")
    with pytest.raises(PublicationFailed):
        await deployment.publish(lora_snapshot(2), "B")
    s = await state(deployment)
    b = next(v for v in s.versions.values() if v.key.version_id == "B")
    assert b.state is VersionState.FAILED_CLEAN and s.default == a.version and s.slots_held == 1
    for d in doubles.values():
        assert d.registered() == [a.lora_name]


async def test_lost_load_reply_is_unknown_then_cleaned(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    doubles["e0"].inject("load", "drop")  # the load happens, its reply never comes
    with pytest.raises(PublicationFailed):
        await deployment.publish(lora_snapshot(2), "B")
    # cleanup unloaded what the dropped reply had loaded
    assert not [n for n in doubles["e0"].registered() if "-B-" in n]


async def test_unanswered_cleanup_keeps_slot_and_blocks_until_confirmed(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    doubles["e1"].inject("load", "error")
    doubles["e0"].inject("unload", "hang")
    with pytest.raises(Exception) as err:
        await deployment.publish(lora_snapshot(2), "B")
    assert err.value.code == "PUBLICATION_BLOCKED"
    s = await state(deployment)
    b = next(v for v in s.versions.values() if v.key.version_id == "B")
    assert b.state is VersionState.ABORTED and s.slots_held == 2
    with pytest.raises(Exception) as blocked:
        await deployment.publish(lora_snapshot(3), "C")
    assert blocked.value.code == "PUBLICATION_BLOCKED"
    assert await deployment.publisher.retry_cleanup(b.attempt) is Phase.CLEAN
    assert (await state(deployment)).slots_held == 1


async def test_late_control_messages_after_cleanup_recreate_nothing(deployment, doubles, engines):
    await deployment.publish(lora_snapshot(1), "A")
    doubles["e1"].inject("load", "error")
    with pytest.raises(PublicationFailed):
        await deployment.publish(lora_snapshot(2), "B")
    s = await state(deployment)
    b = next(v for v in s.versions.values() if v.key.version_id == "B")
    attempt = s.attempts[b.attempt]
    from lorapub.core.effects import SendBegin

    late = SendBegin("e0", s.engines["e0"], attempt.token, attempt.lora_name, attempt.digest, attempt.plan)
    before = list(doubles["e0"].registered())
    for call in (engines["e0"].begin(late), engines["e0"].receive_bucket(attempt.token, 0, b"x"), engines["e0"].end(attempt.token)):
        with pytest.raises(EngineError):
            await call
    assert doubles["e0"].registered() == before
    assert str(attempt.token) not in staged_attempts(doubles["e0"])  # the engine keeps nothing of it
    assert not any(f.startswith(f"1-B-a{attempt.token.seq}") for f in stash_folders(doubles["e0"]))


async def test_bind_close_cancel_races(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    s = deployment.session("racy")
    waiters = [asyncio.create_task(s.bind()) for _ in range(5)]
    await asyncio.sleep(0)
    waiters[0].cancel()  # cancelling one waiter never cancels the shared bind
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert len({r.version for r in results[1:]}) == 1
    st = await state(deployment)
    assert st.versions[results[1].version].session_refs == 1
    await asyncio.gather(s.close(), s.close(), s.close())
    st = await state(deployment)
    assert st.versions[results[1].version].session_refs == 0
    with pytest.raises(SessionClosed):
        await s.generate(GEN)
    # close racing a bind that is still in flight
    s2 = deployment.session("racy2")
    bind = asyncio.create_task(s2.bind())
    await asyncio.sleep(0)
    await s2.close()
    await asyncio.gather(bind, return_exceptions=True)
    st = await state(deployment)
    assert all(v.session_refs == 0 for v in st.versions.values())


async def test_native_refcount_500_and_503_release_exactly_once(deployment, doubles):
    a = await deployment.publish(lora_snapshot(1), "A")
    e0 = doubles["e0"]
    s_long, s_fail = deployment.session("long"), deployment.session("fail")
    s_long.engine = s_fail.engine = deployment.engines["e0"]
    long = asyncio.create_task(s_long.generate({**GEN, "sampling_params": {"max_new_tokens": 150}}))
    await until(lambda: e0.refs(a.lora_name) == 1)
    for status in (500, 503):
        e0.inject("generate", "error", status=status)
        with pytest.raises(EngineError):
            await s_fail.generate(GEN)
        assert e0.refs(a.lora_name) == 1
    await long
    assert e0.refs(a.lora_name) == 0


async def test_session_refs_zero_but_engine_refs_keep_adapter_loaded(deployment, doubles, engines):
    a = await deployment.publish(lora_snapshot(1), "A")
    e0 = doubles["e0"]
    # an admitted request on A whose session is already gone (e.g. its abort is still in flight)
    inflight = asyncio.create_task(engines["e0"].generate({**GEN, "lora_path": a.lora_name, "sampling_params": {"max_new_tokens": 200}}))
    await until(lambda: e0.refs(a.lora_name) == 1)
    await deployment.publish(lora_snapshot(2), "B")  # A retired with 0 session refs: reclaim starts
    await until(lambda: a.lora_name in e0.pending_unloads)
    await asyncio.sleep(0.05)
    st = await state(deployment)
    assert st.versions[a.version].state is VersionState.RECLAIMING
    ref = next(r for r in e0.ref_cache.values() if r.lora_name == a.lora_name)
    assert ref.lora_id in e0.loaded  # still physically loaded while the request runs
    out = await inflight
    assert out["meta_info"]["lora_id"] == ref.lora_id
    await deployment.settle()
    assert (await state(deployment)).versions[a.version].state is VersionState.RECLAIMED
    assert e0.physical_unloads.count(a.lora_name) == 1


async def test_capacity_rejects_c_before_any_begin(deployment, doubles, engines):
    a = await deployment.publish(lora_snapshot(1), "A")
    s = deployment.session("holds-a")
    await s.generate(GEN)
    await deployment.publish(lora_snapshot(2), "B")
    events = {n: list(d.events) for n, d in doubles.items()}
    with pytest.raises(CapacityError):
        await deployment.publish(lora_snapshot(3), "C")
    assert {n: d.events for n, d in doubles.items()} == events
    assert not any("-C-" in p for p in stash_folders(doubles["e0"]))
    await s.close()
    await deployment.settle()
    assert (await state(deployment)).versions[a.version].state is VersionState.RECLAIMED
    c = await deployment.publish(lora_snapshot(3), "C")
    assert c.state is VersionState.PUBLISHED


async def test_missing_exact_version_errors_without_fallback(deployment, doubles):
    with pytest.raises(NoPublishedVersion):
        await deployment.session("early").generate(GEN)
    await deployment.publish(lora_snapshot(1), "A")
    s = deployment.session("s")
    s.engine = deployment.engines["e0"]
    await s.generate(GEN)
    await deployment.reconciler.stop()  # hold re-provisioning back to see the gap it closes
    doubles["e0"].restart()  # the engine lost every adapter; e1 still holds A
    e1_before = doubles["e1"].generations
    await s.generate(GEN)  # refused by e0 before running, then sent once to the holder
    assert s.engine.name == "e1" and doubles["e1"].generations == e1_before + 1
    assert "<base>" not in doubles["e0"].prefix_cache  # nothing ran on base (or on another version)
    doubles["e1"].restart()  # now no engine holds A: a typed error, never base or latest
    with pytest.raises(EngineUnavailable):
        await s.generate(GEN)
    assert all("<base>" not in d.prefix_cache for d in doubles.values())
    # the reconciler loads A again on both engines from lorapub's frozen copy; the session goes on
    health = await deployment.reconcile()
    assert health.healthy, health.describe()
    assert all(s.binding.lora_name in d.registered() for d in doubles.values())
    await s.generate(GEN)


async def test_managed_adapters_survive_ordinary_unload_and_lru(deployment, doubles, engines, tmp_path):
    a = await deployment.publish(lora_snapshot(1), "A")
    e0 = engines["e0"]
    with pytest.raises(EngineError):
        await e0.client.admin("/unload_lora_adapter", {"lora_name": a.lora_name})
    # fill the free slot with third-party adapters: LRU evicts only the unpinned one
    for i in range(3):
        path = lora_snapshot(50 + i).save_peft_dir(str(tmp_path / f"third{i}"))
        await e0.client.admin("/load_lora_adapter", {"lora_name": f"third{i}", "lora_path": path})
    assert a.lora_name in doubles["e0"].registered()


async def test_unpatched_engine_would_implicitly_reload_so_lorapub_refuses_first(engines, doubles, transport):
    doubles["e0"].managed_patch = doubles["e1"].managed_patch = False
    with pytest.raises(EngineError, match="managed-adapter patch"):
        await Deployment(engines, epoch=1, transport=transport).start()
    for e in engines.values():
        e.require_patch = False  # knowingly run unpatched to show the hazard
    dep = await Deployment(engines, epoch=1, deadlines=FAST, transport=transport).start()
    a = await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    await s.close()
    await dep.settle()
    assert (await dep.state()).versions[a.version].state is VersionState.RECLAIMED
    with pytest.raises(SessionClosed):  # lorapub refuses before anything reaches the engine
        await s.generate(GEN)
    # the hazard lorapub guards against: a raw late request makes unpatched SGLang reload A from its
    # folder; the engine's staging removes a reclaimed version's folder, so even that is refused
    assert not any(f.startswith("1-A-") for f in stash_folders(doubles["e0"]))
    with pytest.raises(VersionMissing, match="Failed to implicitly load"):
        await engines["e0"].generate({**GEN, "lora_path": a.lora_name})
    assert ("implicit_reload", a.lora_name) not in doubles["e0"].events


async def test_switch_off_keeps_the_old_overwrite_path(engines, doubles, tmp_path):
    overwrite = {name: SGLangOverwriteAdmin(name, d.url) for name, d in doubles.items()}
    dep = await deploy(overwrite, epoch=1, enabled=False, stash_dir=str(tmp_path))
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    out1 = await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    out2 = await s.generate(GEN)
    for d in doubles.values():
        kinds = [k for k, _ in d.events]
        assert kinds.count("pause") == 2 and kinds.count("flush") == 2
        assert d.registered() == [FIXED_LORA_NAME]
    assert out1["meta_info"]["lora_id"] != out2["meta_info"]["lora_id"]  # one name, two policies
    for e in overwrite.values():
        await e.close()


async def test_lorapub_publication_never_pauses_or_flushes(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    sessions = [deployment.session(f"s{i}") for i in range(6)]
    await asyncio.gather(*(s.generate(GEN) for s in sessions))
    work = [asyncio.create_task(s.generate({**GEN, "sampling_params": {"max_new_tokens": 40}})) for s in sessions]
    await deployment.publish(lora_snapshot(2), "B")
    results = await asyncio.gather(*work, return_exceptions=True)
    assert not [r for r in results if isinstance(r, BaseException)]
    for d in doubles.values():
        assert not [k for k, _ in d.events if k in ("pause", "flush")]


async def test_reserve_replay_with_same_content_is_idempotent(deployment, doubles):
    first = await deployment.publish(lora_snapshot(1), "A")
    loads = [len(d.events) for d in doubles.values()]
    again = await deployment.publish(lora_snapshot(1), "A")
    assert again.reused and again.receipt == first.receipt
    assert [len(d.events) for d in doubles.values()] == loads
    from lorapub.errors import VersionConflict

    with pytest.raises(VersionConflict):
        await deployment.publish(lora_snapshot(9), "A")


async def test_close_that_failed_can_be_retried_and_releases_once(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    s = deployment.session("flaky-close")
    await s.generate(GEN)
    registry = deployment.sessions.registry
    real = registry.handle
    calls = {"n": 0}

    async def unreachable_once(command):
        if isinstance(command, CloseAndRelease):
            calls["n"] += 1
            if calls["n"] == 1:
                raise OutcomeUnknown("registry unreachable")
        return await real(command)

    registry.handle = unreachable_once
    with pytest.raises(OutcomeUnknown):
        await s.close()
    with pytest.raises(SessionClosed):  # still FINALIZING: no new dispatch
        await s.generate(GEN)
    await s.close()
    await s.close()
    st = await state(deployment)
    assert all(v.session_refs == 0 for v in st.versions.values())
    assert st.sessions[s.key].state.value == "CLOSED"


async def test_engine_restart_between_and_during_publications(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    doubles["e1"].restart()  # between publications: the registry learns the new life first
    b = await deployment.publish(lora_snapshot(2), "B")
    assert (await state(deployment)).engines["e1"] == doubles["e1"].incarnation
    assert b.lora_name in doubles["e1"].registered()
    # during a publication: E1 dies after begin; its old-life READY can never commit C
    await deployment.publish(lora_snapshot(3), "C")
    await deployment.settle()  # unbound B is reclaimed: a slot is free for D
    doubles["e0"].inject("load", "slow", delay=0.3)
    d_pub = asyncio.create_task(deployment.publish(lora_snapshot(4), "D"))
    await asyncio.sleep(0.05)
    doubles["e0"].restart()
    with pytest.raises(Exception) as err:
        await d_pub
    assert err.value.code in {"PUBLICATION_FAILED", "PUBLICATION_BLOCKED"}
    await deployment.refresh_engines()
    st = await state(deployment)
    d = next(v for v in st.versions.values() if v.key.version_id == "D")
    assert d.state is VersionState.FAILED_CLEAN and st.default.version_id == "C"
    assert not [n for n in doubles["e0"].registered() if "-D-" in n]


async def test_source_failure_mid_transfer_aborts_and_cleans(engines, doubles, transport):
    from lorapub.snapshot import InlineBucketSource

    class FlakySource(InlineBucketSource):
        async def send(self, token, index, engines_):
            if index == 1:
                raise EngineError("trainer rank lost during bucket 1")
            await super().send(token, index, engines_)

    dep = await Deployment(engines, epoch=1, deadlines=FAST, bucket_cap_bytes=4 << 10, transport=transport).start()
    dep.publisher.source_factory = FlakySource
    with pytest.raises(PublicationFailed, match="bucket 1"):
        await dep.publish(lora_snapshot(1), "A")
    st = await dep.state()
    assert st.slots_held == 0 and st.default is None
    for d in doubles.values():
        assert staged_attempts(d) == {} and stash_folders(d) == []


async def test_duplicate_receive_stores_once_and_answers_the_same(deployment, engines, doubles):
    snapshot = lora_snapshot(5)
    plan = snapshot.plan(4 << 10)
    from lorapub.core.effects import SendBegin
    from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for

    key = VersionKey(1, "dup")
    token = AttemptToken(key, 99)
    e0 = engines["e0"]
    name = lora_name_for(key, snapshot.digest)
    inc = await e0.begin(SendBegin("e0", await e0.incarnation(), token, name, snapshot.digest, plan))
    payload = snapshot.bucket_bytes(plan, 0)
    assert await e0.receive_bucket(token, 0, payload) == inc
    staged = staged_attempts(doubles["e0"])[str(token)]
    assert await e0.receive_bucket(token, 0, b"garbage that must not overwrite") == inc
    assert staged_attempts(doubles["e0"])[str(token)] == {**staged, "idle_s": ANY}  # nothing stored twice
    for i in range(1, len(plan.buckets)):
        await e0.receive_bucket(token, i, snapshot.bucket_bytes(plan, i))
    ready = await e0.end(token)  # every tensor's SHA-256 checked: the first bucket's bytes were kept
    assert ready.digest == snapshot.digest and name in doubles["e0"].registered()


async def test_unanswered_unload_is_retried_until_both_engines_confirm(engines, doubles, transport):
    quick = Deadlines(begin=2, bucket=2, end=2, cleanup=2, commit=1, reclaim=0.3)
    dep = await Deployment(engines, epoch=1, deadlines=quick, transport=transport, reclaim_backoff=0.05).start()
    a = await dep.publish(lora_snapshot(1), "A")
    doubles["e0"].inject("unload", "hang")  # the first unload of A on E0 never answers
    await dep.publish(lora_snapshot(2), "B")  # A retires with no session: reclaim starts at once
    await dep.settle()
    st = await dep.state()
    assert st.versions[a.version].state is VersionState.RECLAIMED
    assert doubles["e0"].physical_unloads.count(a.lora_name) == 1
    assert doubles["e1"].physical_unloads.count(a.lora_name) == 1


async def test_one_switch_each_side_one_type(engines, doubles, transport, tmp_path):
    from lorapub import OverwriteDeployment, PublicationReport

    on = await deploy(engines, epoch=1, enabled=True, deadlines=FAST, transport=transport, stash_dir=str(tmp_path))
    assert type(on) is Deployment
    assert isinstance(await on.publish(lora_snapshot(1), "A"), PublicationReport)
    overwrite = {name: SGLangOverwriteAdmin(name, d.url) for name, d in doubles.items()}
    off = await deploy(overwrite, epoch=1, enabled=False, stash_dir=str(tmp_path))
    assert type(off) is OverwriteDeployment
    assert isinstance(await off.publish(lora_snapshot(2), "B"), float)  # seconds paused
    await on.settle()
    for e in overwrite.values():
        await e.close()
