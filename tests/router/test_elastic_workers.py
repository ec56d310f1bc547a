"""An elastic deployment behind the router: a worker that joins the router's list is added to the
deployment (loaded before it is put in rotation); one that leaves is drained and removed."""

from __future__ import annotations

from lorapub.adapters.sglang_router import WorkerJoined, WorkerLeft, WorkerReadmitted
from lorapub.testing.fixtures import lora_snapshot
from tests.router.harness import RecordingDouble, served_by, wait_for


def _request(rid: str, prompt: list[int]) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}, "rid": rid}


async def test_a_worker_joining_the_router_is_added_and_one_leaving_is_removed(fleet, doubles, router):
    dep, watcher = fleet.deployment, fleet.watcher
    watcher.elastic = dep  # the option: the deployment's fleet follows the router's list
    await watcher.start()
    a = await dep.publish(lora_snapshot(1), "A")
    e2 = await RecordingDouble("e2").start()
    watcher.names[e2.url] = "e2"
    try:
        await router.add_worker(e2.url)
        await wait_for(lambda: fleet.events(WorkerReadmitted, "e2"), what="e2 added and put in rotation")
        assert not fleet.events(WorkerJoined, "e2")[-1].initial
        assert "e2" in dep.engines and (await dep.state()).membership("e2").value == "SERVING"
        assert a.lora_name in e2.registered()  # loaded before the router sent it anything
        assert fleet.heal_calls == []  # a new member joins by add_engine, not by the heal
        for i in range(6):  # where each goes is the router's policy; none meets a version error
            reply = await dep.session(f"s{i}").generate(_request(f"r{i}", [i, 5, 6]))
            assert served_by({**doubles, "e2": e2}, reply).name in ("e0", "e1", "e2")

        await router.remove_worker(e2.url)
        await wait_for(lambda: fleet.events(WorkerLeft, "e2"), what="the leave of e2")
        await watcher.settle()
        assert "e2" not in dep.engines and "e2" not in (await dep.state()).engines
        assert a.lora_name not in e2.registered()  # it left clean
    finally:
        await e2.stop()
