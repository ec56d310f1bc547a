"""The reconciler: level-triggered recovery derived from registry state.

Edges get lost: a reply to the last close, a registry call inside an automatic
reclaim, a publisher that dies mid-attempt, an engine that restarts between two
probes. So nothing that must eventually happen is driven by an edge alone. Each
pass reads the registry's :class:`~lorapub.core.registry.Fleet` (what the state
says must be done) and does it; passes run after every relevant event (``kick``)
and periodically, and a pass that fails is retried with backoff. Every command
it issues is idempotent, so any number of reconcilers (one per process) may run.

One pass, in order:

1. probe every engine's incarnation; a new life is registered (its READYs and
   stashes are void, it leaves every version's holders);
2. expire the leases of sessions whose worker stopped renewing them;
3. abort attempts whose publisher made no progress for ``stale_attempt_after``;
4. retry unconfirmed cleanups; reclaim RETIRED versions with zero refs; retry
   reclaims that wait for receipts;
5. re-provision needed versions on engines that lost them, from the frozen copy
   this process keeps (only the publishing process has one);
6. report what still blocks health as a typed :class:`Health`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping

import attrs

from lorapub.core.commands import (
    AbortStale,
    ExpireLeases,
    ReadFleet,
    ReadSessionsOf,
    ReadVersion,
    RegisterEngine,
    RetryCleanup,
    StartReprovision,
)
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.registry import Fleet
from lorapub.errors import LorapubError
from lorapub.core.version import VersionState
from lorapub.ports import Clock, EngineAdmin, Registry, ReportsInventory
from lorapub.runtime.clock import SystemClock
from lorapub.runtime.runner import Deadlines, EffectRunner

log = logging.getLogger(__name__)


@attrs.frozen
class Blocker:
    """One thing that keeps the deployment from being healthy, and why."""

    # engine_unreachable | reprovisioning | cleanup_pending | reclaim_pending | publication_waiting |
    # attempt_running | reconcile_failed
    kind: str
    subject: str
    detail: str


@attrs.frozen
class Health:
    """The typed status of the last reconciliation pass."""

    healthy: bool
    blockers: tuple[Blocker, ...]
    fleet: Fleet | None
    passes: int
    failed_passes: int

    def describe(self) -> str:
        if self.healthy:
            return "healthy"
        return "; ".join(f"{b.kind} {b.subject}: {b.detail}" for b in self.blockers)


class Reconciler:
    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        *,
        deadlines: Deadlines,
        reclaimer,
        publisher=None,
        clock: Clock | None = None,
        interval: float | None = 5.0,
        stale_attempt_after: float | None = None,
        max_backoff: float = 60.0,
        on_fleet: Callable[[Fleet], None] | None = None,
    ) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.deadlines = deadlines
        self.reclaimer = reclaimer
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.interval = interval
        # A healthy attempt moves at least once per phase deadline; twice the longest is stale.
        self.stale_attempt_after = stale_attempt_after or 2 * max(
            deadlines.begin, deadlines.bucket, deadlines.end, deadlines.cleanup
        )
        self.max_backoff = max_backoff
        self.on_fleet = on_fleet
        self.control = EffectRunner(registry, self.engines, None, deadlines, on_eligible=self._eligible)
        self._seen: dict[AttemptToken, tuple[tuple, float]] = {}  # progress value, first seen
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._passes = 0
        self._failed = 0
        self.health = Health(False, (Blocker("reconcile_failed", "-", "no pass ran yet"),), None, 0, 0)

    # -- triggers ----------------------------------------------------------------
    def _eligible(self, version: VersionKey) -> None:
        self.kick()

    def kick(self) -> None:
        """Run a pass soon (an event happened: a close, a commit, a failed call)."""
        self._wake.set()

    def start(self) -> None:
        if self._task is None and self.interval is not None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="lorapub-reconciler")

    async def stop(self, grace: float = 5.0) -> None:
        """Stop the loop, letting a pass that is running finish first (up to ``grace`` s): a
        pass cut short leaves its attempt for the stale-attempt rule to clean."""
        task, self._task = self._task, None
        if task is None:
            return
        try:
            async with asyncio.timeout(grace):
                async with self._lock:
                    task.cancel()
        except TimeoutError:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        backoff = 0.0
        while True:
            try:
                async with asyncio.timeout(backoff or self.interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            health = await self.run_once()
            if health.blockers and health.blockers[0].kind == "reconcile_failed":
                backoff = min(self.max_backoff, max(0.05, backoff * 2 or 0.1))
            else:
                backoff = 0.0

    # -- one pass -----------------------------------------------------------------
    async def run_once(self) -> Health:
        """One whole pass; never raises (what failed is reported in :attr:`health`)."""
        async with self._lock:
            self._passes += 1
            try:
                health = await self._pass()
            except Exception as e:  # a registry that is down, an adapter bug: retried with backoff
                self._failed += 1
                log.warning("reconcile pass failed (%s: %s); retrying with backoff", type(e).__name__, e)
                health = Health(
                    False, (Blocker("reconcile_failed", "registry", f"{type(e).__name__}: {e}"),),
                    self.health.fleet, self._passes, self._failed,
                )
            if health.blockers != self.health.blockers:
                log.info("lorapub health: %s", health.describe())
            self.health = health
            return health

    async def _pass(self) -> Health:
        blockers: list[Blocker] = []
        fleet: Fleet = (await self.registry.handle(ReadFleet())).reply
        # 1. restarts
        for name, engine in sorted(self.engines.items()):
            try:
                async with asyncio.timeout(self.deadlines.begin):
                    incarnation = await engine.incarnation()
            except Exception as e:  # unreachable now: it is routed around, probed again next pass
                blockers.append(Blocker("engine_unreachable", name, f"{type(e).__name__}: {e}"))
                continue
            if fleet.engines.get(name) != incarnation:
                log.warning("engine %s restarted (%s -> %s)", name, fleet.engines.get(name), incarnation)
                result = await self.registry.handle(RegisterEngine(name, incarnation))
                await self.control.run(result.effects)
        # 2. leases
        result = await self.registry.handle(ExpireLeases())
        if result.reply:
            log.warning("%d session lease(s) expired; their version refs were released", result.reply)
        fleet = (await self.registry.handle(ReadFleet())).reply
        # 3. stale attempts
        now = self.clock.monotonic()
        for token in list(self._seen):
            if token not in fleet.active:
                del self._seen[token]
        for token, progress in fleet.active.items():
            seen = self._seen.get(token)
            if seen is None or seen[0] != progress:
                self._seen[token] = seen = (progress, now)
            if now - seen[1] >= self.stale_attempt_after:
                log.warning("attempt %s made no progress for %.0fs; aborting it", token, now - seen[1])
                result = await self.registry.handle(
                    AbortStale(token, f"no progress for {now - seen[1]:.0f}s (publisher stopped)")
                )
                await self.control.run(result.effects)
            else:
                blockers.append(Blocker("attempt_running", str(token), "publication in progress"))
        # 4. cleanup and reclaim
        for token in fleet.cleaning:
            result = await self.registry.handle(RetryCleanup(token))
            await self.control.run(result.effects)
        for key in fleet.reclaimable:
            await self.reclaimer.reclaim(key)
        for key in fleet.reclaiming:
            if not self.reclaimer.in_flight(key):
                await self.reclaimer.retry(key)
        # 5. re-provisioning
        if fleet.missing:
            await self._reprovision(fleet)
        fleet = (await self.registry.handle(ReadFleet())).reply
        if self.publisher is not None:
            self.publisher.frozen.retain(set(fleet.holders) | {t.version for t in fleet.active})
        if self.on_fleet is not None:
            self.on_fleet(fleet)
        # 6. what is left
        for token in fleet.cleaning:
            blockers.append(Blocker("cleanup_pending", str(token), "cleanup not confirmed on every target"))
        blockers += await self._reclaim_blockers(fleet)
        for engine, key in fleet.missing:
            blockers.append(Blocker("reprovisioning", engine, f"{key} lost in a restart, not loaded again yet"))
        active = set(map(str, fleet.active))
        blockers = [b for b in blockers if b.kind != "attempt_running" or b.subject in active]
        return Health(not blockers, tuple(blockers), fleet, self._passes, self._failed)

    async def _reclaim_blockers(self, fleet: Fleet) -> list[Blocker]:
        """Each pending reclaim with what holds it, by name: the engines whose unload is not
        confirmed and the requests still running there; and a waiting publication with the
        sessions that keep the versions holding its slots."""
        blockers: list[Blocker] = []
        pending = {h.version: h for h in fleet.slots if h.version in (*fleet.reclaimable, *fleet.reclaiming)}
        running = await self._running_requests(pending) if pending else {}
        for key, holder in sorted(pending.items()):
            on = ", ".join(f"{e} ({n} running request(s))" if n else e
                           for e, n in sorted(running.get(key, {}).items()) if e in holder.unloading_on or n)
            detail = (f"unload not confirmed on {on or ', '.join(holder.unloading_on) or 'its engines'}"
                      if holder.state is not VersionState.RETIRED else "reclaim not claimed yet")
            blockers.append(Blocker("reclaim_pending", str(key), detail))
        if fleet.waiting is not None:
            kept = []
            for h in fleet.slots:
                if h.state is VersionState.RETIRED and h.session_refs and not h.retiring:
                    who = (await self.registry.handle(ReadSessionsOf(h.version))).reply
                    names = [f"session {sid} ({state.lower()})" for sid, state, _ in who.session_ids]
                    names += [f"group {g} ({m} open)" for g, m in who.group_ids]
                    more = who.sessions + who.groups - len(names)
                    kept.append(f"{h.version} kept by {', '.join(names)}" + (f" and {more} more" if more > 0 else ""))
            detail = "waiting for a slot: " + "; ".join(h.describe() for h in fleet.slots)
            blockers.append(Blocker("publication_waiting", str(fleet.waiting.key),
                                    detail + (" — " + "; ".join(kept) if kept else "")))
        return blockers

    async def _running_requests(self, pending: Mapping[VersionKey, object]) -> dict[VersionKey, dict[str, int]]:
        names = {(await self.registry.handle(ReadVersion(k))).reply.lora_name: k for k in pending}
        found: dict[VersionKey, dict[str, int]] = {}
        for name, engine in sorted(self.engines.items()):
            if not isinstance(engine, ReportsInventory):
                continue
            try:
                async with asyncio.timeout(self.deadlines.begin):
                    held = (await engine.inventory()).adapters
            except Exception:  # noqa: BLE001 - unreachable engines are reported by step 1
                continue
            for lora_name, key in names.items():
                if lora_name in held:
                    found.setdefault(key, {})[name] = held[lora_name].refs
        return found

    async def _reprovision(self, fleet: Fleet) -> None:
        frozen = self.publisher.frozen if self.publisher is not None else None
        for engine, key in fleet.missing:
            snapshot = frozen.get(key) if frozen is not None else None
            if snapshot is None:
                continue  # only the process that published it keeps the frozen copy
            try:
                result = await self.registry.handle(StartReprovision(key, engine))
                if result.reply is None or not result.effects:
                    continue
                runner = EffectRunner(
                    self.registry, self.engines,
                    self.publisher.source_factory(snapshot, snapshot.plan(self.publisher.bucket_cap_bytes)),
                    self.deadlines,
                )
                runlog = await runner.run(result.effects)
                log.info("re-provisioned %s on %s (%s)", key, engine, "; ".join(runlog.failures + runlog.unknown) or "ok")
            except LorapubError as e:
                log.warning("re-provisioning %s on %s failed: %s", key, engine, e)
