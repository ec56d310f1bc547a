"""One object that wires registry, publisher, reclaimer and sessions for a fleet.

:class:`Deployment` is versioned publication. :func:`deploy` is the one switch
(``enable_versioned_lora_publication``): ``enabled=True`` gives a started
:class:`Deployment`, ``enabled=False`` the old overwrite path, its own type
(:class:`~lorapub.runtime.overwrite.OverwriteDeployment`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Mapping, Unpack, cast, overload

import attrs

from lorapub.core.identity import (
    MANAGED_PREFIX,
    VersionKey,
)
from lorapub.core.commands import ReadFleet, ReadSessionsOf, ReadState, RegisterEngine
from lorapub.core.version import VersionState
from lorapub.core.registry import (
    DEFAULT_CAPACITY,
    DEFAULT_LEASE_TTL,
    DEFAULT_TOMBSTONE_WINDOW,
    Fleet,
    RegistryState,
)
from lorapub.errors import (
    AlreadyStarted,
    DeploymentClosed,
    InvalidInput,
    LorapubError,
)
from lorapub.ports import (
    Clock,
    CopyStore,
    EngineAdmin,
    OverwriteAdmin,
    Registry,
    Routing,
    Transport,
)
from lorapub.events import Observer, PublishProgress
from lorapub.runtime.decision_log import DecisionLog
from lorapub.runtime.observers import ObservedRegistry, Observers, exposition_of
from lorapub.runtime.admission import (
    check_engines,
    close_adapter,
    check_admission,
    hand_transport,
    refuse_moved_options,
    release_adapter,
    transport_name,
)
from lorapub.runtime.overwrite import OverwriteDeployment
from lorapub.runtime.fleet import FleetView, incarnation_of
from lorapub.runtime.engines import Engines
from lorapub.runtime.membership import Drained, FleetMembership
from lorapub.runtime.publication_report import PublicationReport
from lorapub.runtime.publisher import Publisher
from lorapub.runtime.reclaimer import Reclaimer
from lorapub.runtime.tasks import TaskOwner
from lorapub.health import Health
from lorapub.runtime.reconciler import Reconciler
from lorapub.clock import RegistryClock, SystemClock
from lorapub.local_registry import LocalRegistry
from lorapub.runtime.runner import Deadlines
from lorapub.runtime.settings import DeploymentOptions, DeploymentSettings, check_copies
from lorapub.runtime.sessions import DEFAULT_IDLE_TTL, LIVE, Session, SessionService
from lorapub.runtime.status import LocalSession, Status, build_status
from lorapub.snapshot import DEFAULT_BUCKET_CAP, Snapshot

if TYPE_CHECKING:
    from lorapub.runtime.status_server import StatusServer

__all__ = ["Deployment", "DeploymentOptions", "DeploymentSettings", "deploy"]

#: The keyword options of Deployment that its settings value holds.
_SETTINGS = frozenset(attrs.fields_dict(DeploymentSettings))

log = logging.getLogger(__name__)


class Deployment:
    """Versioned publication: ``publish`` returns a :class:`PublicationReport`, ``session`` a :class:`Session`.

    ``capacity``: managed versions held at once (the RFC's 2 by default, and at least 2: the default
    holds one slot, a new version needs another), checked at start against what each engine can
    hold. ``max_lag``: a version more than that many commits behind the default is retiring, and
    its sessions move to the default at their next turn boundary (``on_stale="rebind"``, the default
    with ``max_lag`` set: every result names each turn's version), or get ``BINDING_STALE``
    (``on_stale="error"``, for a trainer that cannot take a trajectory spanning versions); None keeps
    a session on its version for life. It needs ``capacity >= max_lag + 2``
    (the default and the ``max_lag`` versions behind it, plus one loading): less is ``INVALID_INPUT``.
    ``idle_ttl``: a session with no generation for that long expires, even in a live worker.
    ``clock``: the one :class:`~lorapub.ports.Clock` ``start()`` hands every part: lease renewals and the
    lease deadlines of the registry made here, session idle ages, the reconcile interval, retries' backoff,
    a stalled attempt's age (default: the monotonic clock). A test's ``lorapub.testing.ManualClock`` drives
    them all without sleeping; what bounds a caller's wait on I/O (``deadlines``, ``timeout=``) stays real time.
    ``transport``: how bucket bytes reach the engines' own staging (a :class:`~lorapub.ports.Transport`,
    e.g. ``lorapub.adapters.sglang_wire``'s ``HTTPBytes()``, ``SameHostIPC()``, ``SharedDir(path)``,
    ``TorchDistributed()``), named once here and handed to every engine (None: the one they already
    use, HTTPBytes by default); an engine already given another one is :class:`InvalidInput`.
    ``canary_interval``: seconds between re-runs of each resident version's probe on each engine
    (None, the default: off); a drift marks the version suspect. ``avoid_suspect``: new sessions
    are refused (``VERSION_SUSPECT``) while the default is suspect; bound sessions keep their version.
    ``copies``: a :class:`~lorapub.ports.CopyStore` where this publishing process also keeps the frozen
    copy of every version sessions may still need, and from which it takes back, at start, what the
    process before it kept (a trainer's restart: it can still load them on an engine that joins or
    restarts). None, the default: the copies live and die with this process.
    ``settings``: the plain-valued options above as one :class:`DeploymentSettings`, passed whole instead
    of as keywords (the keywords build one: ``deployment.settings``); a bad value is ``INVALID_INPUT`` either way.
    """

    @refuse_moved_options  # Deployment(stash_dir=): a pointer to its replacement, not a bare TypeError
    def __init__(
        self,
        engines: Mapping[str, EngineAdmin],
        *,
        epoch: int | None = None,
        registry: Registry | None = None,
        auto_reclaim: bool = True,
        deadlines: Deadlines | None = None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP,
        transport: Transport | None = None,
        reclaim_retries: int = 5,
        reclaim_backoff: float = 1.0,
        lease_ttl: float | None = DEFAULT_LEASE_TTL,
        tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW,
        reconcile_interval: float | None = 5.0,
        stale_attempt_after: float | None = None,
        router: Routing | None = None,
        capacity: int | None = None,
        max_lag: int | None = None,
        on_stale: str | None = None,
        idle_ttl: float | None = DEFAULT_IDLE_TTL,
        own_engines: bool = True,
        name_prefix: str | None = None,
        observers: Iterable[Observer] = (),
        decision_log: bool = True,
        status: tuple[str, int] | None = None,
        status_token: str | None = None,
        canary_interval: float | None = None,
        avoid_suspect: bool = False,
        clock: Clock | None = None,
        copies: CopyStore | None = None,
        settings: DeploymentSettings | None = None,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in _SETTINGS}
        self.engines = check_engines(engines)
        #: every plain-valued option, checked (each keyword builds it; ``settings=`` passes it whole)
        self.settings = settings = DeploymentSettings.of(settings, options)
        settings.check_room(shared_registry=registry is not None)
        check_copies(copies)
        self.copies = copies
        self.epoch = settings.epoch
        self.registry = registry
        self.auto_reclaim = settings.auto_reclaim
        self.deadlines = settings.deadlines
        self.bucket_cap_bytes = settings.bucket_cap_bytes
        self.reclaim_retries = settings.reclaim_retries
        self.reclaim_backoff = settings.reclaim_backoff
        self.lease_ttl = settings.lease_ttl
        self.tombstone_window = settings.tombstone_window
        self.reconcile_interval = settings.reconcile_interval
        self.stale_attempt_after = settings.stale_attempt_after
        self.capacity = settings.capacity
        self.max_lag = settings.max_lag
        self._on_stale_asked = settings.on_stale  # None: the registry's rule for its max_lag
        self.on_stale = settings.stale_rule
        self.canary_interval = settings.canary_interval  # the canary (docs/provenance.md, "Canary"); None: off
        self.avoid_suspect = settings.avoid_suspect
        self.idle_ttl = settings.idle_ttl
        #: the one clock every part reads and sleeps on (start() hands it to each)
        self.clock: Clock = clock or SystemClock()
        self.own_engines = settings.own_engines  # close() closes the engine adapters too
        self.name_prefix = settings.name_prefix  # how versions are named on the engines (None: lorapub's default)
        # How generations reach engines: lorapub's sticky router by default, or e.g.
        # ``lorapub.adapters.sglang_router.RouterRouting`` behind the SGLang router.
        self.router = router
        # Every decision, as a lorapub.events value: the decision log (INFO lines on lorapub.decisions)
        # unless switched off, then the caller's observers (e.g. lorapub.adapters.prometheus.Metrics()).
        self.observers = Observers([*([DecisionLog()] if settings.decision_log else []), *observers])
        self.status_address = settings.status
        self.status_token = settings.status_token
        # last: a deployment refused for any other reason leaves no engine holding its transport
        self.transport = hand_transport(self.engines, transport)
        self.status_server: StatusServer | None = None
        self._started = False
        self._closed = False

    def __repr__(self) -> str:
        life = "closed" if self._closed else "started" if self._started else "not started"
        transport = f" transport={self.transport!r}" if self.transport is not None else ""
        return (f"<Deployment epoch={self.epoch} {life} engines={sorted(self.engines)}"
                f" capacity={self.capacity or DEFAULT_CAPACITY} max_lag={self.max_lag}{transport}>")

    async def start(self) -> "Deployment":
        """Connect to the registry (or create one), start the reconciler and lease renewals."""
        if self._started:
            raise AlreadyStarted("this Deployment is already started; a second start() would drop its live sessions")
        if self._closed:
            raise AlreadyStarted("this Deployment was closed; build a new one")
        try:
            base, fleet = await self._admit()
        except BaseException:
            # refused (an engine down, too small, a settings clash): nothing started, and no connection
            # is left open; the adapters stay usable, so start() may be called again once it is fixed
            await self._release_engines()
            raise
        # The parts, each given what it works with, in the order they depend on each other: one
        # owner of background tasks, one fleet view (engine lives, who holds what, the wakeups), the
        # registry as the parts see it (every decision timed and told to the observers).
        self.tasks = TaskOwner("lorapub")
        self.engines = Engines(self.engines)  # one live engine set, shared by every part (add/remove_engine)
        registry = ObservedRegistry(base, self.observers, clock=self.clock)
        self.fleet = FleetView(registry, self.engines, deadline=self.deadlines.begin, clock=self.clock)
        self.reclaimer = Reclaimer(
            registry, self.engines, self.deadlines, auto=self.auto_reclaim, retries=self.reclaim_retries,
            backoff=self.reclaim_backoff, fleet=self.fleet, tasks=self.tasks, clock=self.clock,
        )
        self.publisher = Publisher(
            registry, self.engines, epoch=self.epoch, deadlines=self.deadlines,
            bucket_cap_bytes=self.bucket_cap_bytes, on_eligible=self.reclaimer.on_eligible,
            source_factory=None if self.transport is None else self.transport.source, fleet=self.fleet,
            tasks=self.tasks, events=self.observers, transport_name=transport_name(self.transport),
            copies=self.copies, clock=self.clock,
        )
        self.sessions = SessionService(
            registry, self.engines, epoch=self.epoch, on_eligible=self.reclaimer.on_eligible,
            router=self.router, idle_ttl=self.idle_ttl, fleet=self.fleet, tasks=self.tasks, events=self.observers,
            clock=self.clock,
        )
        self.reconciler = Reconciler(
            registry, self.engines, deadlines=self.deadlines, reclaimer=self.reclaimer,
            publisher=self.publisher, interval=self.reconcile_interval,
            stale_attempt_after=self.stale_attempt_after, fleet=self.fleet, tasks=self.tasks, events=self.observers,
            sessions_here=self.sessions.counts, canary_interval=self.canary_interval, clock=self.clock,
        )
        self.membership = FleetMembership(
            registry, self.engines, fleet=self.fleet, reconciler=self.reconciler, sessions=self.sessions,
            deadlines=self.deadlines, transport=self.transport, own_engines=self.own_engines,
            on_eligible=self.reclaimer.on_eligible, events=self.observers, clock=self.clock,
        )
        if self.copies is not None:  # what a publishing process before this one kept (a restart)
            try:
                taken = self.publisher.frozen.take_back(await asyncio.to_thread(self.copies.items))
            except Exception as e:  # noqa: BLE001 - it publishes all the same; a version only the old process
                taken = []          # kept cannot be loaded on a new engine (health names it reprovisioning)
                log.warning("the copy store could not be read (%s: %s); no frozen copy was taken back",
                            type(e).__name__, e)
            if taken:
                log.info("took back the frozen copies of %s (published before this process started)",
                         ", ".join(sorted(map(str, taken))))
        self._started = True
        self.fleet.update(fleet)
        self.reconciler.start()
        self.sessions.start_renewals(fleet.lease_ttl)  # the registry's setting wins (it may be shared)
        if self.status_address is not None:
            await self._serve_status(*self.status_address)
        return self

    async def _admit(self) -> tuple[Registry, Fleet]:
        """The registry (made here unless one was given) and the checks every engine must pass first."""
        if self.registry is None:
            incarnations = {name: await incarnation_of(name, engine, self.deadlines.begin)
                            for name, engine in self.engines.items()}
            self.registry = LocalRegistry(
                self.epoch, incarnations, self.capacity or DEFAULT_CAPACITY, lease_ttl=self.lease_ttl,
                tombstone_window=self.tombstone_window, max_lag=self.max_lag, on_stale=self.on_stale,
                name_prefix=self.name_prefix or MANAGED_PREFIX, avoid_suspect=self.avoid_suspect,
                clock=RegistryClock(self.clock),  # its leases' deadlines move with the deployment's clock
            )
        fleet: Fleet = (await self.registry.handle(ReadFleet())).reply
        self._check_shared_settings(fleet)
        for name, engine in sorted(self.engines.items()):
            await check_admission(name, engine, fleet, self.deadlines.begin)
        return self.registry, fleet

    async def _release_engines(self) -> None:
        if self.own_engines:
            for name, engine in self.engines.items():
                await release_adapter(name, engine)

    async def _serve_status(self, host: str, port: int) -> None:
        from lorapub.runtime.status_server import StatusServer  # aiohttp's server: only when asked for

        exposition = exposition_of(self.observers)
        server = StatusServer(host, port, status=lambda probe: self.status(probe=probe), exposition=exposition,
                              token=self.status_token, health=lambda: self.reconciler.health)
        try:
            self.status_server = await server.start()
        except OSError as e:
            # refused: what started stops, and the adapters stay usable for the Deployment built next
            await self._shutdown()
            await self._release_engines()
            raise InvalidInput(f"the status endpoint cannot bind {host}:{port}: {e}; pick another port "
                               "(0: any free one)") from None

    def _check_shared_settings(self, fleet: Fleet) -> None:
        """A registry made elsewhere (shared) has its own settings: a different one asked here is an error."""
        asked: dict[str, tuple[object, object]] = {"capacity": (self.capacity, fleet.capacity),
                                                    "name_prefix": (self.name_prefix, fleet.name_prefix)}
        if self.max_lag is not None:
            asked.update(max_lag=(self.max_lag, fleet.max_lag))
        if self._on_stale_asked is not None:  # left out: the shared registry's own (made by the same rule)
            asked.update(on_stale=(self._on_stale_asked, fleet.on_stale))
        if self.avoid_suspect:
            asked.update(avoid_suspect=(True, fleet.avoid_suspect))
        for name, (value, has) in asked.items():
            if value is not None and value != has:
                raise InvalidInput(
                    f"{name}={value!r} was asked for, but the registry this deployment uses has {name}={has!r} "
                    "(a shared registry's settings are made once, where it is created)"
                )

    async def close(self, grace: float = 5.0) -> None:
        """Stop the reconciler, lease renewals and every background task (a reclaim still waiting
        for running requests after ``grace`` s is left to the next reconciler: the registry keeps
        it RECLAIMING), then close the engine adapters (``own_engines=False``: left open).
        Sessions left open expire after their TTL."""
        if not self._started:
            self._closed = True
            await self._close_engines()
            return
        await self._shutdown(grace)
        await self._close_engines()

    async def _shutdown(self, grace: float = 5.0) -> None:
        """Stop every part start() started; the engine adapters are left to the caller."""
        self._started, self._closed = False, True
        self.sessions.closed = True
        if self.status_server is not None:
            await self.status_server.close()
        await self.publisher.close(grace)  # each cancelled publication aborts and cleans its attempt
        await self.reconciler.stop()  # a pass that runs finishes first
        await self.reclaimer.settle(timeout=grace)
        await self.tasks.close()  # every background task left (lease renewals, retried closes) is joined

    async def _close_engines(self) -> None:
        if not self.own_engines:
            return
        for name, engine in self.engines.items():
            await close_adapter(name, engine)

    async def __aenter__(self) -> "Deployment":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def reconcile(self, wait: float = 2.0) -> Health:
        """Run one reconciliation pass now: detect restarts and lost versions, expire leases, start
        cleanups, reclaims, orphan unloads and re-provisioning (in the background). Waits up to
        ``wait`` s for what it started, then returns the typed health report (what still blocks,
        and why); an unload that waits for long requests never holds it longer."""
        self._require_started()
        await self.sessions.expire_idle()  # this process's sessions idle past idle_ttl first: what they kept is free
        health = await self.reconciler.run_once()
        if health.healthy or not wait:
            return health
        await self.reconciler.settle(wait)
        await self.reclaimer.wait(wait)
        return await self.reconciler.run_once()

    @property
    def closed(self) -> bool:
        """``close()`` ran: this deployment starts nothing more."""
        return self._closed

    @property
    def health(self) -> Health:
        """The health report of the last reconciliation pass (before the first one ends, a report whose
        one blocker is ``starting``; ``await reconcile()`` runs a pass now)."""
        self._require_started()
        return self.reconciler.health

    async def status(self, *, probe: bool = True) -> Status:
        """What the deployment holds now, as one :class:`~lorapub.runtime.status.Status`: each version
        with what blocks its reclaim by name, each engine with what it holds against what it should
        (``probe=False``: the last pass's view, no engine asked), attempts in flight, health."""
        registry = self._require_started()
        fleet: Fleet = (await registry.handle(ReadFleet())).reply
        sessions_of = {h.version: (await registry.handle(ReadSessionsOf(h.version))).reply
                       for h in fleet.slots if h.state is VersionState.RETIRED and h.session_refs}
        inventories = None
        if probe:
            lives = await self.fleet.lives(deadline=min(2.0, self.deadlines.begin))
            # an engine that lists nothing it holds is told apart from one that holds nothing
            inventories = {name: life.error if life.error is not None else
                           (life.inventory if life.inventory is not None else life.incarnation or "?")
                           for name, life in lives.items()}
        idle_now = self.clock.monotonic()  # the clock session ages and first_seen are read from
        local = {s.key.session_id: LocalSession(s.key.session_id, str(s.binding.version) if s.binding else None,
                                                s.state.value, idle_now - s.last_active, s.group)
                 for s in list(self.sessions.sessions.values()) if s.state in LIVE}
        return build_status(fleet, source="deployment", sessions_of=sessions_of, inventories=inventories,
                            health=self.reconciler.health, local=local, first_seen=self.reconciler.first_seen(),
                            monotonic=idle_now)

    async def recover(self) -> list[str]:
        """Abort an attempt whose publisher is known to be dead, and drive its cleanup."""
        self._require_started()
        return await self.publisher.recover()

    def _require_started(self) -> Registry:
        """The registry ``start()`` made or took; refused before ``start()`` and after ``close()``."""
        if not self._started or self.registry is None:
            if self._closed:  # one code for everything a closed deployment refuses
                raise DeploymentClosed("this Deployment is closed; it starts nothing more — publish and open "
                                       "sessions on a new one")
            raise InvalidInput("call `await deployment.start()` first")
        return self.registry

    async def state(self) -> RegistryState:
        """The registry's whole state (for reports and tests; sessions never need it)."""
        state: RegistryState = (await self._require_started().handle(ReadState())).reply
        return state

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for the background work: reclaims started by session closes, commits and the
        reconciler, and the reconciler's repairs (at most ``timeout`` s)."""
        self._require_started()
        await self.reconciler.settle(timeout)
        await self.reclaimer.wait(timeout)

    async def refresh_engines(self) -> dict[str, str]:
        """Tell the registry about engines that restarted (their READYs and stashes are void).
        An engine that does not answer is left as the registry knows it (a begin to it fails)."""
        registry = self._require_started()
        found = {}
        for name in list(self.engines):  # add_engine may change the set while an engine answers
            try:
                found[name] = await self.fleet.incarnation(name)
            except LorapubError as e:
                log.warning("incarnation of %s unknown before publishing: %s", name, e)
                continue
            result = await registry.handle(RegisterEngine(name, found[name]))
            if result.effects:
                await self.publisher.control.run(result.effects)
        return found

    async def publish(self, snapshot: Snapshot, version_id: str, *, wait: float = 0.0,
                      progress: Callable[[PublishProgress], None] | None = None) -> PublicationReport:
        """Publish ``snapshot`` as ``version_id`` on every engine, then make it the default.

        ``wait``: seconds to wait for a free slot (or for a running attempt to end) instead of
        failing at once with ``CAPACITY_ERROR``/``PUBLICATION_BLOCKED``; a newer publication
        supersedes a waiting one (``SUPERSEDED``, naming it). The report says how long it waited
        and for what. ``progress``: called with a :class:`~lorapub.events.PublishProgress` (bytes
        sent per engine, and the phase) as the publication moves.

        The same id with the same snapshot again is a safe retry (a lost reply, a restarted trainer):
        it joins or returns that publication (``reused=True``), with the version's state now —
        ``RETIRED`` once a newer version became the default, which a retry never undoes. Another
        snapshot under the id is ``VERSION_CONFLICT``; an id already reclaimed, ``VERSION_RECLAIMING``."""
        registry = self._require_started()
        if not wait:
            await self._settle_briefly(registry)
        await self.refresh_engines()
        try:
            report = await self.publisher.publish(snapshot, version_id, wait=wait, progress=progress)
        finally:
            self.reconciler.kick()  # health follows now, not at the next interval's pass
        await self.fleet.refresh()  # sessions see the new default now
        return report

    #: How long a publish call without ``wait`` that finds no free slot gives an unload already under
    #: way to free one (docs/freshness.md): a finishing unload takes milliseconds; one held by a running
    #: request is not waited for, and the call is refused (CAPACITY_ERROR) as it would be at once.
    SETTLE_UNLOAD = 1.0

    async def _settle_briefly(self, registry: Registry) -> None:
        if not self.reclaimer.tasks.of_kind("reclaim"):
            return
        try:
            fleet: Fleet = (await registry.handle(ReadFleet())).reply
        except LorapubError:  # not known: the short wait below, then the reserve says what holds the slots
            pass
        else:
            if len(fleet.slots) < fleet.capacity and not fleet.active and not fleet.cleaning:
                return  # a slot is free now: nothing to wait for
        await self.reclaimer.wait(self.SETTLE_UNLOAD)

    async def reclaim(self, version: VersionKey | str) -> VersionState:
        """Reclaim one RETIRED, unused version now (what ``auto_reclaim`` does in the background):
        a :class:`~lorapub.VersionKey`, or a version id of this deployment's epoch."""
        self._require_started()
        if isinstance(version, str):
            version = VersionKey(self.epoch, version)
        elif not isinstance(version, VersionKey):
            raise InvalidInput(
                f"reclaim takes a version id (str) or a lorapub.VersionKey, not {type(version).__name__}: "
                f"e.g. deployment.reclaim('step41') or deployment.reclaim(VersionKey({self.epoch}, 'step41'))"
            )
        return await self.reclaimer.reclaim(version)

    def session(self, session_id: str, nonce: str | None = None, *, group: str | None = None) -> Session:
        """The session ``session_id`` (the same object while it is live). With ``group``, every
        member binds the version the group bound at its first generation (a GRPO prompt group,
        the n>1 children of one prompt), and the group keeps it while any member is open."""
        self._require_started()
        return self.sessions.session(session_id, nonce, group=group)

    # -- an elastic fleet (runtime/membership.py; docs/elastic.md) --------------------------------
    async def add_engine(self, engine: EngineAdmin, *, timeout: float | None = 60.0) -> None:
        """Add ``engine`` to the running deployment; returns once it holds every version sessions may
        use and takes traffic (checked against ``capacity`` and the protected prefix first)."""
        self._require_started()
        await self.membership.add(engine, timeout=timeout)

    async def drain_engine(self, name: str, *, timeout: float | None = 300.0) -> Drained:
        """No new binding goes to ``name``; its sessions move to another holder of their version at their
        next turn boundary. Returns when no request of this deployment runs there (DrainTimeout names the
        sessions still there after ``timeout`` s)."""
        self._require_started()
        return await self.membership.drain(name, timeout=timeout)

    async def remove_engine(self, name: str, *, timeout: float | None = 30.0) -> None:
        """Remove a drained (or unreachable) engine: reclaims stop waiting for it, its adapter is closed."""
        self._require_started()
        await self.membership.remove(name, timeout=timeout)


@overload
async def deploy(
    engines: Mapping[str, EngineAdmin], *, epoch: int, enabled: Literal[True], stash_dir: str | None = None,
    **options: Unpack[DeploymentOptions],
) -> Deployment: ...


@overload
async def deploy(
    engines: Mapping[str, OverwriteAdmin], *, epoch: int, enabled: Literal[False], stash_dir: str | None = None,
    **options: Unpack[DeploymentOptions],
) -> OverwriteDeployment: ...


@overload
async def deploy(
    engines: Mapping[str, EngineAdmin] | Mapping[str, OverwriteAdmin], *, epoch: int, enabled: bool,
    stash_dir: str | None = None, **options: Unpack[DeploymentOptions],
) -> Deployment | OverwriteDeployment: ...


async def deploy(
    engines: Mapping[str, EngineAdmin] | Mapping[str, OverwriteAdmin], *, epoch: int, enabled: bool,
    stash_dir: str | None = None, **options: Unpack[DeploymentOptions],
) -> Deployment | OverwriteDeployment:
    """The one switch. ``enabled=True``: a started :class:`Deployment` over
    :class:`~lorapub.ports.EngineAdmin` engines. ``enabled=False``: the old overwrite path
    over :class:`~lorapub.ports.OverwriteAdmin` engines (``options`` concern versioned
    publication only and are not used there; ``stash_dir``, the folder the old path writes
    each adapter to for its engines to load, concerns it only: versioned publication stages
    inside the engines)."""
    # which protocol the engines follow is checked where they are taken (a typed refusal names it)
    if enabled:
        return await Deployment(cast(Mapping[str, EngineAdmin], engines), epoch=epoch, **options).start()
    return await OverwriteDeployment(cast(Mapping[str, OverwriteAdmin], engines), stash_dir=stash_dir).start()
