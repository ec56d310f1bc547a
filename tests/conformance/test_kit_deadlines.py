"""The test kit's own deadlines hold on a loaded machine: an ordinary answer that comes late (as
on a busy 2-core machine) is not taken for a lost one, and a reply the harness drops on purpose is
still given up on quickly, so the suite stays fast."""

from __future__ import annotations

import asyncio

from lorapub.errors import OutcomeUnknown
from lorapub.testing import SGLangUnderTest
from lorapub.testing.conformance import _begin, _load


async def test_an_ordinary_answer_that_comes_late_is_not_taken_for_a_lost_one(tmp_path):
    engine = await SGLangUnderTest.start(str(tmp_path / "disk"))
    try:
        engine.double.inject("load", "slow", delay=2.5)  # a loaded machine: the load answers after 2.5 s
        request, ready = await _load(engine, 1, 1)
        assert ready.token == request.token and request.lora_name in await engine.served()
        engine.double.inject("generate", "slow", delay=2.5)
        assert (await engine.admin.generate(engine.generation(request.lora_name)))["meta_info"]
    finally:
        await engine.close()


async def test_a_reply_dropped_on_purpose_is_given_up_on_quickly_and_only_that_one(tmp_path):
    engine = await SGLangUnderTest.start(str(tmp_path / "disk"))
    loop = asyncio.get_running_loop()
    try:
        request, _ = await _load(engine, 1, 2)
        engine.drop_next_reply("generate")
        started = loop.time()
        try:
            await engine.admin.generate(engine.generation(request.lora_name))
            raise AssertionError("a dropped reply must be OutcomeUnknown")
        except OutcomeUnknown:
            pass
        assert loop.time() - started < 10  # the suite does not wait the ordinary deadline for it
        engine.drop_next_reply("load")
        begun, snapshot, plan, _ = await _begin(engine, 1, 3)
        for i in range(len(plan.buckets)):
            await engine.admin.receive_bucket(begun.token, i, snapshot.bucket_bytes(plan, i))
        started = loop.time()
        try:
            await engine.admin.end(begun.token)
            raise AssertionError("a dropped reply must be OutcomeUnknown")
        except OutcomeUnknown:
            pass
        assert loop.time() - started < 10
        # the next calls have their generous deadlines back (room made for one more pinned load first)
        await engine.admin.cleanup(begun.token, begun.lora_name)
        await engine.admin.cleanup(request.token, request.lora_name)
        engine.double.inject("load", "slow", delay=2.5)
        again, _ = await _load(engine, 1, 4)
        assert again.lora_name in await engine.served()
    finally:
        await engine.close()
