"""The one owner of a deployment's background tasks.

Every task a deployment starts is spawned here under a name (and, where only one may run at a time, a
key); ``close`` cancels what is left after a grace period and joins them all, so nothing outlives the
deployment, and a task that fails is logged once with its name.
See docs/design.md, "Shape".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Hashable
from typing import Any

__all__ = ["TaskOwner"]

log = logging.getLogger(__name__)


class TaskOwner:
    """Like an :class:`asyncio.TaskGroup` it joins its children; unlike one, a failing child never
    cancels its siblings (a failed reclaim must not stop lease renewals), and it lives from a
    deployment's ``start`` to its ``close`` rather than one ``async with`` block."""

    def __init__(self, name: str = "lorapub") -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._keyed: dict[Hashable, asyncio.Task[Any]] = {}
        self._closed = False

    def __repr__(self) -> str:
        return f"TaskOwner({self.name!r}, running={len(self._tasks)})"

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str, key: Hashable | None = None,
              quiet: bool = False) -> asyncio.Task[Any]:
        """Run ``coro`` in the background. With ``key``: unless a task of that key still runs, whose
        task is returned instead (``coro`` is then closed unrun). ``quiet``: its failure is its
        awaiter's to report, not logged here."""
        if key is not None and key in self._keyed:
            coro.close()
            return self._keyed[key]
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.name}: closed; no background task is started after close()")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}-{name}")
        self._tasks.add(task)
        if key is not None:
            self._keyed[key] = task
        task.add_done_callback(lambda t: self._done(t, key, quiet))
        return task

    def _done(self, task: asyncio.Task[Any], key: Hashable | None, quiet: bool) -> None:
        self._tasks.discard(task)
        if key is not None and self._keyed.get(key) is task:
            del self._keyed[key]
        if task.cancelled():
            return
        error = task.exception()  # retrieved here either way: never "exception was never retrieved"
        if error is not None and not quiet:
            log.warning("background task %s failed: %r", task.get_name(), error)

    def running(self, key: Hashable) -> asyncio.Task[Any] | None:
        return self._keyed.get(key)

    def of_kind(self, kind: str) -> list[asyncio.Task[Any]]:
        """The keyed tasks of one kind running now: a key ``(kind, what)``, or ``kind`` itself."""
        return [task for key, task in self._keyed.items() if _kind(key) == kind]

    @property
    def closed(self) -> bool:
        """``close`` ran: nothing starts here any more."""
        return self._closed

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float | None = None, *, kind: str | None = None) -> bool:
        """Wait for the running tasks (only those of ``kind``, when given) for at most ``timeout`` s,
        tasks spawned meanwhile included; True when none is left."""
        def pending() -> list[asyncio.Task[Any]]:
            return list(self._tasks) if kind is None else self.of_kind(kind)

        try:
            async with asyncio.timeout(timeout):
                while left := pending():
                    await asyncio.gather(*left, return_exceptions=True)
        except TimeoutError:
            return False
        return True

    async def cancel(self, kind: str) -> None:
        """Cancel the running tasks of ``kind`` and join them."""
        left = self.of_kind(kind)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    async def close(self, grace: float = 0.0) -> None:
        """Let the tasks finish for ``grace`` s, cancel the rest, and join them all. No task starts after."""
        self._closed = True
        if grace > 0:
            await self.wait(grace)
        for task in list(self._tasks):
            task.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _kind(key: Hashable) -> Hashable:
    return key[0] if isinstance(key, tuple) and key else key
