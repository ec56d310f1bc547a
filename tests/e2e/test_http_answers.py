"""The SGLang HTTP adapter keeps the engine's own words and never hands a caller a raw string.

A scripted aiohttp server answers each route the way SGLang can: JSON errors in its several
shapes, plain text, an HTML page, a 200 that is not JSON.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from lorapub.adapters.sglang_http import MAX_ENGINE_TEXT, SGLangHTTP
from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.adapters.sglang_wire import SGLangWireEngine, SharedDir
from lorapub.errors import EngineClosed, EngineError, InvalidInput, OutcomeUnknown
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.testing import lora_snapshot
from lorapub.wire.routes import BEGIN_ROUTE


@pytest.fixture
async def scripted():
    """A server whose answer per path is set by the test: ``answers[path] = (status, body, content_type)``,
    or a handler of its own."""
    answers: dict[str, Any] = {}

    async def handler(request: web.Request) -> web.Response:
        if callable(answers[request.path]):
            return await answers[request.path](request)
        status, body, ctype = answers[request.path]
        return web.Response(status=status, body=body if isinstance(body, bytes) else body.encode(), content_type=ctype)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    clients: list = []

    def client(cls=SGLangHTTP, *args, **kw):
        c = cls("e0", f"http://127.0.0.1:{port}", *args, **{"request_timeout": 2, "probe_timeout": 2, **kw})
        clients.append(c)
        return c

    yield answers, client
    for c in clients:
        await c.close()
    await runner.cleanup()


JSON = "application/json"
GEN = {"input_ids": [1, 2], "lora_path": "relax_policy_lora@1-A-0123456789ab"}


@pytest.mark.parametrize(
    "status, body, ctype, said",
    [
        (503, '{"error": {"message": "Server is overloaded: 37 requests queued"}}', JSON,
         "503: Server is overloaded: 37 requests queued"),
        (500, '{"object": "error", "message": "CUDA out of memory", "type": "InternalServerError", "code": 500}', JSON,
         "500: CUDA out of memory"),
        (401, '{"error": "Unauthorized"}', JSON, "401: Unauthorized"),
        (422, '{"detail": [{"loc": ["body", "input_ids"], "msg": "field required"}]}', JSON, "field required"),
        (502, "upstream connect error or disconnect/reset before headers", "text/plain",
         "502: upstream connect error or disconnect/reset before headers"),
        (503, "", "text/plain", "503 Service Unavailable (empty body)"),
    ],
    ids=["sglang-error", "openai-error", "auth", "validation", "plain-text", "empty"],
)
async def test_a_refused_generation_carries_the_engines_own_words(scripted, status, body, ctype, said):
    answers, client = scripted
    answers["/generate"] = (status, body, ctype)
    with pytest.raises(EngineError) as e:
        await client().generate(GEN)
    assert not isinstance(e.value, OutcomeUnknown)
    told, _, advice = e.value.message.partition("; ")
    assert told == f"e0 /generate answered {said}" or said in told, e.value.message
    assert f"answered {status}: {status}" not in e.value.message
    assert "did not run" in advice and "send the turn again" in advice  # what to do
    assert e.value.details["status"] == status


async def test_a_generation_without_an_answer_is_outcome_unknown_saying_what_to_do(scripted):
    answers, client = scripted

    async def late(request: web.Request) -> web.Response:  # takes the request, answers too late
        await asyncio.sleep(1)
        return web.Response()

    answers["/generate"] = late
    with pytest.raises(OutcomeUnknown) as e:
        await client(request_timeout=0.2).generate(GEN)
    assert "may or may not have run" in e.value.message and "never sends it twice" in e.value.message


async def test_a_long_or_multiline_engine_text_is_clipped_to_one_line(scripted):
    answers, client = scripted
    page = "<html><body>" + "\n".join(f"<p>line {i} of a proxy's error page</p>" for i in range(500)) + "</body></html>"
    answers["/generate"] = (502, page, "text/html")
    with pytest.raises(EngineError) as e:
        await client().generate(GEN)
    told = e.value.message.partition("; the engine refused")[0]
    assert "\n" not in e.value.message and told.endswith("…")
    assert len(told) <= MAX_ENGINE_TEXT + len("e0 /generate answered 502: ")


@pytest.mark.parametrize("body", ["Cache flushed.", "<html>ok</html>", "", "[1, 2]", '"text"', b"\xff\xfe\x00bad"])
async def test_a_200_that_is_not_a_json_object_is_an_engine_error_never_a_string(scripted, body):
    answers, client = scripted
    for path in ("/generate", "/lorapub/state", "/load_lora_adapter", "/pause_generation", "/v1/models"):
        answers[path] = (200, body, "text/plain")
    http = client()
    for call in (http.generate(GEN), http.state(), http.admin("/load_lora_adapter", {"lora_name": "x"}),
                 http.admin("/pause_generation"), http.models()):
        with pytest.raises(EngineError) as e:
            await call
        assert not isinstance(e.value, OutcomeUnknown) and "answered 200" in e.value.message


async def test_a_malformed_state_is_an_engine_error(scripted):
    answers, client = scripted
    answers["/lorapub/state"] = (200, '{"incarnation": 7, "adapters": []}', JSON)
    with pytest.raises(EngineError, match="malformed state"):
        await client().state()
    answers["/lorapub/state"] = (200, '{"incarnation": "x", "adapters": {"a": 1}, "managed_patch": true}', JSON)
    with pytest.raises(EngineError, match="malformed state"):
        await client(SGLangWireEngine).incarnation()


@pytest.mark.parametrize("reply", ['{"ok": true}', '{"incarnation": 7}'])
async def test_a_staging_reply_without_an_incarnation_is_an_engine_error(scripted, reply):
    """begin's reply names the engine's life: one that does not (or not as text) is a definite
    EngineError, never a KeyError nor a non-text life handed on to the attempt."""
    answers, client = scripted
    snap = lora_snapshot(1, layers=1, hidden=8, rank=2)
    token = AttemptToken(VersionKey(1, "A"), 1)
    request = SendBegin("e0", "life0", token, lora_name_for(token.version, snap.digest), snap.digest, snap.plan(256))
    answers[BEGIN_ROUTE] = (200, reply, JSON)
    with pytest.raises(EngineError, match="without its incarnation"):
        await client(SGLangWireEngine).begin(request)


async def test_flush_cache_takes_sglangs_plain_text_answer(scripted):
    answers, client = scripted
    answers["/flush_cache"] = (200, "Cache flushed.\nPlease check backend logs for more details.\n", "text/plain")
    await client(SGLangOverwriteAdmin).flush_cache()
    answers["/flush_cache"] = (403, '{"error": "Forbidden"}', JSON)
    with pytest.raises(EngineError, match="403: Forbidden"):
        await client(SGLangOverwriteAdmin).flush_cache(attempts=3)


async def test_a_payload_that_is_not_json_is_refused_before_sending(scripted):
    answers, client = scripted
    answers["/generate"] = (200, '{"text": "sent anyway"}', JSON)
    http = client()
    for bad in ({**GEN, "sampling_params": {"temperature": float("nan")}}, {**GEN, "tags": {"a", "b"}}, ["not", "a", "map"]):
        with pytest.raises(InvalidInput):
            await http.generate(bad)


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"name": "../e0"}, "engine name"),
        ({"name": "e0\n"}, "engine name"),
        ({"name": None}, "engine name"),
        ({"base_url": "127.0.0.1:30000"}, "base_url"),
        ({"base_url": "file:///etc/passwd"}, "base_url"),
        ({"base_url": "http://h:99999"}, "base_url"),
        ({"base_url": None}, "base_url"),
        ({"request_timeout": 0}, "request_timeout"),
        ({"request_timeout": -1}, "request_timeout"),
        ({"probe_timeout": float("nan")}, "probe_timeout"),
        ({"probe_timeout": "30"}, "probe_timeout"),
        ({"http": "session"}, "http"),
        ({"api_key": ""}, "api_key"),
        ({"api_key": "sk-1\n"}, "api_key"),
        ({"admin_api_key": " sk-admin"}, "admin_api_key"),
        ({"admin_api_key": "clé"}, "admin_api_key"),
        ({"admin_api_key": 1234}, "admin_api_key"),
    ],
)
@pytest.mark.parametrize("cls", [SGLangHTTP, SGLangWireEngine, SGLangOverwriteAdmin])
def test_constructors_refuse_bad_arguments_with_invalid_input(cls, kwargs, named):
    args = {"name": "e0", "base_url": "http://127.0.0.1:30000", **kwargs}
    positional = [args.pop("name"), args.pop("base_url")]
    with pytest.raises(InvalidInput) as e:
        cls(*positional, **args)
    assert named in e.value.message


@pytest.mark.parametrize("folder", ["", None, 7, "a\x00b", "/nonexistent/lorapub-shared"])
def test_a_shared_folder_transport_refuses_a_bad_folder(folder):
    with pytest.raises(InvalidInput, match="path must be an existing folder"):
        SharedDir(folder)


@pytest.mark.parametrize("cls", [SGLangHTTP, SGLangOverwriteAdmin])
async def test_a_closed_adapter_refuses_to_send_and_opens_no_new_session(scripted, cls):
    answers, client = scripted
    answers["/generate"] = (200, '{"text": "ok", "meta_info": {}}', JSON)
    c = client(cls)
    await c.close()
    http = c.client if cls is SGLangOverwriteAdmin else c
    before = http.current_http
    with pytest.raises(EngineClosed) as e:
        await http.generate(GEN)
    assert e.value.code == "ENGINE_CLOSED" and "nothing was sent" in e.value.message
    assert http.current_http is before  # no fresh aiohttp session that nothing would close
