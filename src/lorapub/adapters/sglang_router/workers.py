"""The router's workers, watched: :class:`WorkerWatcher` polls the router's list and each worker's
incarnation, reports joins, leaves and restarts as typed events, and takes a restarted, new or
unreachable worker out of rotation until an injected ``heal(name)`` re-provisioned it;
:func:`reconcile_heal` is that heal for a lorapub ``Deployment``.
See docs/router.md, "Joins, leaves, restarts: the re-provisioning handshake".
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping, Protocol

import attrs

from lorapub.adapters.sglang_router.client import SGLangRouter, engine_name, normalize_url
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.errors import EngineError, EngineUnavailable, InvalidInput, LorapubError, OutcomeUnknown
from lorapub.ports import EngineAdmin

if TYPE_CHECKING:
    from lorapub.health import Health

__all__ = [
    "WorkerJoined", "WorkerLeft", "WorkerRestarted", "WorkerUnreachable", "WorkerQuarantined", "WorkerHealed",
    "HealFailed", "WorkerReadmitted", "WorkerEvent", "WorkerStatus", "Heal", "reconcile_heal", "WorkerWatcher",
]

log = logging.getLogger("lorapub.router")


@attrs.frozen
class WorkerJoined:
    """A URL appeared in the router's list (``initial``: it was there when watching began)."""

    name: str
    url: str
    incarnation: str | None
    initial: bool


@attrs.frozen
class WorkerLeft:
    """A URL the watcher did not remove vanished from the router's list."""

    name: str
    url: str


@attrs.frozen
class WorkerRestarted:
    name: str
    url: str
    old_incarnation: str
    new_incarnation: str


@attrs.frozen
class WorkerUnreachable:
    """The worker's state route failed ``probe_failures`` times in a row."""

    name: str
    url: str
    error: str


@attrs.frozen
class WorkerQuarantined:
    """Taken out of the router until it is healed (``reason``: restarted, joined, unreachable)."""

    name: str
    url: str
    reason: str


@attrs.frozen
class WorkerHealed:
    name: str
    url: str
    incarnation: str


@attrs.frozen
class HealFailed:
    """One handshake attempt failed; the worker stays out and is retried after ``retry_in`` s."""

    name: str
    url: str
    error: str
    attempt: int
    retry_in: float


@attrs.frozen
class WorkerReadmitted:
    """Healed and back in the router's rotation."""

    name: str
    url: str
    incarnation: str


WorkerEvent = (
    WorkerJoined | WorkerLeft | WorkerRestarted | WorkerUnreachable | WorkerQuarantined | WorkerHealed
    | HealFailed | WorkerReadmitted
)


@attrs.define
class WorkerStatus:
    """What the watcher knows of one worker.

    ``state``: ``serving`` (in rotation, incarnation known), ``quarantined`` (out of the
    router, the handshake is running or waiting to retry), ``left`` (gone from the router
    by someone else's hand).
    """

    name: str
    url: str
    incarnation: str | None = None
    state: str = "serving"
    heal_attempts: int = 0
    last_error: str | None = None
    probe_failures: int = 0


Heal = Callable[[str], Awaitable[object]]


class Reconciles(Protocol):
    """What :func:`reconcile_heal` uses of a :class:`~lorapub.Deployment`."""

    async def reconcile(self) -> Health: ...


class ElasticFleet(Protocol):
    """What the watcher uses of a started :class:`~lorapub.Deployment` whose engine set follows the
    router's list (``WorkerWatcher(elastic=...)``)."""

    @property
    def engines(self) -> Mapping[str, EngineAdmin]: ...

    async def add_engine(self, engine: EngineAdmin, *, timeout: float | None = ...) -> None: ...

    async def drain_engine(self, name: str, *, timeout: float | None = ...) -> object: ...

    async def remove_engine(self, name: str, *, timeout: float | None = ...) -> None: ...


def reconcile_heal(deployment: Reconciles) -> Heal:
    """``heal(name)`` for a :class:`~lorapub.Deployment`: the deployment's own re-provisioning.

    One reconciliation pass (``deployment.reconcile()``) registers the worker's current
    incarnation with the registry (its old life's READYs, stashes and holdings are void)
    and loads, pinned and directly on the worker, every version sessions may still use
    from the frozen copy this process keeps. The heal succeeds only if the worker is then
    routable (holds every such version); otherwise :class:`EngineUnavailable` with the
    deployment's health report, and the watcher keeps the worker out and retries.
    """

    async def heal(name: str) -> None:
        health = await deployment.reconcile()
        fleet = health.fleet
        if fleet is None or name not in fleet.engines or name not in fleet.routable:
            lost = sorted(str(key) for engine, key in (fleet.missing if fleet else ()) if engine == name)
            raise EngineUnavailable(
                f"{name} does not hold every version sessions may use yet (missing: {', '.join(lost) or '-'}; "
                f"health: {health.describe()})",
                engine=name,
            )

    return heal


class WorkerWatcher:
    """Watches the router's workers; runs the re-provisioning handshake.

    ``heal(name)`` must leave the worker holding every version sessions still need (the
    deployment's re-provisioning); it is awaited with the worker out of rotation. The
    handshake, per worker, one at a time: ``remove_worker(url)`` -> wait until the worker
    answers -> ``await heal(name)`` -> the incarnation must not have changed meanwhile ->
    ``add_worker(url)``. Any failure: :class:`HealFailed`, the worker stays out, retried
    after ``backoff * 2**(attempt-1)`` s (at most ``max_backoff``).

    Build with :meth:`discover` (the first listing: engines for the deployment, no
    handshake for workers already serving), then :meth:`start` the polling loop, or drive
    :meth:`poll_once` yourself.

    ``elastic``: a started :class:`~lorapub.Deployment` whose fleet follows the router's list
    (docs/elastic.md): a worker that joins is added to it (``add_engine``, its heal: loaded with
    every needed version before it is put in rotation), a worker that leaves is drained when it
    answers (``drain_timeout`` s at most) and removed (``remove_engine``). None (the default): the
    deployment's engine set stays as it was built, as before.
    """

    def __init__(
        self,
        router: SGLangRouter,
        *,
        heal: Heal | None = None,
        on_event: Callable[[WorkerEvent], object] | None = None,
        names: Mapping[str, str] | None = None,
        interval: float = 1.0,
        probe_failures: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        engine_factory: Callable[[str, str], SGLangWireEngine] | None = None,
        probe_timeout: float = 5.0,
        request_timeout: float | None = None,
        elastic: ElasticFleet | None = None,
        drain_timeout: float | None = 300.0,
    ) -> None:
        self.router = router
        self.heal = heal
        self.elastic = elastic  # a Deployment whose engine set follows the router's list
        self.drain_timeout = drain_timeout
        self._leaves: dict[str, asyncio.Task[None]] = {}
        self.on_event = on_event
        self.names = {normalize_url(u): n for u, n in (names or {}).items()}
        self.interval = interval
        self.probe_failures = probe_failures
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._factory = engine_factory or self._default_factory(probe_timeout, request_timeout)
        self.engines: dict[str, SGLangWireEngine] = {}  # name -> engine, every worker ever seen
        self.workers: dict[str, WorkerStatus] = {}  # url -> status
        self.events: list[WorkerEvent] = []
        self._handshakes: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._discovered = False
        self.last_error: str | None = None  # the last failure to list the router's workers

    @staticmethod
    def _default_factory(probe_timeout: float, request_timeout: float | None) -> Callable[[str, str], SGLangWireEngine]:
        # the bytes' way is the deployment's transport, which it hands to these engines
        return lambda name, url: SGLangWireEngine(name, url, probe_timeout=probe_timeout, request_timeout=request_timeout)

    # -- names and engines ------------------------------------------------------------
    def name_of(self, url: str) -> str:
        url = normalize_url(url)
        return self.names.get(url) or engine_name(url)

    def engine(self, url: str) -> SGLangWireEngine:
        url = normalize_url(url)
        name = self.name_of(url)
        found = self.engines.get(name)
        if found is None:
            found = self.engines[name] = self._factory(name, url)
        return found

    def status(self) -> dict[str, WorkerStatus]:
        """name -> :class:`WorkerStatus` (copies)."""
        return {s.name: attrs.evolve(s) for s in self.workers.values()}

    def in_rotation(self) -> list[str]:
        """Names of the workers the watcher believes serve now."""
        return [s.name for s in self.workers.values() if s.state == "serving"]

    # -- events -----------------------------------------------------------------------
    async def _emit(self, event: WorkerEvent) -> None:
        self.events.append(event)
        log.info("router worker event: %s", event)
        if self.on_event is None:
            return
        try:
            result = self.on_event(event)
            if inspect.isawaitable(result):
                await result
        except Exception:  # a broken callback never stops the watcher
            log.exception("worker event callback failed on %s", event)

    # -- polling ----------------------------------------------------------------------
    async def discover(self) -> dict[str, SGLangWireEngine]:
        """The first listing: an engine per worker and its incarnation, no handshake. Returns ``engines``."""
        if not self._discovered:
            await self.poll_once()
        return self.engines

    async def start(self) -> "WorkerWatcher":
        await self.discover()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)  # the router-side watcher polls the router (I/O) on its own, real time
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("router worker poll failed")

    async def poll_once(self) -> None:
        """One look at the router's list and at every serving worker's incarnation."""
        initial = not self._discovered
        try:
            listed = set(await self.router.workers())
        except (EngineError, OutcomeUnknown) as e:
            self.last_error = e.message
            log.warning("cannot list the router's workers: %s", e.message)
            if initial:
                raise
            return
        self.last_error = None
        self._discovered = True
        # Decided on this one listing, before any await: a handshake that re-adds a worker
        # meanwhile must not read as a leave, nor our own removal as one.
        joined = [u for u in sorted(listed) if u not in self.workers or self.workers[u].state == "left"]
        left = [s for u, s in self.workers.items() if s.state == "serving" and u not in listed]
        for status in left:
            status.state = "left"
        for url in joined:
            await self._joined(url, initial)
        for status in left:
            await self._emit(WorkerLeft(status.name, status.url))
            if self.elastic is not None:
                self._leave(status, self.elastic)
        serving = [s for s in self.workers.values() if s.state == "serving" and s.url in listed]
        await asyncio.gather(*(self._probe(s) for s in serving))

    async def _joined(self, url: str, initial: bool) -> None:
        engine = self.engine(url)
        status = self.workers.get(url)
        if status is None:
            status = self.workers[url] = WorkerStatus(engine.name, url)
        status.state = "serving"
        try:
            incarnation: str | None = await engine.incarnation()
        except (EngineError, OutcomeUnknown) as e:
            incarnation, status.last_error = None, e.message
        await self._emit(WorkerJoined(status.name, url, incarnation, initial))
        status.incarnation = incarnation
        if not initial:  # in rotation before anyone made sure it holds the versions sessions need
            await self._quarantine(status, "joined")
        elif incarnation is None:
            await self._emit(WorkerUnreachable(status.name, url, status.last_error or "no answer"))
            await self._quarantine(status, "unreachable")

    async def _probe(self, status: WorkerStatus) -> None:
        if status.url in self._handshakes:
            return
        try:
            incarnation = await self.engine(status.url).incarnation()
        except (EngineError, OutcomeUnknown) as e:
            status.probe_failures += 1
            status.last_error = e.message
            if status.probe_failures >= self.probe_failures:
                await self._emit(WorkerUnreachable(status.name, status.url, e.message))
                await self._quarantine(status, "unreachable")
            return
        status.probe_failures = 0
        if status.incarnation is not None and incarnation != status.incarnation:
            await self._emit(WorkerRestarted(status.name, status.url, status.incarnation, incarnation))
            status.incarnation = incarnation
            await self._quarantine(status, "restarted")
        else:
            status.incarnation = incarnation

    # -- the handshake ------------------------------------------------------------------
    async def _quarantine(self, status: WorkerStatus, reason: str) -> None:
        status.state = "quarantined"
        status.heal_attempts = 0
        if status.url not in self._handshakes:
            task = asyncio.get_running_loop().create_task(self._handshake(status, reason))
            self._handshakes[status.url] = task
            url = status.url

            def forget(_t: asyncio.Task[None]) -> None:
                self._handshakes.pop(url, None)

            task.add_done_callback(forget)

    async def admit(self, url: str) -> None:
        """Bring a new worker in the safe way: heal it first, then add it to the router."""
        url = normalize_url(url)
        status = self.workers.get(url)
        if status is None:
            status = self.workers[url] = WorkerStatus(self.engine(url).name, url, state="quarantined")
        await self._quarantine(status, "admitted")
        task = self._handshakes.get(url)
        if task is not None:
            await asyncio.shield(task)

    async def _handshake(self, status: WorkerStatus, reason: str) -> None:
        engine = self.engine(status.url)
        attempt = 0
        await self._emit(WorkerQuarantined(status.name, status.url, reason))
        while True:
            attempt += 1
            status.heal_attempts = attempt
            try:
                await self.router.remove_worker(status.url)
                incarnation = await engine.incarnation()
                if self.elastic is not None and status.name not in self.elastic.engines:
                    await self._await_leave(status.url)
                    await self.elastic.add_engine(engine)  # a new member: loaded before it takes traffic
                elif self.heal is None:
                    raise InvalidInput("no heal callable: a worker cannot be re-provisioned")
                else:
                    await self.heal(status.name)
                after = await engine.incarnation()
                if after != incarnation:
                    raise EngineError(f"{status.name} restarted during its heal ({incarnation} -> {after})")
                status.incarnation = after
                await self._emit(WorkerHealed(status.name, status.url, after))
                await self.router.add_worker(status.url)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever heal raises, the worker stays out
                message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
                status.last_error = message
                retry_in = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
                log.warning("%s stays out of rotation: handshake attempt %d failed: %s", status.name, attempt, message)
                await self._emit(HealFailed(status.name, status.url, message, attempt, retry_in))
                await asyncio.sleep(retry_in)  # a handshake with a live worker retried: I/O, real time
                continue
            status.state = "serving"
            status.probe_failures = 0
            status.last_error = None
            await self._emit(WorkerReadmitted(status.name, status.url, status.incarnation))
            return

    # -- an elastic deployment: a leave drains and removes the engine -----------------------
    def _leave(self, status: WorkerStatus, elastic: ElasticFleet) -> None:
        if status.url not in self._leaves and status.name in elastic.engines:
            task = asyncio.get_running_loop().create_task(self._remove(status, elastic))
            self._leaves[status.url] = task
            url = status.url

            def forget(_t: asyncio.Task[None]) -> None:
                self._leaves.pop(url, None)

            task.add_done_callback(forget)

    async def _await_leave(self, url: str) -> None:
        """A worker that comes back while its removal runs joins once it is done."""
        task = self._leaves.get(url)
        if task is not None:
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    async def _remove(self, status: WorkerStatus, elastic: ElasticFleet) -> None:
        """Drain the engine of a worker that left the router (when it answers), then remove it."""
        name = status.name
        try:
            try:
                await elastic.drain_engine(name, timeout=self.drain_timeout)
            except LorapubError as e:
                # unreachable, the last member that takes traffic, or its drain ran out of time: removal decides
                log.warning("%s left the router; its drain did not finish: %s", name, getattr(e, "message", e))
            await elastic.remove_engine(name)
            self.engines.pop(name, None)  # a later join builds a fresh adapter (the deployment closed this one)
            log.info("%s left the router and the deployment", name)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a leave that cannot complete leaves the engine as it is
            log.warning("%s left the router but stays a member of the deployment: %s", name, getattr(e, "message", e))

    async def settle(self) -> None:
        """Wait for every running handshake and removal (tests)."""
        while self._handshakes or self._leaves:
            await asyncio.gather(*list(self._handshakes.values()), *list(self._leaves.values()),
                                 return_exceptions=True)

    async def close(self) -> None:
        """Stop polling and every handshake; close the engines' HTTP clients."""
        tasks = [t for t in [self._loop_task, *self._handshakes.values(), *self._leaves.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in self.engines.values():
            await engine.close()
