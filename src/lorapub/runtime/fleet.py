"""The one fleet view: engine lives (probed here and nowhere else), the registry's latest view of
who holds what, and the two wakeups that follow a change (a pass for the reconciler, a recheck for
waiting publications). See docs/design.md, "Runtime wiring"."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

import attrs

from lorapub.core.commands import ReadFleet, ReadVersion, RecordLost, RegisterEngine
from lorapub.core.effects import Effect
from lorapub.core.fleet_view import FleetFacts
from lorapub.core.identity import VersionKey
from lorapub.core.registry import Fleet
from lorapub.core.session import Binding
from lorapub.errors import LorapubError, OutcomeUnknown, UnknownEngine
from lorapub.ports import Clock, EngineAdmin, Inventory, Registry, ReportsInventory
from lorapub.runtime.admission import answer_within
from lorapub.clock import Elapsed, SystemClock
from lorapub.runtime.engines import shared
from lorapub.runtime.lives import LivesSeen

__all__ = ["FleetView", "Life", "incarnation_of"]

log = logging.getLogger(__name__)

RunEffects = Callable[[Sequence[Effect]], Awaitable[object]]


@attrs.frozen
class Life:
    """What one engine said when asked: its incarnation and, where it keeps one, its inventory;
    or why it did not answer."""

    engine: str
    incarnation: str | None
    inventory: Inventory | None = None
    error: Exception | None = None

    @property
    def answered(self) -> bool:
        return self.error is None


async def incarnation_of(name: str, engine: EngineAdmin, deadline: float) -> str:
    """Engine ``name``'s incarnation (what a registry is made with, before there is a fleet view);
    no answer within ``deadline`` is OUTCOME_UNKNOWN, an engine's own refusal is raised as it is."""
    return await answer_within(name, "its incarnation", deadline, engine.incarnation())


class FleetView:
    def __init__(self, registry: Registry, engines: Mapping[str, EngineAdmin], *, deadline: float,
                 clock: Clock | None = None) -> None:
        self.registry = registry
        #: the deployment's one clock: the reconcile interval is slept on it, the registry's time carried by it
        self.clock: Clock = clock or SystemClock()
        self.engines = shared(engines)  # the deployment's live set: membership changes it
        self.deadline = deadline  # how long one engine may take to say its life
        #: what this process knows of the fleet, and decides from it alone (the core's pure half of this view)
        self.facts = FleetFacts()
        # the registry's time, carried forward here (a session's nonce is judged in it)
        self.registry_time = Elapsed(clock=self.clock)
        #: engine -> (whether it declares provenance stamps, the incarnation it said), from its last answer
        self.attests: dict[str, tuple[bool, str]] = {}
        self._left: dict[str, asyncio.Event] = {}  # engine -> set once it is removed from the fleet
        #: the last few lives of each engine (its answers, the registry's records): a stamp of a past life attests
        self.lives_seen = LivesSeen()
        self._repair = asyncio.Event()  # the reconciler's wakeup
        self._changed = asyncio.Event()  # waiting publications' wakeup; replaced at each change

    # -- lives -------------------------------------------------------------------------------
    async def life(self, name: str, *, inventory: bool = True, deadline: float | None = None) -> Life:
        """Ask engine ``name`` its life (with its inventory where it keeps one, if asked); never raises."""
        limit = self.deadline if deadline is None else deadline
        engine = self.engines.get(name)
        if engine is None:  # the registry names a member this process has no adapter for
            return Life(name, None, error=UnknownEngine(
                f"the registry names engine {name!r}, which this process has no adapter for: "
                f"deployment.add_engine(<its adapter>) gives it one", engine=name))
        try:
            async with asyncio.timeout(limit):  # bounds an engine's answer: I/O hangs in real time, not on the clock
                if inventory and isinstance(engine, ReportsInventory):
                    found = await engine.inventory()
                    self.attests[name] = (found.stamps, found.incarnation)
                    self.lives_seen.saw(name, found.incarnation)
                    return Life(name, found.incarnation, found)
                incarnation = await engine.incarnation()
                self.lives_seen.saw(name, incarnation)
                if not isinstance(engine, ReportsInventory):  # it cannot say it stamps: it does not
                    self.attests[name] = (False, incarnation)
                elif name in self.attests:  # the same engine, maybe a new life
                    self.attests[name] = (self.attests[name][0], incarnation)
                return Life(name, incarnation)
        except TimeoutError:
            return Life(name, None, error=TimeoutError(f"no answer within {limit:g}s"))
        except Exception as e:  # noqa: BLE001 - unreachable now: routed around, asked again later
            return Life(name, None, error=e)

    async def lives(self, names: Iterable[str] | None = None, *, inventory: bool = True,
                    deadline: float | None = None) -> dict[str, Life]:
        names = list(self.engines if names is None else names)
        found = await asyncio.gather(*(self.life(n, inventory=inventory, deadline=deadline) for n in names))
        return dict(zip(names, found))

    async def incarnation(self, name: str) -> str:
        """Engine ``name``'s incarnation; no answer within the deadline is OUTCOME_UNKNOWN."""
        engine = self.engines.get(name)
        if engine is None:
            raise UnknownEngine(f"the registry names engine {name!r}, which this process has no adapter for: "
                                f"deployment.add_engine(<its adapter>) gives it one", engine=name)
        return await incarnation_of(name, engine, self.deadline)

    async def probe(self, run: RunEffects, engine: str | None = None, version: VersionKey | None = None,
                    lora_name: str | None = None) -> None:
        """A targeted check after an engine refused a version it should hold: did it restart (every
        engine when ``engine`` is None), or lose ``version`` without a restart (an operator's
        unload)? ``run`` drives what the registry decides (the cleanups a restart voids)."""
        names = [engine] if engine is not None else list(self.engines)

        async def one(name: str) -> None:
            try:
                first = await self.life(name)
                if first.incarnation is None:
                    raise first.error or OutcomeUnknown(f"{name}: no life")
                result = await self.registry.handle(RegisterEngine(name, first.incarnation))
                if result.effects:
                    await run(result.effects)
                elif (first.inventory is not None and version is not None and lora_name is not None
                      and lora_name not in first.inventory.adapters):
                    holders = (await self.registry.handle(ReadVersion(version))).reply.engines
                    if name in holders and await self.confirm_lost(name, first.inventory, {version: lora_name},
                                                                   "found by a refused request"):
                        self.kick()  # re-provision it there
            except (LorapubError, TimeoutError) as e:
                log.warning("probe of %s failed: %s", name, e)

        await asyncio.gather(*(one(n) for n in names))
        await self.refresh()

    async def confirm_lost(self, name: str, first: Inventory, suspects: Mapping[VersionKey, str], how: str,
                           deadline: float | None = None) -> bool:
        """Record as lost each of ``suspects`` (version -> its name on the engine) that engine ``name``'s
        inventory ``first`` lacks, that the registry, read after ``first``, says it holds, and that the
        engine, asked again now, still lacks in the same life: unloaded without a restart (an
        operator's unload), never a load made meanwhile. True when the registry took any."""
        again = await self.life(name, deadline=deadline)
        if again.inventory is None or again.incarnation != first.incarnation:
            return False  # unreachable, or restarted meanwhile: seen as such next time
        changed = False
        for key, lora_name in sorted(suspects.items()):
            if lora_name not in first.adapters and lora_name not in again.inventory.adapters:
                log.warning("version lost: engine=%s version=%s (%s)", name, key, how)
                changed = bool((await self.registry.handle(RecordLost(name, key))).reply) or changed
        return changed

    # -- the registry's view ----------------------------------------------------------------
    async def refresh(self) -> Fleet:
        fleet: Fleet = (await self.registry.handle(ReadFleet())).reply
        self.update(fleet)
        return fleet

    def update(self, fleet: Fleet) -> None:
        """The registry's latest view: who holds what (where sessions may go: never a joining member,
        a draining one only for a version no other member holds), the default revision, what is retiring."""
        for name, incarnation in fleet.engines.items():
            self.lives_seen.saw(name, incarnation)
        if fleet.now is not None:
            self.registry_time.set(fleet.now)
        self.facts = self.facts.seen(fleet)
        self.changed()

    def update_holders(self, holders: Mapping[VersionKey, frozenset[str]]) -> None:
        self.facts = self.facts.with_routes(holders)

    def note_binding(self, binding: Binding) -> None:
        self.facts = self.facts.bound(binding)

    # the facts, read where the runtime reads them (each is FleetFacts')
    @property
    def default_revision(self) -> int:
        return self.facts.default_revision

    @property
    def default(self) -> VersionKey | None:
        """The version at ``default_revision``, where known."""
        return self.facts.default

    @property
    def retiring(self) -> frozenset[VersionKey]:
        return self.facts.retiring

    @property
    def max_lag(self) -> int | None:
        """The registry's, as its last view said."""
        return self.facts.max_lag

    @property
    def on_stale(self) -> str:
        return self.facts.on_stale

    @property
    def joining(self) -> frozenset[str]:
        return self.facts.joining

    @property
    def draining(self) -> frozenset[str]:
        return self.facts.draining

    def holders(self, version: VersionKey) -> frozenset[str] | None:
        """Engines holding ``version`` as last seen; None when not known (every engine)."""
        return self.facts.holders(version)

    def is_stale(self, binding: Binding) -> bool:
        return self.facts.is_stale(binding)

    def gone(self, binding: Binding) -> bool:
        return self.facts.gone(binding)

    def lag(self, binding: Binding) -> int:
        return self.facts.lag(binding)

    # -- membership --------------------------------------------------------------------------
    def left(self, name: str) -> asyncio.Event:
        """Set once engine ``name`` is removed from the fleet: a call still waiting on it stops at once."""
        return self._left.setdefault(name, asyncio.Event())

    def removed(self, name: str) -> None:
        self.left(name).set()
        del self._left[name]  # a later member of that name (added again) starts with a fresh event

    # -- wakeups -----------------------------------------------------------------------------
    def kick(self) -> None:
        """Ask the reconciler for a pass soon (a close, a commit, a refused request, a reclaim)."""
        self._repair.set()

    async def wait_for_kick(self, timeout: float | None) -> None:
        """Return once kicked, or once ``timeout`` s have passed on the deployment's clock (None: kicked only)."""
        if timeout is None:
            await self._repair.wait()
        elif not self._repair.is_set():
            kicked = asyncio.ensure_future(self._repair.wait())
            slept = asyncio.ensure_future(self.clock.sleep(timeout))
            try:
                await asyncio.wait((kicked, slept), return_when=asyncio.FIRST_COMPLETED)
            finally:
                kicked.cancel()
                slept.cancel()
        self._repair.clear()

    def changed(self) -> None:
        """Something a waiting publication waits for may have changed (a slot, an attempt's end)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def change(self) -> asyncio.Event:
        """The event the next :meth:`changed` sets (take it before checking, then wait on it)."""
        return self._changed
