"""An elastic fleet: engines join a running deployment, drain, and leave it.

A joining engine takes no traffic until the reconciler loaded every needed version there; a draining
one takes no new binding and its sessions move to another holder at a turn boundary; a removed one is
forgotten by reclaims and cleanups. The decisions are the registry's (AddEngine, DrainEngine, RemoveEngine).
See docs/elastic.md, "Growing and shrinking the fleet".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TypeVar

import attrs

from lorapub.core.attempt import Phase
from lorapub.core.commands import AddEngine, DrainEngine, RemoveEngine, Returns
from lorapub.core.registry import Fleet, Membership, Result
from lorapub.errors import (
    DrainTimeout,
    EngineUnavailable,
    InvalidInput,
    LorapubError,
    OutcomeUnknown,
    PublicationBlocked,
    UnknownEngine,
)
from lorapub.ports import Clock, EngineAdmin, Registry, ReportsInventory, TakesTransport, Transport
from lorapub.runtime.engines import Engines
from lorapub.events import EngineDrained, EngineDraining, EngineJoining, EngineRemoved, Observer
from lorapub.runtime.admission import (
    answer_within,
    check_admission,
    check_operations,
    close_adapter,
    name_of,
    release_adapter,
    with_lifecycle,
)
from lorapub.runtime.fleet import FleetView, incarnation_of
from lorapub.clock import SystemClock
from lorapub.runtime.reconciler import Reconciler
from lorapub.runtime.retry import RetryPolicy
from lorapub.runtime.runner import Deadlines, EffectRunner, OnEligible
from lorapub.runtime.sessions import LIVE, SessionService

R_ = TypeVar("R_")  # a command's reply type

__all__ = ["Drained", "FleetMembership"]

log = logging.getLogger(__name__)

#: How often a join, a drain or a removal looks again at what it waits for. These waits and their
#: ``timeout=`` are on real time, not the deployment's clock: they bound how long a caller waits for
#: engines and requests to move (I/O), which no manual clock makes faster.
POLL = 0.05


@attrs.frozen
class Drained:
    """What :meth:`FleetMembership.drain` waited for: ``moved`` sessions of this process left the
    engine at a turn boundary (they went to another holder of their version)."""

    engine: str
    seconds: float
    moved: int


class FleetMembership:
    """Adds, drains and removes engines of a started deployment (``Deployment.add_engine``,
    ``drain_engine``, ``remove_engine`` delegate here). The engine set it changes is the one every
    part of the deployment shares."""

    def __init__(
        self,
        registry: Registry,
        engines: Engines,
        *,
        fleet: FleetView,
        reconciler: Reconciler,
        sessions: SessionService,
        deadlines: Deadlines,
        transport: Transport | None = None,
        own_engines: bool = True,
        on_eligible: OnEligible | None = None,
        events: Observer | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.events: Observer = events or (lambda event: None)
        self.registry = registry
        self.engines = engines
        self.fleet = fleet
        self.reconciler = reconciler
        self.sessions = sessions
        self.deadlines = deadlines
        self.transport = transport
        self.own_engines = own_engines
        self.control = EffectRunner(registry, engines, None, deadlines, on_eligible=on_eligible, left=fleet.left)
        self._lock = asyncio.Lock()  # one change of the engine set at a time in this process
        # a lost membership reply is replayed: waits of 50 ms, doubling, at most 1 s
        self.retry_policy = RetryPolicy(tries=5, first=0.05, factor=2.0, cap=1.0)
        self.clock: Clock = clock or SystemClock()  # the deployment's: a replayed command's backoff is slept on it

    async def _fleet(self) -> Fleet:
        return await self.fleet.refresh()

    # -- join ------------------------------------------------------------------------------
    def _check_adapter(self, offered: object) -> tuple[str, EngineAdmin]:
        name = name_of(offered)  # the adapter names itself here: this is its admission
        check_operations(name, offered)
        # one without close()/release() is admitted with no-ops for them (the same wrapper when it comes again)
        engine = with_lifecycle(offered, self.engines.get(name))
        takes = isinstance(engine, TakesTransport)
        if self.transport is not None and not takes:
            raise InvalidInput(f"engine {name} takes no transport, but this deployment's engines receive buckets "
                               f"by {self.transport!r}: every engine of a deployment receives them one way")
        if self.transport is None and takes and self.engines and not any(
                isinstance(e, TakesTransport) for e in self.engines.values()):
            raise InvalidInput(f"engine {name} takes a transport, but this deployment's engines are sent "
                               "safetensors bytes: every engine of a deployment receives them one way")
        return name, engine

    async def add(self, engine: EngineAdmin, *, timeout: float | None = 60.0) -> Membership:
        """Add ``engine``: checked (capacity, protected prefix, transport), registered JOINING, loaded
        with every version sessions may use, then SERVING (returned). ``timeout`` s: EngineUnavailable
        if it is not loaded by then (it stays JOINING and keeps being loaded; add it again to wait)."""
        name, engine = self._check_adapter(engine)
        async with self._lock:
            fleet = await self._fleet()
            known = self.engines.get(name)
            if known is not None and known is not engine and name in fleet.engines and name not in fleet.draining:
                raise InvalidInput(f"engine {name} is already a member (another adapter object); remove it first")
            try:
                await check_admission(name, engine, fleet, self.deadlines.begin)
                incarnation = await incarnation_of(name, engine, self.deadlines.begin)
            except BaseException:
                if self.own_engines and known is not engine:  # refused: it leaks no connection, may come again
                    await release_adapter(name, engine)
                raise
            if self.transport is not None and isinstance(engine, TakesTransport):
                engine.use_transport(self.transport)  # one given another transport earlier refuses, naming itself
            self.engines[name] = engine  # before the registry may target it
            try:
                result = await self._add(name, incarnation)
            except LorapubError as e:
                if known is None and not isinstance(e, OutcomeUnknown):  # refused: the registry never took it
                    self.engines.pop(name, None)
                # unknown (or cancelled): the registry may have made it a member, so its adapter stays,
                # and the reconciler loads what it lacks as for any joining member
                raise
            self.events(EngineJoining(name, incarnation, result.reply.value))
            await self.control.run(result.effects)
        return await self._wait_joined(name, timeout)

    async def _replayed(self, command: Returns[R_], engine: str, what: str, advice: str) -> Result[R_]:
        """A membership command, a lost reply replayed: each is idempotent (adding the same engine and life
        again, draining a draining member, removing a member already gone change nothing)."""
        last: Exception | None = None
        async for _ in self.retry_policy.attempts(self.clock):
            try:
                return await self.registry.handle(command)
            except OutcomeUnknown as e:
                last = e
                log.warning("%s: reply lost (%s); replaying it", what, e)
        raise OutcomeUnknown(f"{what}: the registry did not answer after {self.retry_policy.tries} tries ({last}); "
                             + advice, engine=engine)

    async def _add(self, name: str, incarnation: str) -> Result[Membership]:
        return await self._replayed(
            AddEngine(name, incarnation), name, f"add_engine {name}",
            "it may be a joining member already, loaded in the background — call add_engine with the same engine "
            "again (adding a member again is idempotent)")

    async def _wait_joined(self, name: str, timeout: float | None) -> Membership:
        deadline = None if timeout is None else time.monotonic() + timeout  # real time: a caller's wait and its polls (see POLL)
        while True:
            fleet = await self._fleet()
            if name not in fleet.engines:
                raise UnknownEngine(f"engine {name} left the fleet while it joined", engine=name)
            if name not in fleet.joining:
                self.reconciler.kick()
                return Membership.DRAINING if name in fleet.draining else Membership.SERVING
            # the reconciler loads what it lacks (as on an engine that restarted), in the background
            await self.reconciler.run_once()
            await self.reconciler.settle(POLL * 10)
            if deadline is not None and time.monotonic() > deadline:  # real time: a caller's wait and its polls (see POLL)
                fleet = await self._fleet()
                if name not in fleet.joining:
                    continue
                lacks = sorted(str(k) for e, k in fleet.missing if e == name)
                raise EngineUnavailable(
                    f"engine {name} joined but takes no traffic yet: it lacks {', '.join(lacks) or 'a version a running publication makes'}"
                    f" (health: {self.reconciler.health.describe()}); it keeps joining in the background — only the "
                    "process that published a version keeps the frozen copy it is loaded from", engine=name,
                )
            await asyncio.sleep(POLL)  # a poll on real time (see POLL)

    # -- drain -----------------------------------------------------------------------------
    def _sessions_on(self, name: str) -> tuple[list[str], int]:
        """This process's sessions whose next generation would go to ``name`` (their version has no
        other holder), and its requests running there."""
        staying, running = [], 0
        for s in list(self.sessions.sessions.values()):
            if s.engine is None or s.engine.name != name:
                continue
            if s.busy:
                running += len(s._inflight)
            if s.state in LIVE and s.binding is not None:
                holders = self.fleet.holders(s.binding.version)
                if holders is not None and name in holders:
                    staying.append(s.key.session_id)
        return staying, running

    async def _engine_refs(self, name: str, fleet: Fleet) -> int:
        """Requests running on this deployment's versions there, as the engine counts them (0 where
        it keeps no inventory or does not answer)."""
        engine = self.engines.get(name)
        if not isinstance(engine, ReportsInventory):
            return 0
        life = await self.fleet.life(name)
        if life.inventory is None:
            return 0
        ours = set(fleet.lora_names.values())
        return sum(a.refs for n, a in life.inventory.adapters.items() if n in ours)

    async def drain(self, name: str, *, timeout: float | None = 300.0) -> Drained:
        """Drain ``name``: no new binding goes there; sessions move to another holder of their version
        at their next turn boundary. Returns when no request of this deployment runs there and no session
        of this process would go back; DrainTimeout after ``timeout`` s naming the sessions still there
        (it stays draining)."""
        started = time.monotonic()  # real time: a caller's wait and its polls (see POLL)
        async with self._lock:
            await self._replayed(DrainEngine(name), name, f"drain_engine {name}",
                                 "it may be draining already — call drain_engine again (draining is idempotent)")
        self.events(EngineDraining(name))
        fleet = await self._fleet()
        before = {s.key for s in self.sessions.sessions.values() if s.engine is not None and s.engine.name == name}
        while True:
            staying, running = self._sessions_on(name)
            refs = 0 if staying or running else await self._engine_refs(name, fleet)
            if not staying and not running and not refs:
                moved = sum(1 for s in self.sessions.sessions.values()
                            if s.key in before and s.engine is not None and s.engine.name != name)
                self.events(EngineDrained(name, time.monotonic() - started, moved))  # real time (see POLL)
                return Drained(name, time.monotonic() - started, moved)  # real time: a caller's wait and its polls (see POLL)
            if timeout is not None and time.monotonic() - started > timeout:  # real time (see POLL)
                raise DrainTimeout(
                    f"engine {name} still serves {len(staying)} session(s) ({', '.join(staying[:8]) or '-'}) and "
                    f"{running + refs} running request(s) after {timeout:g}s: their version has no other holder yet, or "
                    "their turns are long; it stays draining (no new binding goes there) — drain again to wait more",
                    engine=name, sessions=staying, requests=running + refs,
                )
            await asyncio.sleep(POLL)  # a poll on real time (see POLL)
            fleet = await self._fleet()

    # -- removal ---------------------------------------------------------------------------
    async def remove(self, name: str, *, timeout: float | None = 30.0) -> None:
        """Remove ``name``: a draining member (once no running publication still needs it), or an
        unreachable one (forced: a publication that still needs it aborts). A reachable member that is
        not draining is EngineNotDrained; an unknown name UnknownEngine."""
        started = time.monotonic()  # real time: a caller's wait and its polls (see POLL)
        while True:
            cleaning = False  # what blocks the removal is an aborted attempt whose cleanup there is unconfirmed
            async with self._lock:
                fleet = await self._fleet()
                if name not in fleet.engines and name in self.engines:
                    # not a member, yet this process holds its adapter: a removal whose reply was lost (the
                    # registry applied it), or an add it never applied. Removing is idempotent: finish it here.
                    reachable = False
                    engine = self._forget(name, reachable)
                    break
                if name not in fleet.engines:
                    raise UnknownEngine(f"engine {name} is not a member of this fleet "
                                        f"(members: {', '.join(sorted(fleet.engines))})", engine=name)
                # a silent engine is told within the removal's own timeout, not the begin deadline
                remaining = None if timeout is None else max(0.05, started + timeout - time.monotonic())  # real time (see POLL)
                ask = self.deadlines.begin if remaining is None else min(self.deadlines.begin, remaining / 2)
                reachable = name in self.engines and (await self.fleet.life(name, inventory=False,
                                                                            deadline=ask)).answered
                try:
                    result = await self._replayed(
                        RemoveEngine(name, force=not reachable), name, f"remove_engine {name}",
                        "it may have left the fleet already — call remove_engine again (removing is idempotent)")
                except PublicationBlocked as e:
                    if timeout is not None and time.monotonic() - started > timeout:  # real time (see POLL)
                        raise
                    result = None  # an attempt still needs it: it ends, or its cleanup is retried now (below)
                    cleaning = e.details.get("phase") == Phase.ABORTED.value
                except UnknownEngine:
                    # a replay after a lost reply: our removal landed, and what it started the reconciler finds
                    engine = self._forget(name, reachable)
                    break
                if result is not None:
                    engine = self._forget(name, reachable)
                    await self.control.run(result.effects)
                    break
            if cleaning:  # with no background reconciler nobody else retries that cleanup
                await self.reconciler.repair_soon()
            await asyncio.sleep(POLL)  # a poll on real time (see POLL)
        await self._fleet()
        self.reconciler.kick()  # a reclaim that waited for it may finish now
        if engine is not None:
            # a request of this process still running there (sent before the drain, or the member was removed
            # by another process of the run) ends before its connection closes: cut, its outcome is unknown
            await self._requests_end(name, None if timeout is None else started + timeout)
        if engine is not None and reachable:
            await self._unload_ours(name, engine, fleet)
        if engine is not None and self.own_engines:
            await close_adapter(name, engine, "closing removed engine")

    async def _requests_end(self, name: str, deadline: float | None) -> None:
        """Wait (up to ``deadline``) until no request of this process runs on ``name``."""
        while running := self._sessions_on(name)[1]:
            if deadline is not None and time.monotonic() > deadline:  # real time: a caller's wait and its polls (see POLL)
                log.warning("remove_engine %s: %d request(s) of this process still run there; its connection "
                            "closes under them", name, running)
                return
            await asyncio.sleep(POLL / 5)  # a poll on real time (see POLL)

    def _forget(self, name: str, reachable: bool) -> EngineAdmin | None:
        """The registry no longer counts ``name``: its adapter leaves this process's engine set, and every
        call still waiting on it (an aborted publication's) stops now."""
        engine = self.engines.pop(name, None)
        self.fleet.removed(name)
        self.events(EngineRemoved(name, reachable))
        return engine

    async def _unload_ours(self, name: str, engine: EngineAdmin, fleet: Fleet) -> None:
        """Best effort: unload this deployment's versions from a removed engine that answers, so it
        leaves clean (it may join again later, or serve another deployment)."""
        if not isinstance(engine, ReportsInventory):
            return
        try:
            held = (await answer_within(name, "its inventory", self.deadlines.begin, engine.inventory())).adapters
            for lora_name in sorted(set(fleet.lora_names.values()) & set(held)):
                async with asyncio.timeout(self.deadlines.reclaim):
                    await engine.reclaim(lora_name, f"removed-{name}-{lora_name}")
        except Exception as e:  # noqa: BLE001 - it left the fleet: what it keeps is no longer ours
            log.warning("unloading this deployment's versions from removed engine %s: %s", name, e)
