"""Session service: bind once on first generation, carry the exact lora_path forever.

Each session owns one shared bind task; every waiter awaits it through
``asyncio.shield`` so cancelling one request never cancels the binding or
causes a second pick. Close runs once: FINALIZING (no new dispatch) ->
begin_close -> wait for the bind task, abort in-flight requests -> release
the session ref exactly once -> drop the local record.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import uuid
from typing import Any, Mapping

from lorapub.core.identity import SessionKey
from lorapub.core.commands import AuthorizeDispatch, BeginClose, BindFirst, CloseAndRelease
from lorapub.core.session import Binding
from lorapub.errors import InvalidInput, LorapubError, SessionClosed
from lorapub.ports import EngineAdmin, Registry
from lorapub.runtime.runner import EffectRunner, OnEligible


def _failed(task: asyncio.Task) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


class LocalState(enum.Enum):
    OPEN = "OPEN"
    BOUND = "BOUND"
    FINALIZING = "FINALIZING"
    CLOSED = "CLOSED"


class StickyRouter:
    """Spreads sessions over engines; any engine serves any published version."""

    def __init__(self, engines: Mapping[str, EngineAdmin]) -> None:
        if not engines:
            raise InvalidInput("a router needs at least one engine")
        self._engines = list(engines.values())
        self._next = itertools.count()

    def pick(self, session: "Session") -> EngineAdmin:
        if session.engine is None:
            session.engine = self._engines[next(self._next) % len(self._engines)]
        return session.engine


class Session:
    def __init__(self, service: "SessionService", key: SessionKey) -> None:
        self.service = service
        self.key = key
        self.state = LocalState.OPEN
        self.binding: Binding | None = None
        self.engine: EngineAdmin | None = None
        self.requests = 0
        self._bind_task: asyncio.Task | None = None
        self._close_task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()

    # -- binding ------------------------------------------------------------
    async def _bind_once(self) -> Binding:
        result = await self.service.registry.handle(BindFirst(self.key))
        self.binding = result.reply
        if self.state is LocalState.OPEN:
            self.state = LocalState.BOUND
        return self.binding

    async def bind(self) -> Binding:
        """The session's one binding. A lost reply is retried with the same key: same answer."""
        if self.binding is not None:
            return self.binding
        if self.state in (LocalState.FINALIZING, LocalState.CLOSED):
            raise SessionClosed(f"session {self.key} is {self.state.value}; bind refused")
        if self._bind_task is None or _failed(self._bind_task):  # a failed bind may be retried: same answer
            self._bind_task = asyncio.get_running_loop().create_task(self._bind_once())
        return await asyncio.shield(self._bind_task)

    # -- dispatch -----------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One backend request (first turn, tool turn, legal retry, resume) on the bound version.

        It is sent once. An unknown outcome is raised to the caller, never resent here.
        """
        if self.state in (LocalState.FINALIZING, LocalState.CLOSED):
            raise SessionClosed(f"session {self.key} is {self.state.value}; dispatch refused")
        binding = await self.bind()
        await self.service.registry.handle(AuthorizeDispatch(self.key))  # refuses RECLAIMING versions
        engine = self.service.router.pick(self)
        body = dict(payload)
        body["lora_path"] = binding.lora_name

        async def dispatch() -> dict[str, Any]:
            # Checked where the request starts, with no suspension point before it: a close
            # that began while we awaited (or before this task ran) sees no new request.
            if self.state in (LocalState.FINALIZING, LocalState.CLOSED):
                raise SessionClosed(f"session {self.key} is {self.state.value}; dispatch refused")
            return await engine.generate(body)

        task = asyncio.get_running_loop().create_task(dispatch())
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        self.requests += 1
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # our caller was cancelled: let that propagate
            raise SessionClosed(f"session {self.key} closed; its in-flight request was aborted") from None

    # -- close --------------------------------------------------------------
    async def close(self) -> None:
        """Idempotent; concurrent callers share one close."""
        if self._close_task is None or _failed(self._close_task):  # e.g. the registry was unreachable
            self._close_task = asyncio.get_running_loop().create_task(self._close_once())
        await asyncio.shield(self._close_task)

    async def _close_once(self) -> None:
        self.state = LocalState.FINALIZING
        registry = self.service.registry
        await registry.handle(BeginClose(self.key))
        if self._bind_task is not None:
            try:
                await asyncio.shield(self._bind_task)
            except (LorapubError, asyncio.CancelledError):
                pass  # a bind that failed or never finished holds no ref
        for task in list(self._inflight):
            task.cancel()  # the engine adapter aborts the request on cancel (client disconnect)
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        result = await registry.handle(CloseAndRelease(self.key))
        self.state = LocalState.CLOSED
        self.service._forget(self)
        await self.service.control.run(result.effects)  # the released version may be reclaimable now


class SessionService:
    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        *,
        epoch: int,
        router: StickyRouter | None = None,
        on_eligible: OnEligible | None = None,
    ) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.epoch = epoch
        self.router = router or StickyRouter(self.engines)
        self.control = EffectRunner(registry, self.engines, on_eligible=on_eligible)
        self.sessions: dict[SessionKey, Session] = {}

    def session(self, session_id: str, nonce: str | None = None) -> Session:
        """The local record for a session lifecycle (OPEN; nothing is bound until the first generation)."""
        key = SessionKey(self.epoch, session_id, nonce or uuid.uuid4().hex[:16])
        found = self.sessions.get(key)
        if found is None:
            found = self.sessions[key] = Session(self, key)
        return found

    def _forget(self, session: Session) -> None:
        self.sessions.pop(session.key, None)
