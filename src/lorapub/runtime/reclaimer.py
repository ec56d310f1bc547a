"""The reclaimer: unregister, native wait_for_unload, unload once, confirm, on every engine; one
background reclaim per version, its unloads retried under the deployment's retry policy.
See docs/design.md, "Two layers of refs"."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from lorapub.core.commands import ClaimReclaim, ListReclaimable, ReadVersion, RetryReclaim
from lorapub.core.effects import SendReclaim
from lorapub.core.identity import VersionKey
from lorapub.core.version import VersionState
from lorapub.errors import LorapubError
from lorapub.ports import Clock, EngineAdmin, Registry
from lorapub.clock import SystemClock
from lorapub.runtime.fleet import FleetView
from lorapub.runtime.retry import RetryPolicy
from lorapub.runtime.runner import Deadlines, EffectRunner
from lorapub.runtime.tasks import TaskOwner
from lorapub.runtime.engines import shared

__all__ = ["Reclaimer"]

log = logging.getLogger("lorapub.runtime.publisher")


class Reclaimer:
    """unregister -> native wait_for_unload -> unload once -> confirm, on every engine.

    The one owner of ``ReclaimEligible`` and of every reclaim the reconciler finds to do:
    :meth:`ensure` runs one background reclaim per version (never two), which retries the
    engines whose UNLOADED receipt did not come. A reclaim may wait as long as the longest request
    still running on the version; nothing else ever waits for it.
    """

    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        deadlines: Deadlines | None = None,
        *,
        auto: bool = False,
        retries: int = 5,
        backoff: float = 1.0,
        fleet: FleetView | None = None,
        tasks: TaskOwner | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.registry = registry
        self.engines = shared(engines)  # the deployment's live set: membership changes it
        self.deadlines = deadlines or Deadlines()
        self.auto = auto
        # the first claim, then up to ``retries`` retries of the unloads, waiting backoff * 2**n between them
        self.retry_policy = RetryPolicy(tries=retries + 1, first=backoff, factor=2.0, cap=backoff * 2.0 ** max(retries, 0))
        self.clock: Clock = clock or SystemClock()  # the deployment's: retries' backoff is slept on it
        self.fleet = fleet if fleet is not None else FleetView(registry, self.engines, deadline=self.deadlines.begin,
                                                               clock=self.clock)
        self.tasks = tasks if tasks is not None else TaskOwner("lorapub-reclaims")
        self._in_flight: dict[VersionKey, int] = {}

    @property
    def control(self) -> EffectRunner:
        return EffectRunner(self.registry, self.engines, None, self.deadlines, left=self.fleet.left)

    def in_flight(self, key: VersionKey) -> bool:
        """An unload of ``key`` is running in this process (it may wait for long requests)."""
        return self._in_flight.get(key, 0) > 0 or self.tasks.running(("reclaim", key)) is not None

    async def _run(self, key: VersionKey, command: ClaimReclaim | RetryReclaim) -> tuple[VersionState, bool]:
        """Apply ``command``, run its unloads; (the version's state after, whether anything was sent)."""
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            result = await self.registry.handle(command)
            await self.control.run(result.effects)
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]
        sent = any(isinstance(fx, SendReclaim) for fx in result.effects)
        return (await self.registry.handle(ReadVersion(key))).reply.state, sent

    async def reclaim(self, key: VersionKey) -> VersionState:
        return (await self._run(key, ClaimReclaim(key)))[0]

    async def retry(self, key: VersionKey) -> VersionState:
        return (await self._run(key, RetryReclaim(key)))[0]

    async def reclaim_eligible(self) -> dict[VersionKey, VersionState]:
        return {key: await self.reclaim(key) for key in (await self.registry.handle(ListReclaimable())).reply}

    def on_eligible(self, version: VersionKey) -> None:
        if self.auto:
            self.ensure(version)

    def ensure(self, version: VersionKey) -> None:
        """Reclaim ``version`` in the background (claimed if RETIRED and unused, its unloads retried if
        RECLAIMING), unless this process already does. Once its deployment closed nothing starts: the
        registry keeps the version as it is, and any later reconciler reclaims it."""
        if self.tasks.closed:
            return
        self.tasks.spawn(self._reclaim_until_done(version), name=f"reclaim-{version}", key=("reclaim", version))

    async def _reclaim_until_done(self, version: VersionKey) -> None:
        """Reclaim, and retry engines whose UNLOADED receipt did not come (unload is idempotent).
        A failure here is not final: the reconciler is told and finds it again in the state."""
        state = None
        try:
            async for attempt in self.retry_policy.attempts(self.clock):
                if attempt == 0:
                    state, sent = await self._run(version, ClaimReclaim(version))
                    if state is VersionState.RECLAIMING and not sent:  # claimed earlier (elsewhere): drive its unloads
                        state = await self.retry(version)
                else:
                    state = await self.retry(version)
                if state is not VersionState.RECLAIMING:
                    break
        except LorapubError as e:
            log.warning("background reclaim of %s failed (%s); the reconciler retries it", version, e)
        self.fleet.changed()  # a freed slot: a waiting publication asks again
        self.fleet.kick()  # or a retry for the reconciler to schedule

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background reclaims (at most ``timeout`` s); True if none is left."""
        return await self.tasks.wait(timeout, kind="reclaim")

    async def settle(self, timeout: float | None = None) -> None:
        """Wait for the background reclaims; what is left after ``timeout`` s is cancelled (its
        version stays RECLAIMING in the registry, and any reconciler finishes it)."""
        if not await self.wait(timeout):
            await self.tasks.cancel("reclaim")
