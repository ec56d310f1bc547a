"""One object that wires registry, publisher, reclaimer and sessions for a fleet.

``Deployment(engines, epoch=..., enabled=False)`` keeps the old overwrite path
untouched; ``enabled=True`` (the explicit switch) turns on versioned publication.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Mapping

from lorapub.runtime.runner import Deadlines
from lorapub.errors import InvalidInput
from lorapub.runtime.overwrite import LegacySession, OverwritePublisher
from lorapub.runtime.publisher import Publisher, Reclaimer
from lorapub.runtime.registry import LocalRegistry, RegistryService
from lorapub.runtime.sessions import SessionService


class Deployment:
    def __init__(
        self,
        engines: Mapping[str, Any],
        *,
        epoch: int,
        enabled: bool = False,
        registry: Any | None = None,
        auto_reclaim: bool = True,
        deadlines: Deadlines | None = None,
        bucket_cap_bytes: int = 64 << 20,
        stash_dir: str | None = None,
        reclaim_retries: int = 5,
        reclaim_backoff: float = 1.0,
    ) -> None:
        self.reclaim_retries = reclaim_retries
        self.reclaim_backoff = reclaim_backoff
        self.engines = dict(engines)
        self.epoch = epoch
        self.enabled = enabled
        self.registry = registry
        self.auto_reclaim = auto_reclaim
        self.deadlines = deadlines or Deadlines()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.stash_dir = stash_dir
        self._reclaims: set[asyncio.Task] = set()
        self._legacy_rr = itertools.count()

    async def start(self) -> "Deployment":
        if not self.enabled:
            self.legacy = OverwritePublisher(self.engines, self.stash_dir or "/tmp/lorapub-legacy")
            return self
        if self.registry is None:
            incarnations = {name: await e.incarnation() for name, e in self.engines.items()}
            self.registry = LocalRegistry(RegistryService(self.epoch, incarnations))
        self.publisher = Publisher(
            self.registry, self.engines, epoch=self.epoch, deadlines=self.deadlines, bucket_cap_bytes=self.bucket_cap_bytes
        )
        self.reclaimer = Reclaimer(self.registry, self.engines, self.deadlines)
        self.sessions = SessionService(
            self.registry, self.engines, epoch=self.epoch,
            on_reclaim_eligible=self._on_eligible if self.auto_reclaim else None,
        )
        return self

    async def _reclaim(self, version) -> None:
        """Reclaim, and retry engines whose UNLOADED receipt did not come (unload is idempotent)."""
        from lorapub.core.version import VersionState

        state = await self.reclaimer.reclaim(version)
        for attempt in range(self.reclaim_retries):
            if state is not VersionState.RECLAIMING:
                return
            await asyncio.sleep(self.reclaim_backoff * 2**attempt)
            state = await self.reclaimer.retry(version)

    def _on_eligible(self, version) -> None:
        task = asyncio.get_running_loop().create_task(self._reclaim(version))
        self._reclaims.add(task)
        task.add_done_callback(self._reclaims.discard)

    async def settle(self) -> None:
        """Wait for background reclaims started by session closes."""
        while self._reclaims:
            await asyncio.gather(*list(self._reclaims), return_exceptions=True)

    async def refresh_engines(self) -> dict[str, str]:
        """Tell the registry about engines that restarted (their READYs and stashes are void)."""
        found = {}
        for name, engine in self.engines.items():
            found[name] = await engine.incarnation()
            result = await self.registry.register_engine(name, found[name])
            if result.effects:
                await self.publisher.control.run(result.effects)
        return found

    def _require_started(self) -> None:
        if not hasattr(self, "legacy") and not hasattr(self, "sessions"):
            raise InvalidInput("call `await deployment.start()` first")

    async def publish(self, snapshot, version_id: str):
        self._require_started()
        if not self.enabled:
            return await self.legacy.publish(snapshot, version_id)
        await self.refresh_engines()
        report = await self.publisher.publish(snapshot, version_id)
        if self.auto_reclaim and report.receipt is not None and report.receipt.retired is not None:
            if report.receipt.retired in await self.registry.reclaimable():
                self._on_eligible(report.receipt.retired)
        return report

    def session(self, session_id: str, nonce: str | None = None):
        self._require_started()
        if not self.enabled:
            engines = list(self.engines.values())
            return LegacySession(engines[next(self._legacy_rr) % len(engines)])
        return self.sessions.session(session_id, nonce)
