"""Switch off = the old path, on stock SGLang: no lorapub route, none of lorapub's patch.

The doubles run in ``stock=True`` mode (``/lorapub/state`` is a 404, as on an unpatched
server); everything goes over HTTP through ``SGLangOverwriteAdmin``.
"""

from __future__ import annotations

import aiohttp
import pytest

from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.wire.routes import STATE_ROUTE
from lorapub.errors import EngineError
from lorapub.runtime.deployment import deploy
from lorapub.runtime.overwrite import FIXED_LORA_NAME
from lorapub.testing import SGLangDouble, lora_snapshot

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture
async def stock():
    pair = [await SGLangDouble(n, stock=True).start() for n in ("e0", "e1")]
    yield {d.name: d for d in pair}
    for d in pair:
        await d.stop()


@pytest.fixture
async def admins(stock):
    made = {n: SGLangOverwriteAdmin(n, d.url) for n, d in stock.items()}
    yield made
    for a in made.values():
        await a.close()


async def test_a_stock_double_has_no_lorapub_route(stock):
    async with aiohttp.ClientSession() as http:
        async with http.get(stock["e0"].url + STATE_ROUTE) as r:
            assert r.status == 404
        async with http.get(stock["e0"].url + "/v1/models") as r:
            assert [c["id"] for c in (await r.json())["data"]] == ["lorapub-tiny-qwen3"]
    engine = SGLangWireEngine("e0", stock["e0"].url)
    with pytest.raises(EngineError, match="lacks lorapub's SGLang patch"):
        await engine.incarnation()  # lorapub proper refuses a stock server; the old path does not need it
    await engine.close()


async def test_switch_off_pauses_flushes_overwrites_and_continues_on_stock_sglang(stock, admins, tmp_path):
    dep = await deploy(admins, epoch=1, enabled=False, stash_dir=str(tmp_path))
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    first = await s.generate(GEN)
    await dep.publish(lora_snapshot(2), "B")
    second = await s.generate(GEN)
    assert first["meta_info"]["lora_id"] != second["meta_info"]["lora_id"]  # one name, two policies
    for d in stock.values():
        assert [k for k, _ in d.events] == [
            "pause", "flush", "load", "continue",
            "pause", "flush", "unload", "load", "continue",
        ]
        assert d.registered() == [FIXED_LORA_NAME] and not d.is_paused
        assert await admins[d.name].loaded_adapters() == [FIXED_LORA_NAME]


async def test_a_failure_mid_way_leaves_no_stock_engine_paused(stock, admins, tmp_path):
    dep = await deploy(admins, epoch=1, enabled=False, stash_dir=str(tmp_path))
    await dep.publish(lora_snapshot(1), "A")
    stock["e1"].inject("load", "error", status=400)
    with pytest.raises(EngineError, match="e1 /load_lora_adapter answered 400: injected load failure"):
        await dep.publish(lora_snapshot(2), "B")
    for d in stock.values():
        assert not d.is_paused and d.events[-1][0] == "continue"
    for name in stock:  # both engines serve again (e1 without the fixed name: its overwrite failed)
        out = await admins[name].generate({**GEN, "lora_path": FIXED_LORA_NAME} if name == "e0" else GEN)
        assert out["output_ids"]
    stock["e0"].inject("pause", "error", status=503)
    with pytest.raises(EngineError, match="e0 /pause_generation answered 503"):
        await dep.publish(lora_snapshot(3), "C")
    assert not stock["e1"].is_paused and stock["e1"].events[-1][0] == "continue"
