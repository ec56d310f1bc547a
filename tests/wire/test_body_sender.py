"""HTTPBytes' bucket bodies go out from lorapub's sender thread, never from the caller's event loop;
the post's result, errors and cancellation cross over as if it ran on the caller's loop."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading

import aiohttp
import pytest
from aiohttp import web

from lorapub.adapters import sglang_wire
from lorapub.adapters.body_sender import BodySender, shared_sender
from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine
from lorapub.errors import InvalidInput
from lorapub.runtime.deployment import Deployment
from lorapub.testing import SGLangDouble
from lorapub.testing.fixtures import lora_snapshot
from tests.e2e.conftest import FAST


@pytest.mark.parametrize("sender,given_session,where", [
    ("auto", False, "thread"), ("thread", False, "thread"), ("loop", False, "loop"),
    ("auto", True, "loop"),  # the caller's session (its TLS context, proxy...) carries every request
    ("thread", True, "thread"),
])
async def test_bucket_bodies_are_read_on_the_sender_thread_or_the_callers_loop(sender, given_session, where,
                                                                                 tmp_path, monkeypatch):
    threads: set[str] = set()
    views = sglang_wire.RawBucket.views

    def recording(self):
        for view in views(self):
            threads.add(threading.current_thread().name)
            yield view

    monkeypatch.setattr(sglang_wire.RawBucket, "views", recording)
    double = SGLangDouble("e0")
    double.stash_root = str(tmp_path / "disk")
    await double.start()
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2)) if given_session else None
    engine = SGLangWireEngine("e0", double.url, probe_timeout=10, http=http)
    dep = await Deployment({"e0": engine}, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10,
                           transport=HTTPBytes(sender=sender)).start()
    try:
        report = await dep.publish(lora_snapshot(3), "v1")
        assert report.state.value == "PUBLISHED"
        assert [e for e in double.events if e[0] == "load"], "the engine loaded the adapter"
    finally:
        await dep.close()
        await engine.close()
        if http is not None:
            await http.close()
        await double.stop()
    caller = threading.current_thread().name
    assert threads == ({"lorapub-body-sender"} if where == "thread" else {caller})


def test_sender_must_be_thread_or_loop():
    with pytest.raises(InvalidInput, match="sender must be one of"):
        HTTPBytes(sender="process")
    assert HTTPBytes() == HTTPBytes(sender="auto") != HTTPBytes(sender="thread") != HTTPBytes(sender="loop")


@pytest.fixture
async def slow_server():
    """A server that reads a body slowly (64 KiB every 10 ms) and records how each request ended."""
    ended: asyncio.Queue[str] = asyncio.Queue()

    async def slow(request: web.Request) -> web.Response:
        try:
            while await request.content.read(1 << 16):
                await asyncio.sleep(0.01)
            await ended.put("complete")
            return web.Response(text="ok")
        except (asyncio.CancelledError, ConnectionResetError, aiohttp.ClientPayloadError):
            await ended.put("aborted")  # the client went away before the body ended
            raise

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"bytes": len(body), "q": request.query.get("q"),
                                  "auth": request.headers.get("Authorization")}, status=201)

    app = web.Application()
    app.router.add_post("/slow", slow)
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", ended
    await runner.cleanup()


async def chunks(n: int, size: int = 1 << 16):
    block = memoryview(b"x" * size)
    for _ in range(n):
        yield block


BIG = 512  # 512 x 64 KiB = 32 MiB: more than the socket buffers hold, 5 s at the slow server's pace


async def test_a_post_answers_on_the_callers_loop(slow_server):
    url, _ = slow_server
    status, raw = await shared_sender().post(url + "/echo", params={"q": "1"}, headers={"Authorization": "Bearer k"},
                                             body=chunks(5), timeout=10)
    assert status == 201
    assert raw == b'{"bytes": 327680, "q": "1", "auth": "Bearer k"}'


async def test_cancelling_the_callers_await_aborts_the_post_in_the_sender(slow_server):
    url, ended = slow_server
    task = asyncio.ensure_future(shared_sender().post(url + "/slow", params={}, headers={}, body=chunks(BIG),
                                                      timeout=None))
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the sender's request was cancelled too: the connection closed under the server's handler
    assert await asyncio.wait_for(ended.get(), 10) == "aborted"


async def test_no_answer_raises_aiohttps_own_errors(unused_tcp_port):
    with pytest.raises(aiohttp.ClientConnectionError):
        await shared_sender().post(f"http://127.0.0.1:{unused_tcp_port}/x", params={}, headers={}, body=b"abc",
                                   timeout=5)


async def test_a_timeout_raises_asyncios_timeout(slow_server):
    url, ended = slow_server
    with pytest.raises(asyncio.TimeoutError):
        await shared_sender().post(url + "/slow", params={}, headers={}, body=chunks(BIG), timeout=0.3)
    assert await asyncio.wait_for(ended.get(), 10) == "aborted"


def _post_in_child(url: str, out) -> None:
    async def post():
        return await shared_sender().post(url + "/echo", params={"q": "child"}, headers={}, body=b"12345", timeout=10)

    out.put(asyncio.run(post()))


async def test_a_forked_child_posts_through_a_sender_thread_of_its_own(slow_server):
    url, _ = slow_server
    assert (await shared_sender().post(url + "/echo", params={}, headers={}, body=b"1", timeout=10))[0] == 201
    ctx = multiprocessing.get_context("fork")  # the parent's sender thread does not exist in the child
    out = ctx.Queue()
    child = ctx.Process(target=_post_in_child, args=(url, out))
    child.start()
    status, raw = await asyncio.to_thread(out.get, True, 30)
    await asyncio.to_thread(child.join, 30)
    assert (status, raw) == (201, b'{"bytes": 5, "q": "child", "auth": null}') and child.exitcode == 0
    # the child (its post, its exit) left the parent's sender alone: its kept-alive connection
    # still answers (closing it in the child took it out of the epoll set both share)
    assert (await shared_sender().post(url + "/echo", params={}, headers={}, body=b"22", timeout=5))[0] == 201


async def test_a_closed_sender_starts_again_on_the_next_post(slow_server):
    url, _ = slow_server
    sender = BodySender()
    assert (await sender.post(url + "/echo", params={}, headers={}, body=b"1", timeout=10))[0] == 201
    first = sender._worker
    await asyncio.to_thread(sender.close)
    assert not first.thread.is_alive() and first.http.closed
    assert (await sender.post(url + "/echo", params={}, headers={}, body=b"22", timeout=10))[0] == 201
    assert sender._worker is not first and sender._worker.thread.is_alive()
    await asyncio.to_thread(sender.close)


async def test_closing_the_sender_ends_a_post_in_flight_with_a_connection_error(slow_server):
    url, ended = slow_server
    sender = BodySender()
    post = asyncio.ensure_future(sender.post(url + "/slow", params={}, headers={}, body=chunks(BIG), timeout=None))
    await asyncio.sleep(0.3)
    await asyncio.to_thread(sender.close)
    with pytest.raises(aiohttp.ClientConnectionError, match="closed during the post"):
        await asyncio.wait_for(post, 10)  # never left waiting on a stopped loop
    assert await asyncio.wait_for(ended.get(), 10) == "aborted"


async def test_posts_racing_close_each_answer_or_fail_typed(slow_server):
    """Posts from several threads while the sender is closed again and again: every post returns
    or raises aiohttp's own error; none is left waiting, and no session is left open."""
    url, _ = slow_server
    sender = BodySender()
    workers: list = []

    async def post_many() -> list[str]:
        outcomes = []
        for _ in range(30):
            try:
                status, _ = await asyncio.wait_for(
                    sender.post(url + "/echo", params={}, headers={}, body=b"x" * 1000, timeout=10), 15)
                outcomes.append(str(status))
            except aiohttp.ClientError as e:
                outcomes.append(type(e).__name__)
            workers.append(sender._worker)
        return outcomes

    def closer(stop: threading.Event) -> None:
        while not stop.is_set():
            sender.close()

    stop = threading.Event()
    closing = threading.Thread(target=closer, args=(stop,))
    closing.start()
    try:
        results = await asyncio.gather(*(asyncio.to_thread(asyncio.run, post_many()) for _ in range(3)))
    finally:
        stop.set()
        closing.join()
        sender.close()
    outcomes = [o for r in results for o in r]
    assert len(outcomes) == 90 and "201" in outcomes
    assert set(outcomes) <= {"201", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError"}, set(outcomes)
    for worker in {id(w): w for w in workers if w is not None}.values():
        worker.thread.join(10)
        assert not worker.thread.is_alive() and (worker.http is None or worker.http.closed)


def test_the_sender_runs_asyncios_own_loop_whatever_policy_the_process_installed():
    """An embedder may install another loop policy (AReaL installs uvloop's on import); the sender's loop,
    stopped from other threads by close(), stays asyncio's selector loop."""
    class Marked(asyncio.SelectorEventLoop):
        pass

    class Policy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self):
            return Marked()

    from lorapub.adapters.body_sender import _Worker

    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(Policy())
    try:
        made = asyncio.new_event_loop()
        made.close()
        assert type(made) is Marked  # the policy is in force
        worker = _Worker()
        try:
            assert type(worker.loop) is asyncio.SelectorEventLoop
        finally:
            worker.stop()
        assert not worker.thread.is_alive()
    finally:
        asyncio.set_event_loop_policy(before)
