"""The SGLang double's streamed /generate ("stream": true): server-sent events, one per token, then
[DONE], as SGLang's /generate streams; a pause with abort ends the stream with its error."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from lorapub.testing import SGLangDouble


async def events(http: aiohttp.ClientSession, url: str, body: dict, seen: list | None = None) -> list:
    out = [] if seen is None else seen
    async with http.post(url + "/generate", json=body) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


async def test_a_streamed_generation_sends_a_token_at_a_time_then_the_whole_answer_then_done():
    double = await SGLangDouble("e0", decode_delay=0.001).start()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 6}}
            got = await events(http, double.url, body)
            async with http.post(double.url + "/generate", json=dict(body, stream=False)) as r:
                whole = await r.json()
    finally:
        await double.stop()
    assert got[-1] == b"[DONE]" and len(got) == 6 + 1
    chunks = [json.loads(c) for c in got[:-1]]
    assert [c["output_ids"] for c in chunks[:-1]] == [[t] for t in whole["output_ids"][:5]]
    assert chunks[-1]["output_ids"] == whole["output_ids"]  # the last event: the whole answer
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_a_pause_with_abort_ends_a_stream_with_its_error():
    double = await SGLangDouble("e0", decode_delay=0.01).start()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 1000}}
            seen: list = []
            streaming = asyncio.create_task(events(http, double.url, body, seen))
            while len(seen) < 3:
                await asyncio.sleep(0.005)
            async with http.post(double.url + "/pause_generation", json={"mode": "abort"}) as r:
                assert r.status == 200
            got = await asyncio.wait_for(streaming, 5)
            async with http.post(double.url + "/continue_generation", json={}) as r:
                assert r.status == 200
    finally:
        await double.stop()
    assert got[-1] == b"[DONE]" and 3 <= len(got) < 1000
    assert "pause_generation" in json.loads(got[-2])["error"]["message"]
