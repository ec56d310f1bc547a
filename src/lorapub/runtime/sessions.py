"""Session service: bind once on first generation, carry the exact lora_path forever.

Each session owns one shared bind task; every waiter awaits it through
``asyncio.shield`` so cancelling one request never cancels the binding or
causes a second pick. Close runs once: FINALIZING (no new dispatch) ->
begin_close -> wait for the bind task, abort in-flight requests -> release
the session ref exactly once -> drop the local record.

A session's ref is held under a lease: the service renews the leases of all its
live sessions in one batch every ``lease_ttl / 3`` seconds, so a worker that dies
lets its sessions expire. Requests go to the session's sticky engine while that
engine holds the bound version; after a restart they go to another engine that
holds it (the prefix cache is lost once: the KV cost of a restart) until the
restarted engine is re-provisioned.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import uuid
from typing import Any, Mapping

import logging
import time
from typing import Awaitable, Callable

from lorapub.core.identity import SessionKey, VersionKey, new_nonce
from lorapub.core.commands import AuthorizeDispatch, BeginClose, BindFirst, CloseAndRelease, RenewLeases
from lorapub.core.session import Binding
from lorapub.errors import EngineUnavailable, InvalidInput, LorapubError, SessionClosed, SessionExpired, VersionMissing
from lorapub.ports import EngineAdmin, Registry
from lorapub.runtime.runner import EffectRunner, OnEligible

log = logging.getLogger(__name__)


def _failed(task: asyncio.Task) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


class LocalState(enum.Enum):
    OPEN = "OPEN"
    BOUND = "BOUND"
    FINALIZING = "FINALIZING"
    CLOSED = "CLOSED"
    EXPIRED = "EXPIRED"


class StickyRouter:
    """Spreads sessions over engines and keeps each on its engine (its prefix cache) while
    that engine holds the session's version; otherwise moves it to one that does."""

    def __init__(self, engines: Mapping[str, EngineAdmin]) -> None:
        if not engines:
            raise InvalidInput("a router needs at least one engine")
        self._engines = list(engines.values())
        self._next = itertools.count()

    def pick(self, session: "Session", holders: frozenset[str] | None = None) -> EngineAdmin:
        """``holders``: the engines that hold the session's version now (None: all of them)."""
        if session.engine is not None and (holders is None or session.engine.name in holders):
            return session.engine
        candidates = [e for e in self._engines if holders is None or e.name in holders]
        if not candidates:
            raise EngineUnavailable(
                f"no engine holds {session.binding.version if session.binding else 'the bound version'} right now "
                "(its engines restarted and it is being re-provisioned); retry the request later",
                session=session.key,
            )
        session.engine = candidates[next(self._next) % len(candidates)]
        return session.engine


class Session:
    def __init__(self, service: "SessionService", key: SessionKey) -> None:
        self.service = service
        self.key = key
        self.state = LocalState.OPEN
        self.binding: Binding | None = None
        self.engine: EngineAdmin | None = None
        self.requests = 0
        self.lease_seen = time.monotonic()  # when the registry last confirmed this session's lease
        self._bind_task: asyncio.Task | None = None
        self._close_task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()

    # -- binding ------------------------------------------------------------
    async def _bind_once(self) -> Binding:
        result = await self.service.registry.handle(BindFirst(self.key))
        self.lease_seen = time.monotonic()
        self.binding = result.reply
        if self.state is LocalState.OPEN:
            self.state = LocalState.BOUND
        return self.binding

    def _refuse_if_ended(self, what: str) -> None:
        if self.state is LocalState.EXPIRED:
            raise SessionExpired(
                f"session {self.key} expired (its lease was not renewed in time) and its version ref was "
                f"released; {what} refused — start a new session", session=self.key,
            )
        if self.state in (LocalState.FINALIZING, LocalState.CLOSED):
            raise SessionClosed(f"session {self.key} is {self.state.value}; {what} refused")

    async def bind(self) -> Binding:
        """The session's one binding. A lost reply is retried with the same key: same answer."""
        if self.binding is not None:
            return self.binding
        self._refuse_if_ended("bind")
        if self._bind_task is None or _failed(self._bind_task):  # a failed bind may be retried: same answer
            self._bind_task = asyncio.get_running_loop().create_task(self._bind_once())
        return await asyncio.shield(self._bind_task)

    # -- dispatch -----------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One backend request (first turn, tool turn, legal retry, resume) on the bound version.

        It is sent once. An unknown outcome is raised to the caller, never resent here.
        """
        self._refuse_if_ended("dispatch")
        # After the first bind a generation costs no registry round trip: the session's own ref
        # keeps its version from being reclaimed, and its lease is renewed in batches. Only a
        # session whose lease was not confirmed for half its TTL (a worker that stalled or lost
        # the registry) asks first, so a late request on an expired session is refused.
        binding = await self.bind()
        ttl = self.service.lease_ttl
        if ttl is not None and time.monotonic() - self.lease_seen > ttl / 2:
            try:
                await self.service.registry.handle(AuthorizeDispatch(self.key))
            except SessionExpired:
                self.state = LocalState.EXPIRED
                raise
        body = dict(payload)
        body["lora_path"] = binding.lora_name
        try:
            return await self._dispatch(binding, body)
        except VersionMissing as missing:
            # A definite refusal before anything ran: the engine lost the version (a restart the
            # fleet view has not seen yet). Learn the truth, then send it once to a holder.
            engine = self.engine
            try:  # the failure path may ask the registry: is this session still entitled to it?
                await self.service.registry.handle(AuthorizeDispatch(self.key))
            except SessionExpired:
                self.state = LocalState.EXPIRED
                raise
            await self.service.engine_suspect(engine.name if engine is not None else None)
            holders = self.service.holders(binding.version)
            if holders is not None and engine is not None and engine.name in holders:
                raise  # the fleet still says it holds it: report the engine's own answer
            log.warning("%s: %s lost %s; sending the request to a holder", self.key, getattr(engine, "name", "?"), binding.version)
            try:
                return await self._dispatch(binding, body)
            except VersionMissing:
                raise missing from None

    async def _dispatch(self, binding: Binding, body: dict[str, Any]) -> dict[str, Any]:
        engine = self.service.router.pick(self, self.service.holders(binding.version))

        async def dispatch() -> dict[str, Any]:
            # Checked where the request starts, with no suspension point before it: a close
            # that began while we awaited (or before this task ran) sees no new request.
            self._refuse_if_ended("dispatch")
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
        try:
            await asyncio.shield(self._close_task)
        except LorapubError:
            # The close may have been applied with its reply lost: the reconciler derives what
            # is left (a reclaim) from the registry's state, whatever the caller does next.
            self.service.kick()
            raise

    async def _close_once(self) -> None:
        if self.state is not LocalState.EXPIRED:
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
        # Set by the deployment: the reconciler's latest view, a kick, a targeted probe.
        self._holders: Mapping[VersionKey, frozenset[str]] | None = None
        self.kick: Callable[[], None] = lambda: None
        self.probe: Callable[[str | None], Awaitable[None]] | None = None
        self._renewer: asyncio.Task | None = None
        self.renewals = 0
        self.lease_ttl: float | None = None

    # -- the fleet view (no registry round trip per request) -----------------------
    def update_holders(self, holders: Mapping[VersionKey, frozenset[str]]) -> None:
        self._holders = dict(holders)

    def holders(self, version: VersionKey) -> frozenset[str] | None:
        """Engines holding ``version`` as last seen; None when not known (every engine)."""
        if self._holders is None:
            return None
        return self._holders.get(version)

    async def engine_suspect(self, engine: str | None) -> None:
        """An engine refused a version it should hold: probe it now (a restart) and refresh."""
        if self.probe is not None:
            await self.probe(engine)
        self.kick()

    # -- leases -----------------------------------------------------------------------
    def start_renewals(self, lease_ttl: float | None) -> None:
        self.lease_ttl = lease_ttl
        if lease_ttl is None or self._renewer is not None:
            return
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop(lease_ttl / 3), name="lorapub-leases")

    async def stop_renewals(self) -> None:
        task, self._renewer = self._renewer, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _renew_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.renew_leases()
            except LorapubError as e:  # the registry is away: the next round tries again
                log.warning("lease renewal failed (%s); retrying in %.1fs", e, every)

    async def renew_leases(self) -> int:
        """Renew every live local session's lease in one call; mark the ones the registry expired."""
        live = [s for s in self.sessions.values() if s.state in (LocalState.OPEN, LocalState.BOUND, LocalState.FINALIZING)]
        if not live:
            return 0
        sent = time.monotonic()
        gone = set((await self.registry.handle(RenewLeases(tuple(s.key for s in live)))).reply)
        self.renewals += 1
        for s in live:
            if s.key in gone and s.binding is not None:  # unknown-but-unbound sessions hold nothing yet
                s.state = LocalState.EXPIRED
            else:
                s.lease_seen = max(s.lease_seen, sent)
        return len(live)

    def session(self, session_id: str, nonce: str | None = None) -> Session:
        """The local record for a session lifecycle (OPEN; nothing is bound until the first generation)."""
        key = SessionKey(self.epoch, session_id, nonce or new_nonce(time.time(), uuid.uuid4().hex[:16]))
        found = self.sessions.get(key)
        if found is None:
            found = self.sessions[key] = Session(self, key)
        return found

    def _forget(self, session: Session) -> None:
        self.sessions.pop(session.key, None)
