"""Bucket bodies posted from a thread of their own, so that their socket sends never run on the
caller's event loop: :class:`BodySender`, one per process (:func:`shared_sender`), with a daemon
thread, an event loop and an aiohttp session of its own.
See docs/embedding.md, "Your transport: implement `lorapub.ports.Transport`".
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
import weakref
from typing import Any, AsyncIterable, Coroutine, Mapping, TypeVar

import aiohttp

from lorapub.adapters.sglang_http import IDLE_CONNECTION_S

_T = TypeVar("_T")

class _Stopped(Exception):
    """The worker was stopped before the post could be handed to it."""


class _Worker:
    """One thread, its event loop and its session (made on that loop, closed on it)."""

    def __init__(self) -> None:
        # asyncio's own loop whatever policy the process installed (AReaL installs uvloop's): close() stops
        # this loop from other threads, which uvloop's loop does not survive (libuv aborts the process),
        # and _drain() aborts the loop's transports through asyncio's selector loop
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop()
        self.http: aiohttp.ClientSession | None = None
        self._lock = threading.Lock()
        self._stopped = False
        # Posts handed over before the loop runs wait in its queue: the caller never waits here.
        self.thread = threading.Thread(target=self._serve, name="lorapub-body-sender", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                self.loop.run_until_complete(self._drain())
            finally:
                self.loop.close()

    async def _drain(self) -> None:
        # Stopped: every post still here ends (its caller sees a connection error), then the session
        # and any body generator are closed on this loop, so nothing is left pending or unclosed.
        tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.close()
        # A closed transport with unsent bytes waits to send them before it drops its socket, and
        # this loop is about to close: abort every transport of it (all are this worker's), so the
        # servers see the posts end now, not when the sockets are collected. asyncio's selector
        # loops keep them in ``_transports``; another loop's are dropped when collected.
        for transport in list(getattr(self.loop, "_transports", {}).values()):
            # one already closing, still waiting to flush, is aborted too; one whose close has completed
            # has let go of its loop and has nothing left to abort
            if transport is not None and getattr(transport, "_loop", None) is not None:
                transport.abort()
        for _ in range(3):  # the aborts' connection_lost callbacks run in the next iterations
            await asyncio.sleep(0)  # a scheduling point, no timer
        await self.loop.shutdown_asyncgens()

    async def post(self, url: str, params: Mapping[str, str], headers: Mapping[str, str], body: Any,
                   timeout: float | None) -> tuple[int, bytes]:  # runs on this worker's loop
        if self.http is None:
            # The engine adapters' own connection rules: no cap; idle connections dropped before
            # SGLang's server drops them.
            self.http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S))
        async with self.http.post(url, params=params, data=body, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        with self._lock:
            if self._stopped:
                raise _Stopped
            # Queued before any stop below: the post starts, and a later stop cancels it.
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10)


_ORPHANED: list[_Worker] = []  # a parent's workers, as a forked child inherited them: never touched
_SENDERS: weakref.WeakSet[BodySender] = weakref.WeakSet()


class BodySender:
    """Posts request bodies from its own daemon thread, event loop and aiohttp session; the socket
    calls release the GIL, so the caller's loop keeps running while the bytes go out.

    The caller awaits a post as usual: its result, its errors (aiohttp's and asyncio's own, so the
    engine adapter maps them as before) and its cancellation cross over through
    :func:`asyncio.run_coroutine_threadsafe`. Cancelling the caller's await cancels the post in the
    thread and returns at once; a bucket the engine still stores after that belongs to an attempt
    the caller is ending.

    The thread starts on first use. A forked child starts its own: the parent's thread does not
    exist there, and the parent's loop and connections are left untouched (closing them in the
    child would remove the parent's sockets from the epoll set the two share). :meth:`close` (at
    exit, for the process's shared sender) ends every post still running with a connection error,
    closes the session and stops the thread; a later post starts a new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        _SENDERS.add(self)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # the parent may have held it while forking
        if self._worker is not None:
            _ORPHANED.append(self._worker)
            self._worker = None

    async def post(self, url: str, *, params: Mapping[str, str], headers: Mapping[str, str],
                   body: AsyncIterable[Any] | bytes, timeout: float | None) -> tuple[int, bytes]:
        """POST ``body`` to ``url`` from the sender's thread: ``(status, raw reply)``.

        ``body`` is consumed on the sender's thread (an async iterable is iterated there); it must
        not be used by the caller meanwhile. Raises what aiohttp raises; a post ended by
        :meth:`close` raises :class:`aiohttp.ClientConnectionError` (its outcome is unknown).
        """
        while True:
            with self._lock:
                if self._worker is None:
                    self._worker = _Worker()
                worker = self._worker
            coro = worker.post(url, params, headers, body, timeout)
            try:
                future = worker.submit(coro)
                break
            except _Stopped:  # closed in between: the next turn starts a new worker
                coro.close()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller was cancelled (the post was cancelled with it)
            raise aiohttp.ClientConnectionError("lorapub's body sender was closed during the post") from None

    def close(self) -> None:
        """End every post still running, close the session and stop the thread. A later post starts
        a new one."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()


def _after_fork_in_child() -> None:
    for sender in list(_SENDERS):
        sender._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

_SHARED = BodySender()
atexit.register(_SHARED.close)


def shared_sender() -> BodySender:
    """The process's one :class:`BodySender`."""
    return _SHARED


__all__ = ["BodySender", "shared_sender"]
