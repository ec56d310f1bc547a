"""More generations in flight than aiohttp's default connection pool (100) holds.

A rollout keeps hundreds of generations open on one engine. Admin calls share the engine
adapter's HTTP client with them, so a capped pool queues an admin call behind generations.
For the old path that became a deadlock on live SGLang: it paused generation, the agentic
layer resent the aborted requests, they waited out the pause holding every connection, and
the flush that would end the pause never got one. On the double the capped pool shows as the
pause arriving only once earlier generations ended (so few were aborted); these tests fail
on it either way.
"""

from __future__ import annotations

import asyncio

import pytest

from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.runtime.deployment import Deployment, deploy
from lorapub.testing import SGLangDouble, lora_snapshot
from tests.e2e.conftest import FAST
from tests.helpers.waiting import until

IN_FLIGHT = 250  # over twice aiohttp's default limit of 100 connections per session
LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 80}}  # 80 steps of 25 ms: ~2 s


@pytest.fixture
async def slow_double():
    d = await SGLangDouble("e0", decode_delay=0.025).start()
    yield d
    await d.stop()


async def test_the_old_path_publishes_while_more_sessions_wait_out_its_pause_than_the_pool_holds(tmp_path):
    double = await SGLangDouble("e0", decode_delay=0.025, stock=True).start()
    admin = SGLangOverwriteAdmin("e0", double.url)
    dep = await deploy({"e0": admin}, epoch=1, enabled=False, stash_dir=str(tmp_path))
    try:
        await dep.publish(lora_snapshot(1), "A")
        sessions = [dep.session(f"s{i}") for i in range(IN_FLIGHT)]
        sent = double.generate_requests
        turns = [asyncio.create_task(s.generate(dict(LONG))) for s in sessions]
        await until(lambda: double.generate_requests >= sent + IN_FLIGHT, what="every turn sent")  # and decoding
        await asyncio.wait_for(dep.publish(lora_snapshot(2), "B"), 10)  # aborts, resends, flush, overwrite
        # the pause reached the engine while the turns ran (it waited for no connection), so it
        # aborted more of them than the pool holds; their resends waited out the pause
        assert sum(s.resumed for s in sessions) > 100
        outs = await asyncio.wait_for(asyncio.gather(*turns), 30)
        assert all(o["output_ids"] for o in outs) and not double.is_paused
    finally:
        await dep.close()
        await admin.close()
        await double.stop()


async def test_lorapub_publishes_while_more_generations_are_in_flight_than_the_pool_holds(slow_double):
    engines = {"e0": SGLangWireEngine("e0", slow_double.url)}
    dep = await Deployment(engines, epoch=1, deadlines=FAST).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        sessions = [dep.session(f"s{i}") for i in range(IN_FLIGHT)]
        sent = slow_double.generate_requests
        turns = [asyncio.create_task(s.generate(dict(LONG))) for s in sessions]
        await until(lambda: slow_double.generate_requests >= sent + IN_FLIGHT, what="every turn sent")  # and decoding
        await asyncio.wait_for(engines["e0"].incarnation(), 5)
        assert not any(t.done() for t in turns), "an admin call waited for a generation to end"
        await asyncio.wait_for(dep.publish(lora_snapshot(2), "B"), 5)
        assert not any(t.done() for t in turns), "the publication waited for a generation to end"
        outs = await asyncio.gather(*turns)
        assert all(len(o["output_ids"]) == 80 for o in outs)
        assert {s.binding.version.version_id for s in sessions} == {"A"}
    finally:
        await dep.close()
        await engines["e0"].close()


async def test_a_session_given_by_the_caller_that_would_starve_or_race_is_named_in_a_warning(caplog):
    import aiohttp

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2)) as fine, \
            aiohttp.ClientSession() as default, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=50, keepalive_timeout=2)) as per_host:
        with caplog.at_level("WARNING", logger="lorapub.adapters.sglang_http"):
            SGLangWireEngine("e0", "http://127.0.0.1:1", http=fine)
            assert warnings() == []
            SGLangWireEngine("e0", "http://127.0.0.1:1", http=default)  # 100 connections, idle 15 s
            assert any("holds at most 100 connections" in m for m in warnings())
            assert any("keeps idle connections 15" in m for m in warnings())
            caplog.clear()
            SGLangWireEngine("e0", "http://127.0.0.1:1", http=per_host)
            assert [m for m in warnings() if "holds at most 50 connections" in m] and len(warnings()) == 1


async def test_an_idle_connection_is_closed_before_the_server_would_close_it(slow_double):
    """SGLang's HTTP server closes a connection idle for 5 s; a request sent on one it is closing
    gets no answer (an unknown outcome), so the adapter's own session drops idle ones sooner."""
    from lorapub.adapters.sglang_http import IDLE_CONNECTION_S

    engine = SGLangWireEngine("e0", slow_double.url)
    try:
        await engine.incarnation()
        connector = engine.client.http.connector
        assert sum(len(c) for c in connector._conns.values()) == 1  # kept for reuse
        # under SGLang's 5 s (SGLANG_TIMEOUT_KEEP_ALIVE); aiohttp's cleanup closes an idle connection
        # between one and two keep-alive periods after its last use
        await asyncio.sleep(2 * IDLE_CONNECTION_S + 0.5)
        assert sum(len(c) for c in connector._conns.values()) == 0, "an idle connection outlived 4.5 s"
        await engine.incarnation()  # a fresh connection answers
    finally:
        await engine.close()
