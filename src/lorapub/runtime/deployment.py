"""One object that wires registry, publisher, reclaimer and sessions for a fleet.

:class:`Deployment` is versioned publication. :func:`deploy` is the one switch
(``enable_versioned_lora_publication``): ``enabled=True`` gives a started
:class:`Deployment`, ``enabled=False`` the old overwrite path, its own type
(:class:`~lorapub.runtime.overwrite.OverwriteDeployment`).
"""

from __future__ import annotations

from typing import Any, Mapping

from lorapub.core.identity import VersionKey
from lorapub.core.commands import ReadState, RegisterEngine
from lorapub.core.registry import RegistryState
from lorapub.errors import InvalidInput
from lorapub.ports import EngineAdmin, OverwriteAdmin, Registry
from lorapub.runtime.overwrite import OverwriteDeployment
from lorapub.runtime.publisher import PublicationReport, Publisher, Reclaimer
from lorapub.runtime.registry import LocalRegistry
from lorapub.runtime.runner import Deadlines
from lorapub.runtime.sessions import Session, SessionService
from lorapub.runtime.snapshot import DEFAULT_BUCKET_CAP, Snapshot


class Deployment:
    """Versioned publication: ``publish`` returns a :class:`PublicationReport`, ``session`` a :class:`Session`."""

    def __init__(
        self,
        engines: Mapping[str, EngineAdmin],
        *,
        epoch: int,
        registry: Registry | None = None,
        auto_reclaim: bool = True,
        deadlines: Deadlines | None = None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP,
        stash_dir: str | None = None,
        reclaim_retries: int = 5,
        reclaim_backoff: float = 1.0,
    ) -> None:
        self.engines = dict(engines)
        self.epoch = epoch
        self.registry = registry
        self.auto_reclaim = auto_reclaim
        self.deadlines = deadlines or Deadlines()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.stash_dir = stash_dir
        self.reclaim_retries = reclaim_retries
        self.reclaim_backoff = reclaim_backoff
        self._started = False

    async def start(self) -> "Deployment":
        if self.registry is None:
            incarnations = {name: await e.incarnation() for name, e in self.engines.items()}
            self.registry = LocalRegistry(self.epoch, incarnations)
        self.reclaimer = Reclaimer(
            self.registry, self.engines, self.deadlines,
            auto=self.auto_reclaim, retries=self.reclaim_retries, backoff=self.reclaim_backoff,
        )
        self.publisher = Publisher(
            self.registry, self.engines, epoch=self.epoch, deadlines=self.deadlines,
            bucket_cap_bytes=self.bucket_cap_bytes, on_eligible=self.reclaimer.on_eligible,
        )
        self.sessions = SessionService(
            self.registry, self.engines, epoch=self.epoch, on_eligible=self.reclaimer.on_eligible,
        )
        self._started = True
        return self

    def _require_started(self) -> None:
        if not self._started:
            raise InvalidInput("call `await deployment.start()` first")

    async def state(self) -> RegistryState:
        """The registry's whole state (for reports and tests; sessions never need it)."""
        self._require_started()
        return (await self.registry.handle(ReadState())).reply

    async def settle(self) -> None:
        """Wait for background reclaims started by session closes and commits."""
        self._require_started()
        await self.reclaimer.settle()

    async def refresh_engines(self) -> dict[str, str]:
        """Tell the registry about engines that restarted (their READYs and stashes are void)."""
        found = {}
        for name, engine in self.engines.items():
            found[name] = await engine.incarnation()
            result = await self.registry.handle(RegisterEngine(name, found[name]))
            if result.effects:
                await self.publisher.control.run(result.effects)
        return found

    async def publish(self, snapshot: Snapshot, version_id: str) -> PublicationReport:
        self._require_started()
        await self.refresh_engines()
        return await self.publisher.publish(snapshot, version_id)

    async def reclaim(self, version: VersionKey):
        """Reclaim one RETIRED, unused version now (what ``auto_reclaim`` does in the background)."""
        self._require_started()
        return await self.reclaimer.reclaim(version)

    def session(self, session_id: str, nonce: str | None = None) -> Session:
        self._require_started()
        return self.sessions.session(session_id, nonce)


async def deploy(
    engines: Mapping[str, Any], *, epoch: int, enabled: bool, stash_dir: str | None = None, **options: Any
) -> Deployment | OverwriteDeployment:
    """The one switch. ``enabled=True``: a started :class:`Deployment` over
    :class:`~lorapub.ports.EngineAdmin` engines. ``enabled=False``: the old overwrite path
    over :class:`~lorapub.ports.OverwriteAdmin` engines (``options`` concern versioned
    publication only and are not used there)."""
    if enabled:
        return await Deployment(engines, epoch=epoch, stash_dir=stash_dir, **options).start()
    overwrite_engines: Mapping[str, OverwriteAdmin] = engines
    return await OverwriteDeployment(overwrite_engines, stash_dir=stash_dir).start()
