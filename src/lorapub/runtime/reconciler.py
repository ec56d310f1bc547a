"""The reconciler: level-triggered recovery derived from registry state and engine inventories.

Edges get lost, so nothing that must eventually happen is driven by an edge alone: each pass reads every
engine's inventory, then the registry's :class:`~lorapub.core.registry.Fleet`, starts in the background
what is missing and reports a typed :class:`Health`. Every command it issues is idempotent.
See docs/design.md, "Recovery rules: the reconciler".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, Hashable, Mapping

from lorapub.core.commands import (
    AbortStale,
    ExpireLeases,
    MarkSuspect,
    ReadFleet,
    ReadSessionsOf,
    RegisterEngine,
    RetryCleanup,
    StartReprovision,
)
from lorapub.core.effects import SendBegin
from lorapub.core.attempt import Progress
from lorapub.core.identity import AttemptToken, VersionKey, epoch_of_name
from lorapub.core.registry import Fleet
from lorapub.core.version import VersionState
from lorapub.errors import EngineError, LorapubError
from lorapub.health import Blocker, Health
from lorapub.events import (
    EngineReprovisioned,
    EngineRestarted,
    HealthChanged,
    Observer,
    OrphanFound,
    OrphanFreed,
    ReconcilePassed,
    SessionsExpired,
    VersionSuspected,
)
from lorapub.ports import Clock, EngineAdmin, Inventory, Registry
from lorapub.clock import SystemClock
from lorapub.runtime.fleet import FleetView, Life
from lorapub.probe import Probe, compare, observe
from lorapub.runtime.provenance import unstamped
from lorapub.runtime.publisher import Publisher
from lorapub.runtime.reclaimer import Reclaimer
from lorapub.runtime.retry import RetryPolicy
from lorapub.runtime.status import holders
from lorapub.runtime.runner import Deadlines, EffectRunner
from lorapub.runtime.tasks import TaskOwner
from lorapub.snapshot import Snapshot
from lorapub.runtime.engines import shared

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)


def _said(life: Life) -> Inventory | str | Exception:
    """What a pass reads of one engine: its inventory where it keeps one, else its incarnation; the
    error if it is away."""
    if life.error is not None or life.incarnation is None:
        return life.error or RuntimeError("no life")
    return life.inventory if life.inventory is not None else life.incarnation

class Reconciler:
    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        *,
        deadlines: Deadlines,
        reclaimer: Reclaimer,
        publisher: Publisher | None = None,
        clock: Clock | None = None,
        interval: float | None = 5.0,
        stale_attempt_after: float | None = None,
        max_backoff: float = 60.0,
        probe_deadline: float | None = None,
        fleet: FleetView | None = None,
        tasks: TaskOwner | None = None,
        events: Observer | None = None,
        sessions_here: Callable[[], tuple[int, int]] | None = None,
        canary_interval: float | None = None,
    ) -> None:
        self.events: Observer = events or (lambda event: None)
        self.sessions_here = sessions_here  # (open sessions, groups) of this process, for the gauges
        self.registry = registry
        self.engines = shared(engines)  # the deployment's live set: membership changes it
        self.deadlines = deadlines
        self.reclaimer = reclaimer
        self.publisher = publisher
        self.clock = clock or SystemClock()
        self.interval = interval
        # A healthy attempt moves at least once per phase deadline; twice the longest is stale.
        self.stale_attempt_after = stale_attempt_after or 2 * max(
            deadlines.begin, deadlines.bucket, deadlines.end, deadlines.cleanup
        )
        # after a failed pass, the next one comes sooner than the interval: 0.1 s, doubling, at most max_backoff
        self.backoff = RetryPolicy(first=0.1, factor=2.0, cap=max_backoff)
        #: how long a pass waits for one engine's inventory or incarnation
        self.probe_deadline = probe_deadline or min(5.0, deadlines.begin)
        self.fleet = fleet if fleet is not None else FleetView(registry, self.engines, deadline=self.probe_deadline,
                                                               clock=self.clock)
        self.tasks = tasks if tasks is not None else TaskOwner("lorapub-reconciler")
        self.control = EffectRunner(registry, self.engines, None, deadlines, on_eligible=self._eligible,
                                    left=self.fleet.left)
        self._seen: dict[AttemptToken, tuple[Progress, float]] = {}  # progress value, first seen
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._passes = 0
        self._failed = 0
        self.orphans: dict[tuple[str, str], str] = {}  # (engine, adapter or attempt) -> what is done about it
        # not "reconcile_failed": nothing failed, and a caller polling health right after start()
        # must be able to tell "not known yet" from "the registry is down"
        self.health = Health(False, (Blocker("starting", "-", "the first reconciliation pass has not finished "
                                             "yet; await deployment.reconcile() to run one now"),), None, 0, 0)
        self.canary_interval = canary_interval  # None: the canary is off
        self._canary_last: dict[tuple[VersionKey, str], float] = {}  # (version, engine) -> last check

    def first_seen(self) -> dict[AttemptToken, float]:
        """When this reconciler first saw each attempt in flight at its current progress."""
        return {token: seen[1] for token, seen in self._seen.items()}

    # -- triggers ----------------------------------------------------------------
    def _eligible(self, version: VersionKey) -> None:
        self.kick()

    def kick(self) -> None:
        """Run a pass soon (an event happened: a close, a commit, a failed call)."""
        self.fleet.kick()

    async def repair_soon(self) -> None:
        """A caller waits on what a pass repairs (an aborted attempt's cleanup): the loop, where it runs,
        is woken; without one (``reconcile_interval=None``) the pass runs here, else nobody would run it."""
        if self._task is not None and not self._task.done():
            self.kick()
        else:
            await self.run_once()

    def start(self) -> None:
        if self._task is None and self.interval is not None:
            self._task = self.tasks.spawn(self._loop(), name="reconciler", key="reconciler")

    async def stop(self, grace: float = 5.0) -> None:
        """Stop the loop (a pass that is running finishes first, up to ``grace`` s) and every
        background repair (cancelled: what it left undone is in the registry's state, and the next
        reconciler, in this process or another, finds it there)."""
        task, self._task = self._task, None
        if task is not None:
            try:
                async with asyncio.timeout(grace):  # how long close() waits for a pass: real time, as its caller's
                    async with self._lock:
                        task.cancel()
            except TimeoutError:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.tasks.cancel("repair")

    async def settle(self, timeout: float | None = None) -> bool:
        """Wait for the background repairs running now (at most ``timeout`` s); True if none is left."""
        repairs = self.tasks.of_kind("repair")
        if repairs:
            await asyncio.wait(repairs, timeout=timeout)
        return not any(not r.done() for r in repairs)

    async def _loop(self) -> None:
        failed = 0  # passes failed in a row
        first = True  # the first pass runs at once: health and status say something real from the start
        while True:
            if not first:
                await self.fleet.wait_for_kick(self.backoff.delay(failed) if failed else self.interval)
            first = False
            health = await self.run_once()
            failed = failed + 1 if health.blockers and health.blockers[0].kind == "reconcile_failed" else 0

    def _spawn(self, key: Hashable, work: Callable[[], Awaitable[Any]]) -> None:
        """Run ``work`` in the background unless a repair of ``key`` already runs; a pass after it ends."""
        if self.tasks.running(("repair", key)) is not None:
            return

        async def run() -> None:
            try:
                await work()
            except LorapubError as e:
                log.warning("repair %s failed (%s); the next pass tries again", key, e)
            except Exception:  # noqa: BLE001 - an adapter bug: logged, retried by the next pass
                log.exception("repair %s raised; the next pass tries again", key)
            finally:
                self.kick()

        self.tasks.spawn(run(), name=f"repair-{key}", key=("repair", key))

    # -- one pass -----------------------------------------------------------------
    async def run_once(self) -> Health:
        """One whole pass; never raises (what failed is reported in :attr:`health`)."""
        async with self._lock:
            self._passes += 1
            started = time.perf_counter()  # the pass's duration, for its event: measured, never waited on
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
                self.events(HealthChanged(health.healthy, tuple(f"{b.kind} {b.subject}: {b.detail}" for b in health.blockers),
                                          health.notes))
            ok = not any(b.kind == "reconcile_failed" for b in health.blockers)
            here = self.sessions_here() if self.sessions_here is not None else (0, 0)
            self.events(ReconcilePassed(time.perf_counter() - started, ok, len(health.blockers), health, *here))
            self.health = health
            return health

    async def _pass(self) -> Health:
        blockers: list[Blocker] = []
        # 1. what every engine holds, read before the registry's view of what it should hold
        probes = {n: _said(life) for n, life in (await self.fleet.lives(deadline=self.probe_deadline)).items()}
        fleet: Fleet = (await self.registry.handle(ReadFleet())).reply
        # 2. restarts
        restarted, keyless = set(), []
        for name, probe in sorted(probes.items()):
            if isinstance(probe, EngineError) and probe.details.get("status") in (401, 403):
                # a worker holding only the API key (docs/embedding.md): the engine answers, its admin routes
                # refuse this key; the deployment that publishes, holding the admin key, watches its lives
                keyless.append(name)
                continue
            if isinstance(probe, Exception):
                blockers.append(Blocker("engine_unreachable", name, f"{type(probe).__name__}: {probe}"))
                continue
            incarnation = probe.incarnation if isinstance(probe, Inventory) else probe
            if fleet.engines.get(name) != incarnation:
                self.events(EngineRestarted(name, fleet.engines.get(name), incarnation))
                restarted.add(name)
                registered = await self.registry.handle(RegisterEngine(name, incarnation))
                await self.control.run(registered.effects)
        # 3. leases
        expired = (await self.registry.handle(ExpireLeases())).reply
        if expired:  # the sessions expired, sorted
            self.events(SessionsExpired(len(expired), "lease", tuple(k.session_id for k in expired[:8])))
        fleet = (await self.registry.handle(ReadFleet())).reply
        # 4. stale attempts
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
        # 5. cleanups, reclaims and orphans, in the background
        for token in fleet.cleaning:
            self._spawn(("cleanup", token), functools.partial(self._retry_cleanup, token))
        for key in (*fleet.reclaimable, *fleet.reclaiming):
            self.reclaimer.ensure(key)
        inventories = {n: p for n, p in probes.items() if isinstance(p, Inventory) and n not in restarted}
        self._sweep_orphans(inventories, fleet)
        # 6. versions lost without a restart
        if await self._notice_lost(inventories, fleet):
            fleet = (await self.registry.handle(ReadFleet())).reply
        # 7. re-provisioning, in the background
        self._reprovision(fleet)
        fleet = (await self.registry.handle(ReadFleet())).reply
        if self.publisher is not None:
            self.publisher.frozen.retain(set(fleet.holders) | {t.version for t in fleet.active})
        self.fleet.update(fleet)  # sessions route by it; waiting publications ask again
        self._canary(fleet)
        # 8. what is left
        for key, why in sorted(fleet.suspect.items()):
            blockers.append(Blocker("version_suspect", str(key), why))
        cleaning_on = {h.version: h.cleaning_on for h in fleet.slots}
        for token in fleet.cleaning:
            engines = cleaning_on.get(token.version) or ()
            blockers.append(Blocker("cleanup_pending", str(token), "cleanup not confirmed on "
                                    + (", ".join(engines) if engines else "every target")))
        blockers += await self._reclaim_blockers(fleet, inventories)
        for (engine, what), doing in sorted(self.orphans.items()):
            blockers.append(Blocker("orphan_pending", f"{engine}:{what}", doing))
        for engine, key in fleet.missing:
            blockers.append(Blocker("reprovisioning", engine, f"{key} lost by the engine, not loaded again yet"))
        active = set(map(str, fleet.active))
        blockers = [b for b in blockers if b.kind != "attempt_running" or b.subject in active]
        notes = tuple(f"{name}: does not stamp its responses (stock SGLang, an older patch, or an adapter that does not): its turns are "
                      "unattested" for name in unstamped(self.fleet))
        notes += tuple(f"{name}: not administered here: its admin routes refuse this adapter's key (a worker holding only the "
                       "API key); the deployment that publishes, holding the admin key, watches its restarts and unloads"
                       for name in keyless)
        return Health(not blockers, tuple(blockers), fleet, self._passes, self._failed, notes)

    # -- the canary (docs/provenance.md, "Canary") ------------------------------------
    def _canary(self, fleet: Fleet) -> None:
        """Re-run each resident version's probe on each engine that holds it, every ``canary_interval``
        (only versions this process published keep their snapshot, hence their probe)."""
        if self.canary_interval is None or self.publisher is None:
            return
        now = self.clock.monotonic()
        for gone in [k for k in self._canary_last if k[0] not in fleet.holders]:
            del self._canary_last[gone]
        for key, engines in sorted(fleet.holders.items()):
            snapshot = self.publisher.frozen.get(key)
            probe = snapshot.probe if snapshot is not None else None
            name = fleet.lora_names.get(key)
            if probe is None or name is None or key in fleet.suspect:
                continue
            for engine in sorted(engines):
                last = self._canary_last.setdefault((key, engine), now)  # its READY probe was the first check
                if now - last >= self.canary_interval and engine in self.engines:
                    self._canary_last[(key, engine)] = now
                    self._spawn(("canary", key, engine), functools.partial(self._canary_one, key, engine, probe, name))

    async def _canary_one(self, key: VersionKey, engine: str, probe: Probe, lora_name: str) -> None:
        try:
            observed = await observe(self.engines[engine], lora_name, probe, self.deadlines.end)
        except LorapubError as e:  # unloaded meanwhile, away, no logprobs: not a drift
            log.debug("canary of %s on %s not run: %s", key, engine, e)
            return
        mismatch = compare(probe, observed)
        if mismatch is None:
            return
        result = await self.registry.handle(MarkSuspect(key, engine, mismatch.describe()))
        if result.reply:
            self.events(VersionSuspected(key, engine, mismatch.describe()))

    async def _retry_cleanup(self, token: AttemptToken) -> None:
        result = await self.registry.handle(RetryCleanup(token))
        await self.control.run(result.effects)

    # -- orphans and lost versions ------------------------------------------------------
    def _sweep_orphans(self, inventories: Mapping[str, Inventory], fleet: Fleet) -> None:
        """Unload what no registry version names (of this epoch) or an older epoch left; clean their
        staged attempts. A newer epoch's adapters and attempts are a newer trainer's: untouched."""
        known = set(fleet.lora_names.values())
        live_tokens = set(fleet.active) | set(fleet.cleaning)
        found: set[tuple[str, str]] = set()
        for engine, inventory in sorted(inventories.items()):
            for name, held in sorted(inventory.adapters.items()):
                epoch = epoch_of_name(name, fleet.name_prefix)  # another prefix's adapters are not ours
                if epoch is None or epoch > fleet.epoch or (epoch == fleet.epoch and name in known):
                    continue
                found.add((engine, name))
                doing = (f"an adapter no registry of epoch {fleet.epoch} holds: unloading"
                         + (f" once its {held.refs} running request(s) end" if held.refs else ""))
                if (engine, name) not in self.orphans:
                    self.events(OrphanFound(engine, name, doing))
                self.orphans[(engine, name)] = doing
                self._spawn(("orphan", engine, name), functools.partial(self._unload_orphan, engine, name))
            for staged in inventory.staged:
                epoch = staged.token.version.deployment_epoch
                if epoch > fleet.epoch or (epoch == fleet.epoch and staged.token in live_tokens):
                    continue
                if staged.lora_name in known:
                    # a stale attempt of a version the registry serves under the same name: a cleanup
                    # would unload that name (what it loaded), so the engine's own aging frees it
                    continue
                what = f"attempt {staged.token}"
                found.add((engine, what))
                if (engine, what) not in self.orphans:
                    self.events(OrphanFound(engine, what, "a staged attempt no registry drives: cleaning"))
                self.orphans[(engine, what)] = "a staged attempt no registry drives: cleaning"
                self._spawn(("orphan", engine, what),
                            functools.partial(self._clean_orphan, engine, staged.token, staged.lora_name))
        for key in [k for k in self.orphans if k[0] not in self.engines]:
            del self.orphans[key]  # its engine left the fleet: what it holds is no longer this deployment's to sweep
        for key in [k for k in self.orphans if k[0] in inventories and k not in found]:
            if self.tasks.running(("repair", ("orphan", *key))) is not None:  # unregistered, its unload waits for running requests
                self.orphans[key] = "unloading: unregistered, waiting for its running requests to end"
            else:
                del self.orphans[key]  # gone: freed

    async def _unload_orphan(self, engine: str, name: str) -> None:
        async with asyncio.timeout(self.deadlines.reclaim):
            await self.engines[engine].reclaim(name, f"orphan-{name}")
        self.events(OrphanFreed(engine, name))

    async def _clean_orphan(self, engine: str, token: AttemptToken, name: str) -> None:
        async with asyncio.timeout(self.deadlines.cleanup):
            await self.engines[engine].cleanup(token, name)
        self.events(OrphanFreed(engine, f"attempt {token}"))

    async def _notice_lost(self, inventories: Mapping[str, Inventory], fleet: Fleet) -> bool:
        """A version the registry says an engine holds, which the engine's inventory lacks, twice —
        before the registry answered and after — was lost without a restart: the engine leaves its
        holders (re-provisioned where still needed)."""
        changed = False
        for engine, inventory in sorted(inventories.items()):
            suspects = {key: name for key, on in fleet.holders.items()
                        if engine in on and (name := fleet.lora_names.get(key)) is not None
                        and name not in inventory.adapters}
            if suspects and await self.fleet.confirm_lost(engine, inventory, suspects, "unloaded without a restart",
                                                          self.probe_deadline):
                changed = True
        return changed

    # -- health ------------------------------------------------------------------------
    async def _reclaim_blockers(self, fleet: Fleet, inventories: Mapping[str, Inventory]) -> list[Blocker]:
        """Each pending reclaim with what holds it, by name: the engines whose unload is not
        confirmed and the requests still running there; and a waiting publication with the
        sessions that keep the versions holding its slots."""
        blockers: list[Blocker] = []
        pending = {h.version: h for h in fleet.slots if h.version in (*fleet.reclaimable, *fleet.reclaiming)}
        for key, holder in sorted(pending.items()):
            name = fleet.lora_names.get(key)
            running = ({e: inv.adapters[name].refs for e, inv in inventories.items() if name in inv.adapters}
                       if name is not None else {})
            on = ", ".join(f"{e} ({n} running request(s))" if n else e
                           for e, n in sorted(running.items()) if e in holder.unloading_on or n)
            detail = (f"unload not confirmed on {on or ', '.join(holder.unloading_on) or 'its engines'}"
                      if holder.state is not VersionState.RETIRED else "reclaim not claimed yet")
            blockers.append(Blocker("reclaim_pending", str(key), detail))
        if fleet.waiting is not None:
            kept = []
            for h in fleet.slots:
                if h.state is VersionState.RETIRED and h.session_refs and not h.retiring:
                    who = (await self.registry.handle(ReadSessionsOf(h.version))).reply
                    kept.append(f"{h.version} kept by {', '.join(holders(who))}")
            detail = "waiting for a slot: " + "; ".join(h.describe() for h in fleet.slots)
            blockers.append(Blocker("publication_waiting", str(fleet.waiting.key),
                                    detail + (" — " + "; ".join(kept) if kept else "")))
        return blockers

    # -- re-provisioning ------------------------------------------------------------------
    def _reprovision(self, fleet: Fleet) -> None:
        frozen = self.publisher.frozen if self.publisher is not None else None
        for engine, key in fleet.missing:
            snapshot = frozen.get(key) if frozen is not None else None
            if snapshot is None:
                continue  # only the process that published it keeps the frozen copy
            self._spawn(("reprovision", engine, key), functools.partial(self._reprovision_one, engine, key, snapshot))

    async def _reprovision_one(self, engine: str, key: VersionKey, snapshot: Snapshot) -> None:
        publisher = self.publisher
        assert publisher is not None, "only the publishing process keeps frozen copies to re-provision from"
        result = await self.registry.handle(StartReprovision(key, engine))
        if result.reply is None or not result.effects:
            return
        runner = EffectRunner(
            self.registry, self.engines,
            publisher.source_factory(snapshot, snapshot.plan(publisher.bucket_cap_bytes)), self.deadlines,
            # the numeric READY gate holds for a re-provisioned load too
            probe=snapshot.probe,
            lora_name=next((fx.lora_name for fx in result.effects if isinstance(fx, SendBegin)), None),
            left=self.fleet.left,
        )
        runlog = await runner.run(result.effects)
        problems = "; ".join(runlog.failures + runlog.unknown)
        if problems:
            log.warning("re-provisioning %s on %s failed (%s); the next pass tries again", key, engine, problems)
        else:
            self.events(EngineReprovisioned(engine, key))
