"""Session service: bind once on first generation, carry the exact lora_path forever.

A session binds once (one shared, shielded bind task) and closes once; its ref is held under a lease
renewed in batches while it is active; its requests stick to an engine that holds its version; with
``max_lag`` a stale one gets :class:`~lorapub.errors.BindingStale` or moves on (docs/freshness.md).
See docs/design.md, "Two layers of refs".
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import uuid
from typing import Any, Mapping

from lorapub.core.commands import (
    AuthorizeDispatch,
    BeginClose,
    BindFirst,
    CloseAndRelease,
    ExpireSessions,
    OpenSession,
    Rebind,
    RenewLeases,
)
from lorapub.core.identity import SessionKey, VersionKey, check_id, new_nonce
from lorapub.core.session import Binding
from lorapub.errors import (
    BindingStale,
    DeploymentClosed,
    EngineUnavailable,
    GroupClosed,
    InvalidInput,
    InvalidTransition,
    LorapubError,
    ProvenanceMismatch,
    SessionClosed,
    SessionExpired,
    VersionMissing,
)
from lorapub.events import Observer, ProvenanceMismatched, RequestDispatched, SessionBound, SessionRebound, SessionsExpired, SessionStale
from lorapub.ports import Clock, EngineAdmin, GenerationTarget, Registry, RoutedSession, Routing
from lorapub.clock import SystemClock
from lorapub.runtime.fleet import FleetView
from lorapub.runtime.provenance import attest, stamp_said
from lorapub.runtime.runner import EffectRunner, OnEligible
from lorapub.runtime.tasks import TaskOwner
from lorapub.runtime.engines import shared

__all__ = ["DEFAULT_IDLE_TTL", "LocalState", "LIVE", "StickyRouter", "Session", "SessionService"]

log = logging.getLogger(__name__)

#: Seconds without a generation after which a session expires even in a live worker (None: never).
DEFAULT_IDLE_TTL = 600.0


def _target_name(target: GenerationTarget | None) -> str:  # "?": no generation went anywhere yet
    return "?" if target is None else target.name


class _Overtaken(Exception):
    """The binding became stale between this turn's check and its send (nothing was sent)."""


def _failed(task: asyncio.Task[Any]) -> bool:  # any task: its result is not read
    return task.done() and (task.cancelled() or task.exception() is not None)


class LocalState(enum.Enum):
    OPEN = "OPEN"
    BOUND = "BOUND"
    FINALIZING = "FINALIZING"
    CLOSED = "CLOSED"
    EXPIRED = "EXPIRED"
    STALE = "STALE"  # its version fell more than max_lag behind: it generates no more


LIVE = frozenset({LocalState.OPEN, LocalState.BOUND})
IDLE_EXPIRES = LIVE | {LocalState.STALE}  # what idle_ttl expires: a stale session never closed too


class StickyRouter:
    """Spreads sessions over engines and keeps each on the engine it last used (its prefix cache)
    while that engine holds the session's version; otherwise picks one that does. It reads the
    session and writes nothing: the session records where its generation went."""

    def __init__(self, engines: Mapping[str, EngineAdmin]) -> None:
        if not engines:
            raise InvalidInput("a router needs at least one engine")
        self._engines = shared(engines)  # the deployment's live set: engines that join or leave count
        self._next = itertools.count()

    def pick(self, session: RoutedSession, holders: frozenset[str] | None = None) -> GenerationTarget:
        """``holders``: the engines that hold the session's version now (None: all of them)."""
        engines = list(self._engines.values())
        last = session.engine
        if last is not None and last in engines and (holders is None or last.name in holders):
            return last
        candidates = [e for e in engines if holders is None or e.name in holders]
        if not candidates:
            raise EngineUnavailable(
                f"no engine holds {session.binding.version if session.binding else 'the bound version'} right now "
                "(its engines restarted or lost it, and it is being re-provisioned); retry the request later",
                session=session.key,
            )
        return candidates[next(self._next) % len(candidates)]


class Session:
    """One trajectory's binding. Use it as ``async with deployment.session(id) as s:`` (closed on
    exit, whatever happens), or call :meth:`close` yourself."""

    def __init__(self, service: "SessionService", key: SessionKey, group: str | None = None) -> None:
        self.service = service
        self.key = key
        self.group = group
        self.state = LocalState.OPEN
        self.binding: Binding | None = None
        self.engine: GenerationTarget | None = None  # where its last generation went (the router reads it)
        self.requests = 0
        #: (version, first request it served): one entry, plus one per explicit rebind
        self.provenance: list[tuple[VersionKey, int]] = []
        #: the version that served each of its turns, in the order they returned
        self.turn_versions: list[str] = []
        self.lease_seen = self.service.clock.monotonic()  # when the registry last confirmed this session's lease
        self.last_active = self.service.clock.monotonic()  # the last generation's start or end (the idle clock)
        self._bind_task: asyncio.Task[Binding] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[tuple[dict[str, Any], int, int]]] = set()
        self._stale_details: dict[str, Any] = {}  # what the refusal that made it STALE said

    def __repr__(self) -> str:
        bound = f" bound={self.binding.version}" if self.binding is not None else ""
        group = f" group={self.group!r}" if self.group is not None else ""
        return f"<Session {self.key.session_id!r} {self.state.value}{bound}{group} requests={self.requests}>"

    async def __aenter__(self) -> "Session":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- binding ------------------------------------------------------------
    async def open(self) -> "Session":
        """Record the session in the registry now (a group member counts from here: its group
        keeps its version while any opened member is open). Optional otherwise: the first
        generation does it."""
        self._refuse_if_ended("open")
        if self.binding is None:
            await self.service.registry.handle(OpenSession(self.key, group=self.group))
            self.lease_seen = self.service.clock.monotonic()
        return self

    def _adopt(self, binding: Binding) -> Binding:
        if self.binding is None or binding.version != self.binding.version:
            self.provenance.append((binding.version, self.requests))
        self.binding = binding
        self.service.fleet.note_binding(binding)
        return binding

    async def _bind_once(self) -> Binding:
        try:
            result = await self.service.registry.handle(BindFirst(self.key, group=self.group))
        except BindingStale as stale:
            self._became_stale(stale)
            raise
        except GroupClosed:
            # a closed group never takes a member: this session ends here, holding nothing
            self.state = LocalState.CLOSED
            self.service.forget(self)
            raise
        self.lease_seen = self.service.clock.monotonic()
        binding = self._adopt(result.reply)
        if self.state is LocalState.OPEN:
            self.state = LocalState.BOUND
            self.service.events(SessionBound(self.key.session_id, binding.version, binding.group,
                                             self.service.fleet.lag(binding)))
        return binding

    def _refuse_if_ended(self, what: str) -> None:
        if self.service.closed:  # no lease is renewed and nothing is reconciled any more
            raise DeploymentClosed(f"session {self.key}'s deployment was closed; {what} refused — open sessions on a "
                                   "new Deployment", session=self.key)
        if self.state is LocalState.EXPIRED:
            raise SessionExpired(
                f"session {self.key} expired (its lease was not renewed in time, or it was idle for its idle TTL) "
                f"and its version ref was released; {what} refused — start a new session", session=self.key,
            )
        if self.state is LocalState.STALE:
            fleet = self.service.fleet
            # a member refused at its first bind has no binding: its refusal said which version and how far behind
            told = self._stale_details
            raise BindingStale(
                f"session {self.key} is stale: its version fell more than max_lag commits behind the default and "
                f"its ref was released; {what} refused — start a new session", session=self.key,
                version=self.binding.version if self.binding else told.get("version"),
                lag=fleet.lag(self.binding) if self.binding else told.get("lag"), max_lag=fleet.max_lag,
                default=fleet.default,
            )
        if self.state in (LocalState.FINALIZING, LocalState.CLOSED):
            raise SessionClosed(f"session {self.key} is {self.state.value}; {what} refused — open a new session "
                                "(dep.session(id) again starts a new lifecycle of the id)", session=self.key)

    def _became_stale(self, stale: BindingStale | None = None) -> None:
        if stale is not None:
            self._stale_details = dict(stale.details)
        if self.state in LIVE:
            self.state = LocalState.STALE
            self.service.events(SessionStale(self.key.session_id, self.binding.version if self.binding else None))

    async def bind(self) -> Binding:
        """The session's one binding. A lost reply is retried with the same key: same answer. A session
        that ended (closed, expired, stale) refuses: its old binding may name a version reclaimed since."""
        self._refuse_if_ended("bind")
        if self.binding is not None:
            return self.binding
        if self._bind_task is None or _failed(self._bind_task):  # a failed bind may be retried: same answer
            self._bind_task = asyncio.get_running_loop().create_task(self._bind_once())
        return await asyncio.shield(self._bind_task)

    async def _fresh(self, binding: Binding, stale: BindingStale | None = None) -> Binding:
        """The binding this turn dispatches with: the same one, unless its version is retiring
        (BINDING_STALE, or with on_stale="rebind" the default, at this turn boundary)."""
        if stale is None and not self.service.fleet.is_stale(binding):
            return binding
        if self.service.fleet.on_stale != "rebind":
            self._became_stale(stale)
            if stale is not None:
                raise stale
            self._refuse_if_ended("dispatch")
        while self._inflight:
            # The turn boundary: requests of this session still running on its version end first,
            # so it is never served by two versions at once (nor sent again on the stale one).
            await asyncio.wait(set(self._inflight))
            self._refuse_if_ended("dispatch")
            if self.binding is not None and self.binding != binding:  # another turn rebound it meanwhile
                return await self._fresh(self.binding)
        try:
            result = await self.service.registry.handle(Rebind(self.key))
        except BindingStale as e:
            self._became_stale(e)
            raise
        new = self._adopt(result.reply)
        if new.version != binding.version:
            self.service.events(SessionRebound(self.key.session_id, new.version, new.rebinds))
        return new

    # -- dispatch -----------------------------------------------------------
    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]:
        """One backend request (first turn, tool turn, legal retry, resume) on the bound version.

        It is sent once. An unknown outcome is raised to the caller, never resent here. The
        result carries ``result["lorapub"]``: the version that served it and its lag (commits
        behind the default at dispatch).
        """
        if not isinstance(payload, Mapping):
            raise InvalidInput(
                f"generate takes a mapping (SGLang's /generate body, e.g. {{'input_ids': [...], 'sampling_params': "
                f"{{...}}}}), not {type(payload).__name__}"
            )
        self._refuse_if_ended("dispatch")
        self.last_active = self.service.clock.monotonic()
        # After the first bind a generation costs no registry round trip: the session's own ref
        # keeps its version from being reclaimed, and its lease is renewed in batches. Only a
        # session whose lease was not confirmed for half its TTL (a worker that stalled or lost
        # the registry) asks first, so a late request on an expired session is refused.
        binding = await self._fresh(await self.bind())
        ttl = self.service.lease_ttl
        if self.service.fleet.gone(binding) or (ttl is not None and self.service.clock.monotonic() - self.lease_seen > ttl / 2):
            binding = await self._authorized(binding)
        try:
            return await self._send(binding, payload)
        except VersionMissing as missing:
            # A definite refusal before anything ran: the engine lost the version (a restart the
            # fleet view has not seen yet), or reclaims it (the version retired meanwhile).
            # Learn the truth, then send it once to a holder (or on the rebound version).
            engine = self.engine
            fresh = await self._authorized(binding)
            if fresh.version != binding.version:
                return await self._send(fresh, payload)
            # every engine: more than one may have restarted, and the refusing one may have lost just it
            await self.service.engine_suspect(None, binding)
            holders = self.service.fleet.holders(binding.version)
            if holders is not None and engine is not None and engine.name in holders:
                raise  # the fleet still says it holds it: report the engine's own answer
            if holders is not None and not holders:
                raise self._unavailable(binding) from missing
            log.warning("%s: %s lost %s; sending the request to a holder", self.key, _target_name(engine), binding.version)
            try:
                return await self._send(binding, payload)
            except VersionMissing:
                await self.service.engine_suspect(None, binding)
                if not self.service.fleet.holders(binding.version):
                    raise self._unavailable(binding) from missing
                raise missing from None
        finally:
            self.last_active = self.service.clock.monotonic()

    def _unavailable(self, binding: Binding) -> EngineUnavailable:
        return EngineUnavailable(
            f"no engine holds {binding.version} right now (its engines restarted or lost it, and it is being re-provisioned); "
            "the session keeps its version: retry the request later", session=self.key, version=binding.version,
        )

    async def _authorized(self, binding: Binding) -> Binding:
        """Ask the registry whether this session may still dispatch (expired? stale?)."""
        try:
            await self.service.registry.handle(AuthorizeDispatch(self.key))
        except SessionExpired:
            self.state = LocalState.EXPIRED
            raise
        except InvalidTransition as e:
            if not e.details.get("unknown"):
                raise
            # it was bound: the registry expired it and, a tombstone window later, forgot it
            self.state = LocalState.EXPIRED
            raise SessionExpired(
                f"session {self.key} expired long ago (its worker renewed no lease for longer than lease_ttl "
                "plus the tombstone window) and the registry no longer knows it; dispatch refused — start a "
                "new session", session=self.key) from None
        except BindingStale as stale:
            return await self._fresh(binding, stale)
        self.lease_seen = self.service.clock.monotonic()
        return binding

    async def _send(self, binding: Binding, payload: Mapping[str, object]) -> dict[str, Any]:
        body = dict(payload)
        while True:
            binding = await self._fresh(binding)
            body["lora_path"] = binding.lora_name
            try:
                out, lag, rebinds = await self._dispatch(binding, body)
                break
            except _Overtaken:
                continue  # a newer default was learnt since the check: decide this turn again
        stamp = await self._attest(binding, out)
        self.turn_versions.append(str(binding.version))
        if isinstance(out, dict):
            out["lorapub"] = {
                "version": str(binding.version), "version_id": binding.version.version_id, "lag": lag,
                "lora_name": binding.lora_name, "rebinds": rebinds,
                # > 0: its group was moved to a newer version, so its members' samples span versions
                "group_rebinds": binding.group_rebinds,
                "stamp": stamp,  # what the engine attests served this turn (None: it does not stamp)
                # the version of each turn of the session so far, this one last: a trajectory that spans
                # versions (a rebind) says so in every result, without the caller keeping count
                "turn_versions": list(self.turn_versions),
            }
        return out

    async def _attest(self, binding: Binding, out: Any) -> dict[str, Any] | None:
        """Every turn's stamp is checked against the binding: a mismatch is never a success."""
        target = _target_name(self.engine)
        try:
            return await attest(self.service.fleet, target, binding, out)
        except ProvenanceMismatch as e:
            self.service.events(ProvenanceMismatched(
                str(self.key), binding.version, target, str(e.details.get("reason")), stamp_said(e)))
            raise

    async def _dispatch(self, binding: Binding, body: dict[str, object]) -> tuple[dict[str, Any], int, int]:
        """The engine's answer, with the binding's lag and the session's rebinds when the request was
        sent (a rebind by a later turn while it runs is not this request's)."""
        engine = self.engine = self.service.router.pick(self, self.service.fleet.holders(binding.version))

        async def dispatch() -> tuple[dict[str, Any], int, int]:
            # Checked where the request starts, with no suspension point before it: a close
            # that began while we awaited (or before this task ran) sees no new request, and a
            # default learnt meanwhile (another session's bind) is judged against max_lag.
            self._refuse_if_ended("dispatch")
            fleet = self.service.fleet
            if fleet.is_stale(binding):
                raise _Overtaken
            lag, rebinds = fleet.lag(binding), len(self.provenance) - 1
            self.requests += 1
            self.service.events(RequestDispatched(binding.version, lag))
            return await engine.generate(body), lag, rebinds

        task = asyncio.get_running_loop().create_task(dispatch())
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # our caller was cancelled: let that propagate
            # the request's connection was dropped; SGLang aborts a request whose client went away
            raise SessionClosed(f"session {self.key} was closed while this request ran: lorapub dropped the request "
                                "(the engine stops it when it sees the connection close) and its tokens are lost — "
                                "retry the turn in a new session", session=self.key) from None

    @property
    def busy(self) -> bool:
        """A request of it is running."""
        return bool(self._inflight)

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
            self.service.fleet.kick()
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
        self.service.forget(self)
        await self.service.control.run(result.effects)  # the released version may be reclaimable now


class SessionService:
    """Every session of this process. Its collaborators are given, never set later: the registry,
    the engines, the fleet view (who holds what, engine lives, the reconciler's wakeup), the
    routing of generations, and the owner of its background tasks."""

    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        *,
        epoch: int,
        fleet: FleetView | None = None,
        tasks: TaskOwner | None = None,
        router: Routing | None = None,
        on_eligible: OnEligible | None = None,
        idle_ttl: float | None = DEFAULT_IDLE_TTL,
        events: Observer | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.events: Observer = events or (lambda event: None)
        #: what idle and lease ages are read from (a test's manual clock drives idle_ttl without sleeping)
        self.clock: Clock = clock or SystemClock()
        self.registry = registry
        self.engines = shared(engines)  # the deployment's live set: membership changes it
        self.epoch = epoch
        self.fleet = fleet if fleet is not None else FleetView(registry, self.engines, deadline=5.0, clock=self.clock)
        self.tasks = tasks if tasks is not None else TaskOwner("lorapub-sessions")
        self.router: Routing = router or StickyRouter(self.engines)
        self.control = EffectRunner(registry, self.engines, on_eligible=on_eligible)
        self.sessions: dict[SessionKey, Session] = {}
        self._by_id: dict[str, Session] = {}
        self.idle_ttl = idle_ttl
        self.closed = False  # its deployment was closed: every session refuses new turns
        self.renewals = 0
        self.idle_expired = 0
        self.lease_ttl: float | None = None

    def counts(self) -> tuple[int, int]:
        """(open sessions, groups they belong to) of this process."""
        live = [s for s in self.sessions.values() if s.state in LIVE]
        return len(live), len({s.group for s in live if s.group is not None})

    def registry_time(self) -> float:
        """The registry's time as this process carries it forward (a session's nonce is judged in it,
        never this host's wall clock)."""
        return self.fleet.registry_time()

    async def engine_suspect(self, engine: str | None, binding: Binding | None = None) -> None:
        """An engine refused a version it should hold: probe it now (a restart, or the version lost
        without one), refresh the fleet view and ask the reconciler for a pass."""
        if binding is None:
            await self.fleet.probe(self.control.run, engine)
        else:
            await self.fleet.probe(self.control.run, engine, binding.version, binding.lora_name)
        self.fleet.kick()

    # -- leases -----------------------------------------------------------------------
    def start_renewals(self, lease_ttl: float | None) -> None:
        self.lease_ttl = lease_ttl
        periods = [p for p in (lease_ttl, self.idle_ttl) if p is not None]
        if periods:
            self.tasks.spawn(self._renew_loop(min(periods) / 3), name="leases", key="leases")

    async def _renew_loop(self, every: float) -> None:
        while True:
            await self.clock.sleep(every)  # the deployment's clock: a test's manual clock drives renewals
            try:
                await self.renew_leases()
            except LorapubError as e:  # the registry is away: the next round tries again
                log.warning("lease renewal failed (%s); retrying in %.1fs", e, every)

    def idle(self, now: float | None = None) -> list[Session]:
        """Live sessions with no generation for ``idle_ttl`` and none running; and stale ones (cut by
        BINDING_STALE) that their rollout never closed: the registry still has their record, this process
        the local one, until they expire too."""
        if self.idle_ttl is None:
            return []
        now = self.clock.monotonic() if now is None else now
        return [s for s in self.sessions.values()
                if s.state in IDLE_EXPIRES and not s.busy and now - s.last_active > self.idle_ttl]

    async def expire_idle(self) -> int:
        """Expire the idle sessions (their refs are released at once): a session the rollout code
        never closed keeps no version for longer than ``idle_ttl``."""
        idle = self.idle()
        if not idle:
            return 0
        result = await self.registry.handle(ExpireSessions(tuple(s.key for s in idle)))
        for s in idle:
            if s.state in IDLE_EXPIRES:
                s.state = LocalState.EXPIRED
            self.forget(s)
        self.events(SessionsExpired(len(idle), "idle", tuple(s.key.session_id for s in idle[:8])))
        self.idle_expired += len(idle)
        # a released version may be reclaimable now: its reclaim starts here, as a close's does (not
        # at the next reconcile pass, which a deployment with reconcile_interval=None never runs)
        await self.control.run(result.effects)
        self.fleet.kick()
        return len(idle)

    async def renew_leases(self) -> int:
        """Expire the idle sessions, retry the closes whose answer was lost, then renew every other
        live local session's lease in one call; mark the ones the registry expired. A session whose
        close is pending is never renewed: if its close never lands, its lease runs out."""
        await self.expire_idle()
        self.retry_closes()
        live = [s for s in self.sessions.values() if s.state in LIVE]
        if not live or self.lease_ttl is None:
            return 0
        sent = self.clock.monotonic()
        gone = set((await self.registry.handle(RenewLeases(tuple(s.key for s in live)))).reply)
        self.renewals += 1
        expired = []
        for s in live:
            if s.key in gone and s.binding is not None:  # unknown-but-unbound sessions hold nothing yet
                s.state = LocalState.EXPIRED
                expired.append(s.key.session_id)
            else:
                s.lease_seen = max(s.lease_seen, sent)
        if expired:
            self.events(SessionsExpired(len(expired), "lease", tuple(expired[:8])))
        return len(live)

    def retry_closes(self) -> int:
        """Start again, in the background, every close that failed (a lost reply, the registry away):
        the caller's ``close()`` raised, the session's ref must still be released."""
        failed = [s for s in self.sessions.values()
                  if s.state is LocalState.FINALIZING and s._close_task is not None and _failed(s._close_task)]
        for s in failed:
            self.tasks.spawn(self._retry_close(s), name=f"close-{s.key}", key=("close", s.key))
        return len(failed)

    async def _retry_close(self, session: Session) -> None:
        try:
            await session.close()
            log.info("session closed: session=%s (retried)", session.key)
        except LorapubError as e:
            log.warning("retried close of %s failed (%s); trying again at the next renewal", session.key, e)

    def session(self, session_id: str, nonce: str | None = None, *, group: str | None = None) -> Session:
        """The local record for a session lifecycle (OPEN; nothing is bound until the first
        generation). Asked again for a live session id (no ``nonce``), it returns the same
        :class:`Session`; a ``nonce`` of the caller's own names one lifecycle exactly."""
        check_id("session_id", session_id)
        if group is not None:
            check_id("group", group)
        if nonce is None:
            live = self._by_id.get(session_id)
            found = live if live is not None and live.key in self.sessions and live.state in LIVE else None
        else:
            found = self.sessions.get(SessionKey(self.epoch, session_id, nonce))
        if found is None:
            key = SessionKey(self.epoch, session_id, nonce or new_nonce(self.registry_time(), uuid.uuid4().hex[:16]))
            found = self.sessions[key] = Session(self, key, group)
        elif group != found.group:
            raise InvalidInput(
                f"session {session_id!r} is live in group {found.group!r}, not {group!r}; close it before starting "
                "another lifecycle of that id"
            )
        self._by_id[session_id] = found
        return found

    def forget(self, session: Session) -> None:
        self.sessions.pop(session.key, None)
        if self._by_id.get(session.key.session_id) is session:
            del self._by_id[session.key.session_id]
