"""Engine-side staging under races the publisher cannot order: a cleanup that arrives while the
attempt's ``end`` is loading, and attempts that begin while others still receive under a byte budget.

* a cleanup during ``end`` tombstones the attempt at once (nothing of it starts after), waits for the
  load that runs, and answers truthfully what it loaded: the publisher unloads it, so no adapter is
  left loaded and pinned that nobody was told of (an orphan until the reconciler's sweep);
* ``max_stash_bytes`` bounds what staged attempts may hold once every begun attempt received all of
  its plan: a begin is checked against the bytes held *and* those the attempts still receiving
  will hold.
"""

from __future__ import annotations

import asyncio

import pytest

from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.wire.codec import plan_to_json, token_to_json

pytest.importorskip("torch")

from tests.wire.test_staging_landing import LIFE, Hooks, chunks_of, params, raw, snapshot  # noqa: E402


def begin_body(snap, version: str, load: str = "dir"):
    key = VersionKey(1, version)
    token = AttemptToken(key, 1)
    plan = snap.plan(1024)
    body = {"token": token_to_json(token), "incarnation": LIFE, "lora_name": lora_name_for(key, snap.digest),
            "digest": snap.digest, "plan": plan_to_json(plan), "transport": {"kind": "http"}, "load": load}
    return token, plan, body


async def stage_all(staging, snap, token, plan):
    for bucket in plan.buckets:
        blob = raw(snap, bucket)
        status, answer = await staging.receive(params(token, bucket.index), chunks_of(blob), len(blob))
        assert status == 200, answer


class GatedLoad(Hooks):
    """Loads wait for ``gate``: a test holds the engine inside ``end``'s load."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.loading = asyncio.Event()

    async def load_dir(self, lora_name, path):
        self.loading.set()
        await self.gate.wait()
        return await super().load_dir(lora_name, path)

    async def load_tensors(self, lora_name, tensors, config, checksums):
        self.loading.set()
        await self.gate.wait()
        return await super().load_tensors(lora_name, tensors, config, checksums)


def new_staging(hooks, tmp_path, **kwargs):
    from lorapub.sglang_patch import staging as es

    return es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"), **kwargs)


@pytest.mark.parametrize("load", ["dir", "tensors"])
async def test_a_cleanup_during_end_waits_for_the_load_and_reports_the_adapter_it_loaded(tmp_path, load):
    hooks = GatedLoad()
    staging = new_staging(hooks, tmp_path)
    snap = snapshot(11)
    token, plan, body = begin_body(snap, "A", load)
    assert (await staging.begin(body))[0] == 200
    await stage_all(staging, snap, token, plan)
    ending = asyncio.ensure_future(staging.end({"token": body["token"], "incarnation": LIFE}))
    await hooks.loading.wait()  # end's load runs
    cleaning = asyncio.ensure_future(staging.cleanup({"token": body["token"]}))
    await asyncio.sleep(0.05)
    assert not cleaning.done()  # it waits for the load
    # tombstoned at once: nothing of the attempt starts any more
    blob = raw(snap, plan.buckets[0])
    status, answer = await staging.receive(params(token, 0), chunks_of(blob), len(blob))
    assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE", answer
    hooks.gate.set()
    status, ended = await ending
    assert status == 409 and ended["error"]["code"] == "STAGE_TOMBSTONE", ended  # its publisher gave it up
    status, cleaned = await cleaning
    assert status == 200, cleaned
    name = body["lora_name"]
    assert name in hooks.adapters()  # the load happened: the adapter is registered, pinned ...
    loaded = cleaned["loaded"]  # ... and the cleanup says so, so the publisher unloads it
    assert loaded is not None and loaded["lora_name"] == name and loaded["lora_id"] == hooks.adapters()[name]["lora_id"]
    assert loaded["digest"] == snap.digest and loaded["incarnation"] == LIFE
    assert staging.report()["attempts"] == {} and staging.report()["bytes"] == 0
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE"
    staging.close()


async def test_a_cleanup_during_an_end_whose_load_fails_answers_nothing_loaded(tmp_path):
    class FailingLoad(GatedLoad):
        async def load_dir(self, lora_name, path):
            self.loading.set()
            await self.gate.wait()
            return "out of LoRA memory"

    hooks = FailingLoad()
    staging = new_staging(hooks, tmp_path)
    snap = snapshot(12)
    token, plan, body = begin_body(snap, "A")
    assert (await staging.begin(body))[0] == 200
    await stage_all(staging, snap, token, plan)
    ending = asyncio.ensure_future(staging.end({"token": body["token"], "incarnation": LIFE}))
    await hooks.loading.wait()
    cleaning = asyncio.ensure_future(staging.cleanup({"token": body["token"]}))
    await asyncio.sleep(0.05)
    hooks.gate.set()
    status, ended = await ending
    assert status == 409 and ended["error"]["code"] == "STAGE_LOAD", ended
    assert await cleaning == (200, {"incarnation": LIFE, "loaded": None})
    assert hooks.adapters() == {} and staging.report()["attempts"] == {}
    staging.close()


async def test_the_byte_budget_counts_what_attempts_still_receiving_will_hold(tmp_path):
    a, b = snapshot(13), snapshot(14)
    ta, plan_a, body_a = begin_body(a, "A")
    tb, plan_b, body_b = begin_body(b, "B")
    total_a, total_b = (sum(x.nbytes for x in p.buckets) for p in (plan_a, plan_b))
    budget = total_a + total_b - 1  # room for one attempt's plan, not for both
    staging = new_staging(Hooks(), tmp_path, max_stash_bytes=budget)
    assert (await staging.begin(body_a))[0] == 200  # A holds nothing yet, but it will hold total_a
    status, answer = await staging.begin(body_b)
    assert status == 409 and answer["error"]["code"] == "STAGE_CAPACITY", answer
    await stage_all(staging, a, ta, plan_a)
    assert staging.report()["bytes"] == total_a <= budget
    assert (await staging.end({"token": body_a["token"], "incarnation": LIFE}))[0] == 200
    assert (await staging.begin(body_b))[0] == 200  # A's bytes were freed by its load
    await stage_all(staging, b, tb, plan_b)
    assert staging.report()["bytes"] == total_b <= budget
    staging.close()


async def test_a_release_that_waits_for_an_end_loading_the_name_again_keeps_that_attempt(tmp_path):
    """A release frees what the attempts of an unloaded name keep; an end of that name that loads it
    while the release waits keeps its attempt, so a later cleanup still answers what it loaded."""
    hooks = GatedLoad()
    staging = new_staging(hooks, tmp_path)
    snap = snapshot(15)
    token, plan, body = begin_body(snap, "A")
    assert (await staging.begin(body))[0] == 200
    await stage_all(staging, snap, token, plan)
    ending = asyncio.ensure_future(staging.end({"token": body["token"], "incarnation": LIFE}))
    await hooks.loading.wait()
    releasing = asyncio.ensure_future(staging.release({"lora_name": body["lora_name"]}))  # not loaded yet
    await asyncio.sleep(0.05)
    hooks.gate.set()
    status, receipt = await ending
    assert status == 200, receipt
    assert await releasing == (200, {"incarnation": LIFE, "freed": []})
    assert staging.report()["attempts"][str(token)]["phase"] == "loaded"
    status, cleaned = await staging.cleanup({"token": body["token"]})
    assert status == 200 and cleaned["loaded"]["lora_id"] == receipt["lora_id"]
    staging.close()
