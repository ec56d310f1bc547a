"""Worker list changes behind the router: noticed, and a worker re-enters rotation only healed."""

from __future__ import annotations

from lorapub.adapters.sglang_router import (
    HealFailed,
    WorkerHealed,
    WorkerJoined,
    WorkerLeft,
    WorkerQuarantined,
    WorkerReadmitted,
    WorkerRestarted,
    WorkerUnreachable,
)
from lorapub.core.version import VersionState
from lorapub.errors import VersionMissing
from lorapub.testing.fixtures import lora_snapshot
from tests.router.harness import served_by, wait_for


def _request(rid: str, prompt: list[int]) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}, "rid": rid}


async def test_first_listing_builds_one_engine_per_worker_without_a_handshake(fleet, doubles):
    joined = fleet.events(WorkerJoined)
    assert {(e.name, e.initial) for e in joined} == {("e0", True), ("e1", True)}
    assert {e.incarnation for e in joined} == {d.incarnation for d in doubles.values()}
    assert fleet.heal_calls == [] and sorted(fleet.watcher.in_rotation()) == ["e0", "e1"]
    assert {n: e.base_url for n, e in fleet.deployment.engines.items()} == {n: d.url for n, d in doubles.items()}


async def test_removed_and_added_through_the_router_api_is_noticed(fleet, doubles):
    watcher, router = fleet.watcher, fleet.router
    await watcher.start()
    a = await fleet.deployment.publish(lora_snapshot(1), "A")
    e1 = doubles["e1"]

    await router.remove_worker(e1.url)
    await wait_for(lambda: fleet.events(WorkerLeft, "e1"), what="the leave of e1")
    assert watcher.status()["e1"].state == "left"
    s = fleet.deployment.session("s")
    for i in range(6):
        reply = await s.generate(_request(f"left-{i}", [i, 1, 2]))
        assert served_by(doubles, reply).name == "e0"

    await router.add_worker(e1.url)  # someone else put it (back) into rotation
    await wait_for(lambda: fleet.events(WorkerReadmitted, "e1"), what="e1 healed and readmitted")
    joined = fleet.events(WorkerJoined, "e1")[-1]
    assert not joined.initial and joined.incarnation == e1.incarnation
    assert [type(e).__name__ for e in watcher.events if e.name == "e1"][-4:] == [
        "WorkerJoined", "WorkerQuarantined", "WorkerHealed", "WorkerReadmitted"]
    assert fleet.heal_calls == ["e1"]
    assert e1.url in await router.workers() and watcher.status()["e1"].state == "serving"
    assert a.lora_name in e1.registered()


async def test_a_restarted_worker_is_taken_out_healed_and_put_back(fleet, doubles):
    d, watcher, router = fleet.deployment, fleet.watcher, fleet.router
    e0, e1 = doubles["e0"], doubles["e1"]
    a = await d.publish(lora_snapshot(1), "A")
    s = d.session("bound")
    await s.generate(_request("bound-0", [9, 9, 9]))
    assert s.binding.lora_name == a.lora_name
    await watcher.start()

    fleet.heal_gate.clear()  # hold the heal: the worker must stay out meanwhile
    old = e1.incarnation
    e1.restart()  # a crash: nothing loaded, new incarnation
    await wait_for(fleet.heal_started.is_set, what="heal to be called")
    restarted = fleet.events(WorkerRestarted, "e1")
    assert [(r.old_incarnation, r.new_incarnation) for r in restarted] == [(old, e1.incarnation)]
    assert fleet.events(WorkerQuarantined, "e1")[-1].reason == "restarted"
    assert fleet.heal_calls == ["e1"]
    assert await router.workers() == [e0.url], "a restarted worker stayed in rotation before its heal"
    assert watcher.status()["e1"].state == "quarantined"

    before = list(e1.rids())  # session traffic (re-provisioning probes carry no rid)
    for i in range(8):  # during the heal, the bound session and new ones go to the other worker
        reply = await s.generate(_request(f"during-{i}", [9, 9, 9, i]))
        assert served_by(doubles, reply).name == "e0"
        fresh = d.session(f"fresh-{i}")
        reply = await fresh.generate(_request(f"fresh-{i}", [i, 5]))
        assert served_by(doubles, reply).name == "e0"
        await fresh.close()
    assert e1.rids() == before, "a session request reached the worker under heal"

    fleet.heal_gate.set()
    await wait_for(lambda: fleet.events(WorkerReadmitted, "e1"), what="e1 readmitted")
    healed = fleet.events(WorkerHealed, "e1")[-1]
    assert healed.incarnation == e1.incarnation
    assert sorted(await router.workers()) == sorted([e0.url, e1.url])
    ref = e1.lora_registry.get_all_adapters()[a.lora_name]
    assert ref.pinned, "the re-provisioned version must be pinned"
    assert (await d.state()).engines["e1"] == e1.incarnation
    assert "e1" in d.health.fleet.holders[a.version]  # re-provisioned through the registry, not behind it

    # Back in rotation and serving the bound version exactly. The router's policy decides
    # who gets what, so take e0 out for a moment; bring it back the safe way (heal, then add).
    await router.remove_worker(e0.url)
    await wait_for(lambda: fleet.events(WorkerLeft, "e0"), what="the leave of e0")
    for i in range(4):
        reply = await s.generate(_request(f"after-{i}", [i, 3, 1, 4]))
        chosen = served_by(doubles, reply)
        assert chosen.name == "e1" and reply["meta_info"]["lora_id"] == chosen.lora_id(a.lora_name)
    await watcher.admit(e0.url)
    assert fleet.heal_calls == ["e1", "e0"] and fleet.events(WorkerReadmitted, "e0")
    assert sorted(await router.workers()) == sorted([e0.url, e1.url])

    b = await d.publish(lora_snapshot(2), "B")
    await s.close()
    await d.settle()
    assert (await d.state()).versions[a.version].state is VersionState.RECLAIMED
    assert e1.physical_unloads.count(a.lora_name) == 1 and b.lora_name in e1.registered()


async def test_a_failed_heal_keeps_the_worker_out_and_is_retried_with_backoff(fleet, doubles):
    watcher, router = fleet.watcher, fleet.router
    e0, e1 = doubles["e0"], doubles["e1"]
    await fleet.deployment.publish(lora_snapshot(1), "A")
    await watcher.start()
    fleet.heal_failures = 2
    e1.restart()
    await wait_for(lambda: len(fleet.events(HealFailed, "e1")) == 2, what="two failed heals")
    assert await router.workers() == [e0.url]
    failed = fleet.events(HealFailed, "e1")
    assert [f.attempt for f in failed] == [1, 2] and failed[0].retry_in < failed[1].retry_in
    assert "re-provisioning failed" in failed[0].error
    status = watcher.status()["e1"]
    assert status.state == "quarantined" and status.heal_attempts >= 2

    await wait_for(lambda: fleet.events(WorkerReadmitted, "e1"), what="e1 readmitted on the third try")
    assert fleet.heal_calls == ["e1", "e1", "e1"]
    assert sorted(await router.workers()) == sorted([e0.url, e1.url])
    assert watcher.status()["e1"].last_error is None


async def test_an_unreachable_worker_is_taken_out_of_the_router(fleet, doubles):
    watcher, router = fleet.watcher, fleet.router
    e0, e1 = doubles["e0"], doubles["e1"]
    await fleet.deployment.publish(lora_snapshot(1), "A")
    await watcher.start()
    await e1.stop()
    await wait_for(lambda: fleet.events(WorkerUnreachable, "e1"), what="e1 unreachable")
    await wait_for(lambda: fleet.events(HealFailed, "e1"), what="a handshake that cannot reach e1")
    assert await router.workers() == [e0.url]
    assert fleet.heal_calls == []  # never healed while it does not answer
    s = fleet.deployment.session("s")
    for i in range(6):  # no request fails: the router only knows the healthy worker
        reply = await s.generate(_request(f"r{i}", [i, 2]))
        assert served_by(doubles, reply).name == "e0"


async def test_before_the_watcher_notices_a_restart_requests_fail_with_a_version_error_never_a_fallback(
    fleet, doubles
):
    """The window between a restart and the next poll: the router may still pick the worker.
    It answers with a version error for the exact lora_path; nothing runs on base or another version."""
    d, router = fleet.deployment, fleet.router
    e0, e1 = doubles["e0"], doubles["e1"]
    a = await d.publish(lora_snapshot(1), "A")
    s = d.session("s")
    await s.generate(_request("s-0", [1, 2, 3]))
    await router.remove_worker(e0.url)  # the router can only pick e1 now (the watcher is not polling)
    e1.restart()
    try:
        reply = await s.generate(_request("s-1", [1, 2, 3, 4]))
    except VersionMissing as e:
        assert "never been loaded" in str(e) or "not loaded" in str(e)
    else:  # the deployment re-provisioned e1 before the session's one resend: the exact version ran
        assert served_by(doubles, reply) is e1 and reply["meta_info"]["lora_id"] == e1.lora_id(a.lora_name)
    sent = [b for b in e1.received if b.get("rid") == "s-1"]
    assert 1 <= len(sent) <= 2 and all(b["lora_path"] == a.lora_name for b in sent)
    assert not [b for dbl in doubles.values() for b in dbl.received if b.get("lora_path") != a.lora_name]


def test_a_shared_folder_is_the_deployments_transport_and_the_workers_engines_take_it(tmp_path):
    from lorapub.adapters.sglang_router import SGLangRouter, WorkerWatcher
    from lorapub.adapters.sglang_wire import SGLangWireEngine, SharedDir
    from lorapub.runtime.deployment import Deployment

    watcher = WorkerWatcher(SGLangRouter("http://127.0.0.1:9"))
    engine = watcher.engine("http://127.0.0.1:30001")
    assert type(engine) is SGLangWireEngine and engine is watcher.engine("http://127.0.0.1:30001")
    shared = SharedDir(tmp_path)  # every worker reads this folder as its LORAPUB_SHM_DIR
    Deployment({engine.name: engine}, epoch=1, transport=shared)
    assert watcher.engine("http://127.0.0.1:30001").transport is shared
