"""The contract double's ``blocking_load``: SGLang's scheduler loads an adapter between batches,
so while a load runs no step of generation starts on that engine (the benchmark relies on it)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.demo.workload import until
from lorapub.testing import SGLangDouble, lora_snapshot

GEN = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture
async def adapter_dir(tmp_path):
    return await asyncio.to_thread(lora_snapshot(1).save_peft_dir, str(tmp_path / "a"))


@contextlib.asynccontextmanager
async def loading(adapter_dir, **double_options):
    """A double built with ``double_options``, its admin, and a load of ``x`` under way."""
    double = await SGLangDouble("e0", **double_options).start()
    admin = SGLangOverwriteAdmin("e0", double.url)
    load = asyncio.create_task(admin.load_adapter("x", adapter_dir))
    try:
        await until(lambda: double.update_lock.locked())  # the load is under way
        yield double, admin, load
    finally:
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        await admin.close()
        await double.stop()


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "beside"])
async def test_a_generation_sent_during_a_load(adapter_dir, blocking):
    async with loading(adapter_dir, load_delay=0.3 if blocking else 30.0, blocking_load=blocking,
                       prefill_per_token=1e-6) as (double, admin, load):
        out = await admin.generate(GEN)
        assert out["output_ids"]
        if blocking:  # it waited: the adapter was registered before its first step
            assert ("load", "x") in double.events and double.not_loading.is_set()
            await load
        else:  # it ran beside the load, which is still going
            assert ("load", "x") not in double.events and not load.done()


async def test_the_patched_model_decodes_beside_a_load_and_stops_only_to_swap_it_in_and_fill_its_slot(adapter_dir):
    """lorapub's patched server as measured live: the load runs beside decoding; the swap-in
    (``install_stop``) and the first step on the new adapter (``first_use_stop``) stop every request."""
    # The stops are long beside what a turn takes, so "no wait" and "a wait" stay apart on a loaded
    # machine: a turn that waits takes STOP or more, one that does not stays well under it.
    loop, stop = asyncio.get_running_loop(), 1.0
    async with loading(adapter_dir, load_delay=2 * stop, install_stop=stop, first_use_stop=stop) as (double, admin, load):
        t0 = loop.time()
        assert (await admin.generate(GEN))["output_ids"]  # beside the load: no wait
        assert loop.time() - t0 < stop * 0.8 and not load.done()
        await until(lambda: not double.not_loading.is_set(), timeout=10)  # the swap-in stops every step
        t0 = loop.time()
        assert (await admin.generate(GEN))["output_ids"]
        assert loop.time() - t0 >= 0.1  # it waited out the swap-in
        await load  # (the load records itself after the swap-in, off the loop: a turn may return first)
        assert ("load", "x") in double.events
        t0 = loop.time()  # the adapter's first step waits for its slot to be filled
        first, base = await asyncio.gather(admin.generate({**GEN, "lora_path": "x"}), admin.generate(GEN))
        assert loop.time() - t0 >= stop * 0.9 and first["output_ids"] and base["output_ids"]
        t0 = loop.time()
        assert (await admin.generate({**GEN, "lora_path": "x"}))["output_ids"]  # once only
        assert loop.time() - t0 < stop * 0.8 and double.not_loading.is_set()


async def test_a_stop_taken_before_a_restart_leaves_the_new_incarnation_stepping(adapter_dir):
    double = await SGLangDouble("e0", first_use_stop=0.3).start()
    admin = SGLangOverwriteAdmin("e0", double.url)
    try:
        await admin.load_adapter("x", adapter_dir)
        first = asyncio.create_task(admin.generate({**GEN, "lora_path": "x"}))  # holds every step for 0.3 s
        await until(lambda: not double.not_loading.is_set())
        double.restart()  # the crash: the held request's release belongs to the old incarnation
        await asyncio.gather(first, return_exceptions=True)
        await admin.load_adapter("x", adapter_dir)
        # a new first use: stop, release (a stuck gate would hold it forever)
        assert (await asyncio.wait_for(admin.generate({**GEN, "lora_path": "x"}), 5))["output_ids"]
        assert double.not_loading.is_set()
        assert (await asyncio.wait_for(admin.generate(GEN), 2))["output_ids"]
    finally:
        await admin.close()
        await double.stop()
