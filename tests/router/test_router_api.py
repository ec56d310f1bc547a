"""The router's worker API and /generate as lorapub's client sees them (sglang-router 0.3.2)."""

from __future__ import annotations

import asyncio

import pytest

from lorapub.adapters.sglang_router import RouterRouting, SGLangRouter, engine_name
from lorapub.errors import EngineError, EngineUnavailable, OutcomeUnknown, VersionMissing


async def test_lists_removes_and_adds_workers_by_url(router, doubles, router_process):
    urls = {d.url for d in doubles.values()}
    assert set(await router.workers()) == urls
    assert router_process.startup_s < 30

    e1 = doubles["e1"]
    await router.remove_worker(e1.url)
    assert set(await router.workers()) == urls - {e1.url}
    await router.remove_worker(e1.url)  # idempotent

    before = e1.generate_requests
    for i in range(6):
        await router.generate({"input_ids": [i, 7, 7], "sampling_params": {"max_new_tokens": 1}})
    assert e1.generate_requests == before, "a removed worker still got traffic"

    await router.add_worker(e1.url)
    await router.add_worker(e1.url)  # idempotent
    workers = await router.list_workers()
    assert {w.url for w in workers} == urls and all(w.healthy for w in workers)


async def test_lora_path_reaches_the_worker_unchanged_in_a_reserialised_body(router, doubles):
    name = "relax_policy_lora@1-A-0123456789ab"
    with pytest.raises(VersionMissing) as err:
        await router.generate({"input_ids": [5, 6, 7], "lora_path": name, "rid": "probe-1",
                               "sampling_params": {"max_new_tokens": 2}, "not_a_generate_field": 1})
    assert "never been loaded" in str(err.value)  # the worker's own text, through the router
    received = [b for d in doubles.values() for b in d.received if b.get("rid") == "probe-1"]
    assert len(received) == 1
    body = received[0]
    assert body["lora_path"] == name
    assert "not_a_generate_field" not in body and "log_metrics" in body  # the router rebuilt the body


async def test_an_error_answer_is_never_resent_and_keeps_the_engines_text(router, doubles):
    for d in doubles.values():
        d.inject("generate", "error", count=5, status=503)
    before = sum(d.generate_requests for d in doubles.values())
    with pytest.raises(EngineError) as err:
        await router.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert err.value.details["status"] == 503 and "injected" in str(err.value)
    assert sum(d.generate_requests for d in doubles.values()) == before + 1, "the router resent a generation"


async def test_no_answer_is_outcome_unknown_and_sent_once(router_process, doubles):
    slow = SGLangRouter(router_process.url, request_timeout=0.3)
    try:
        for d in doubles.values():
            d.inject("generate", "slow", delay=1.0)
        before = sum(d.generate_requests for d in doubles.values())
        with pytest.raises(OutcomeUnknown):
            await slow.generate({"input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
        await asyncio.sleep(1.2)
        assert sum(d.generate_requests for d in doubles.values()) == before + 1
    finally:
        await slow.close()


async def test_a_worker_that_gives_no_answer_is_outcome_unknown(router, doubles):
    e0, e1 = doubles["e0"], doubles["e1"]
    await router.remove_worker(e0.url)
    await e1.stop()  # still listed by the router: it has not health-checked it yet
    with pytest.raises(OutcomeUnknown) as err:
        await router.generate({"input_ids": [4], "sampling_params": {"max_new_tokens": 1}})
    assert err.value.details["code"] == "call_upstream_request_error" and e1.url in str(err.value)


async def test_no_worker_left_is_engine_unavailable(router, doubles):
    for d in doubles.values():
        await router.remove_worker(d.url)
    assert await router.workers() == []
    with pytest.raises(EngineUnavailable):
        await router.generate({"input_ids": [4], "sampling_params": {"max_new_tokens": 1}, "lora_path": "x"})


def test_engine_names_are_stable_and_path_safe():
    assert engine_name("http://10.0.0.7:30001/") == "10.0.0.7-30001"
    assert engine_name("http://[::1]:8000") == "--1-8000"
    assert engine_name("http://worker-3.svc:30000") == "worker-3.svc-30000"


async def test_routing_sends_nothing_when_no_engine_holds_the_version(router, doubles):
    routing = RouterRouting(router)

    class _Session:
        binding = None
        key = "s"

    assert routing.pick(_Session()) is routing.pick(_Session(), frozenset({"e0"}))
    with pytest.raises(EngineUnavailable):
        routing.pick(_Session(), frozenset())
    target = routing.pick(_Session())
    with pytest.raises(Exception) as err:
        await target.generate({"input_ids": [1]})  # lorapub never sends without the bound lora_path
    assert err.value.code == "INVALID_INPUT"
    assert sum(d.generate_requests for d in doubles.values()) == 0
