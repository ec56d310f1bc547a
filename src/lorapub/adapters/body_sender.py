"""Bucket bodies posted from a thread of their own, so that their socket sends never run on the
caller's event loop.

A 349 MB adapter is thousands of socket writes per engine. On the caller's loop each is a step of
that loop (asyncio's ``_write_ready``: on loopback the kernel also runs the receiver's TCP work in
the sender's time), measured at 5-17 ms on a busy two-core machine, while the rollout's generations
and tool calls wait behind it. Here the writes run on one daemon thread with an event loop and an
aiohttp session of its own; the socket calls release the GIL, so the caller's loop keeps running
while the bytes go out. The caller awaits the post as usual: its result, its errors (aiohttp's and
asyncio's own, so the engine adapter maps them as before) and its cancellation (cancelling the
caller's await cancels the post in the thread) cross over through
:func:`asyncio.run_coroutine_threadsafe`.

One sender serves the whole process (:func:`shared_sender`); it starts on first use, starts again
in a forked child (a thread does not survive ``fork``), and closes its session at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from typing import Any, AsyncIterable, Mapping

import aiohttp

from lorapub.adapters.sglang_http import IDLE_CONNECTION_S


class BodySender:
    """Posts request bodies from its own thread and event loop; see the module."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: aiohttp.ClientSession | None = None
        self._thread: threading.Thread | None = None
        self._pid = 0

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid() or not self._thread.is_alive():
                ready = threading.Event()
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self._serve, args=(loop, ready), name="lorapub-body-sender",
                                          daemon=True)
                thread.start()
                ready.wait()
                # a session of a parent's (or a stopped) loop is never reused
                self._loop, self._thread, self._pid, self._http = loop, thread, os.getpid(), None
            return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _session(self) -> aiohttp.ClientSession:  # runs on the sender's loop
        if self._http is None or self._http.closed:
            # The same connection rules as the engine adapters' own sessions (no cap; idle
            # connections dropped before SGLang's server drops them).
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S))
        return self._http

    async def _post(self, url: str, params: Mapping[str, str], headers: Mapping[str, str], body: Any,
                    timeout: float | None) -> tuple[int, bytes]:
        http = await self._session()
        async with http.post(url, params=params, data=body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read()

    async def post(self, url: str, *, params: Mapping[str, str], headers: Mapping[str, str],
                   body: AsyncIterable[Any] | bytes, timeout: float | None) -> tuple[int, bytes]:
        """POST ``body`` to ``url`` from the sender's thread: ``(status, raw reply)``.

        ``body`` is consumed on the sender's thread (an async iterable is iterated there); it must
        not be used by the caller meanwhile. Raises what aiohttp raises.
        """
        loop = self._running_loop()
        future = asyncio.run_coroutine_threadsafe(self._post(url, params, headers, body, timeout), loop)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Close the session and stop the thread (at exit; a later post starts a new one)."""
        with self._lock:
            loop, thread, http = self._loop, self._thread, self._http
            self._loop = self._thread = self._http = None
            if loop is None or self._pid != os.getpid() or thread is None or not thread.is_alive():
                return

        async def _close() -> None:
            if http is not None:
                await http.close()

        try:
            asyncio.run_coroutine_threadsafe(_close(), loop).result(timeout=5)
        except Exception:  # at exit: nothing left to tell
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


_SHARED = BodySender()
atexit.register(_SHARED.close)


def shared_sender() -> BodySender:
    """The process's one :class:`BodySender`."""
    return _SHARED


__all__ = ["BodySender", "shared_sender"]
