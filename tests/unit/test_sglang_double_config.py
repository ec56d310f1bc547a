"""The SGLang double as a server launched the way the docs say: SGLang's own LoRA limits by default
(so the capacity docs/freshness.md recommends is accepted), its knobs reachable from
``serve_double``, the body sizes a live server accepts, and a restart that drops the connections of
what was running, as a crashed server does."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest

from lorapub import Deployment, OutcomeUnknown
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.testing import SGLangDouble, lora_snapshot
from lorapub.testing.fixtures import peft_config
from lorapub.wire.routes import BEGIN_ROUTE
from tests.e2e.conftest import FAST

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def test_the_double_defaults_are_sglangs_so_the_documented_capacity_starts():
    double = await SGLangDouble("e0").start()
    engine = SGLangWireEngine("e0", double.url)
    try:
        limits = await engine.limits()
        # SGLang's server_args: max_loras_per_batch 8, max_loaded_loras unset (no CPU-side limit)
        assert (limits.max_loras_per_batch, limits.max_loaded_loras) == (8, None)
        dep = await Deployment({"e0": engine}, epoch=1, capacity=4, max_lag=2, deadlines=FAST,
                               reconcile_interval=None).start()  # docs/freshness.md's capacity 4, max_lag 2
        published = [await dep.publish(lora_snapshot(i), f"v{i}") for i in range(4)]
        assert published[-1].lora_name in double.registered()
        await dep.close()
    finally:
        await engine.close()
        await double.stop()


def test_serve_double_takes_sglangs_lora_limits(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorapub.testing.serve_double", "e0", str(tmp_path / "stash"),
         "--max-loaded-loras", "5", "--max-loras-per-batch", "4"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "URL", line

        async def server_info():
            async with aiohttp.ClientSession() as http, http.get(line[1] + "/server_info") as r:
                return await r.json()

        info = asyncio.run(server_info())
        assert (info["max_loaded_loras"], info["max_loras_per_batch"]) == (5, 4)
    finally:
        proc.stdin.close()
        proc.wait(30)


def many_tensors(count: int) -> dict:
    import numpy as np

    # PEFT names of a mixture-of-experts adapter (an expert's projection per pair of tensors): about
    # 210 bytes of begin request per tensor, so 5,000 of them pass aiohttp's default 1 MiB
    return {f"base_model.model.model.layers.{i // 256}.mlp.experts.{(i // 2) % 128}.down_proj.lora_{'AB'[i % 2]}.weight":
            np.full((1, 1), i, dtype="float32") for i in range(count)}


async def test_a_begin_for_an_adapter_of_5000_tensors_is_accepted(tmp_path):
    from lorapub import Snapshot

    double = SGLangDouble("e0")
    double.stash_root = str(tmp_path)
    await double.start()
    try:
        # the begin request itself: over aiohttp's default 1 MiB, which SGLang's server never limits
        async with aiohttp.ClientSession() as http:
            async with http.post(double.url + BEGIN_ROUTE, data=b"{" + b" " * (3 << 20) + b"}",
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status != 413, await r.text()
        dep = await Deployment({"e0": SGLangWireEngine("e0", double.url)}, epoch=1, deadlines=FAST,
                               reconcile_interval=None).start()
        v = await dep.publish(Snapshot(many_tensors(5000), peft_config(1)), "big")
        assert v.lora_name in double.registered()
        await dep.close()
    finally:
        await double.stop()


async def test_a_restart_drops_the_connection_of_a_running_request():
    double = await SGLangDouble("e0", decode_delay=0.01).start()
    try:
        async with aiohttp.ClientSession() as http:
            running = asyncio.create_task(http.post(double.url + "/generate", json={
                "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1000}}))
            while double.generate_requests == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # decoding
            double.restart()
            with pytest.raises(aiohttp.ClientConnectionError):  # no answer at all, as from a crashed server
                r = await asyncio.wait_for(running, 5)
                raise AssertionError(f"answered {r.status}: {await r.text()}")
            async with http.get(double.url + "/health") as r:  # the new life serves
                assert r.status == 200
    finally:
        await double.stop()


async def test_a_turn_cut_by_an_engine_restart_is_reported_as_unknown_not_as_refused(caplog):
    double = await SGLangDouble("e0", decode_delay=0.01).start()
    dep = await Deployment({"e0": SGLangWireEngine("e0", double.url)}, epoch=1, deadlines=FAST,
                           reconcile_interval=None).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s")
        turn = asyncio.create_task(s.generate({**GEN, "sampling_params": {"max_new_tokens": 1000}}))
        while double.generations == 0 and double.generate_requests == 0:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # tokens are being generated
        double.restart()
        with pytest.raises(OutcomeUnknown, match="may or may not have run"):
            await asyncio.wait_for(turn, 10)
        assert not [r for r in caplog.records if r.name.startswith("aiohttp") and r.levelname == "ERROR"]
    finally:
        await dep.close()
        await double.stop()


@pytest.mark.parametrize("setting", [None, ("v", 1.5), ("absent", 2.0)])
def test_the_doubles_tensor_load_models_an_adapter_as_the_whole_float64_copy_did(setting):
    """The tensor load reads one float64 tensor at a time; its stand-in model must stay the number the
    publisher's probe expects (numeric.apply_scale over a float64 copy of every tensor)."""
    import torch

    from lorapub.testing import numeric
    from lorapub.testing.sglang_double.engine import _Float64View

    g = torch.Generator().manual_seed(0)
    tensors = {f"l{i}.{m}": torch.randn(8, 16, generator=g).to(torch.bfloat16) for i in range(3) for m in ("q", "v")}
    config = {"r": 8, "lora_alpha": 16}
    whole = numeric.apply_scale({n: t.to(torch.float64).numpy() for n, t in tensors.items()}, setting)
    assert numeric.adapter_stat(_Float64View(tensors, setting), config) == numeric.adapter_stat(whole, config)
