"""Publisher and Reclaimer: drive the core's effects on the target engines.

The publisher owns ``ReadyToCommit`` (it commits), the reclaimer owns
``ReclaimEligible`` (it reclaims); the effect runner hands each notice to its owner.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Mapping

import attrs

from lorapub.core.attempt import Phase
from lorapub.core.effects import ReadyToCommit
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.commands import (
    ClaimReclaim,
    Commit,
    ListReclaimable,
    QueryAttempt,
    ReadState,
    ReadVersion,
    RecordFailure,
    Reserve,
    RetryCleanup,
    RetryReclaim,
)
from lorapub.core.version import CommitReceipt, VersionState
from lorapub.errors import LorapubError, OutcomeUnknown, PublicationBlocked
from lorapub.ports import BucketSource, Clock, EngineAdmin, Registry
from lorapub.runtime.clock import SystemClock
from lorapub.runtime.runner import Deadlines, EffectRunner, OnEligible, RunLog
from lorapub.runtime.snapshot import DEFAULT_BUCKET_CAP, InlineBucketSource, Snapshot

log = logging.getLogger(__name__)


class PublicationFailed(LorapubError):
    """The candidate failed and was cleaned on every engine; the default did not move."""

    code = "PUBLICATION_FAILED"


@attrs.frozen
class PublicationReport:
    """What one ``publish`` did: the version, its engine-side name and the commit receipt."""

    version: VersionKey
    lora_name: str
    receipt: CommitReceipt | None
    state: VersionState
    seconds: float
    phases: Mapping[str, float]
    collectives: int
    reused: bool = False


class Publisher:
    """One publisher, at most one attempt at a time (the registry enforces both)."""

    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        *,
        epoch: int,
        deadlines: Deadlines | None = None,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP,
        source_factory: Callable[[Snapshot, Any], BucketSource] = InlineBucketSource,
        commit_retries: int = 5,
        clock: Clock | None = None,
        on_eligible: OnEligible | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.registry = registry
        self.engines = dict(engines)
        self.epoch = epoch
        self.deadlines = deadlines or Deadlines()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.source_factory = source_factory
        self.commit_retries = commit_retries
        self.on_eligible = on_eligible

    @property
    def control(self) -> EffectRunner:
        """Runs control-only effects (cleanup), which need no bucket source."""
        return EffectRunner(self.registry, self.engines, None, self.deadlines, on_eligible=self.on_eligible)

    async def publish(self, snapshot: Snapshot, version_id: str) -> PublicationReport:
        started = self.clock.monotonic()
        key = VersionKey(self.epoch, version_id)
        plan = snapshot.plan(self.bucket_cap_bytes)
        reserved = await self.registry.handle(Reserve(key, snapshot.digest, plan))  # CAPACITY_ERROR before any begin
        reply = reserved.reply
        if not reply.created:
            return await self._existing(key, reply, started)
        ready: list[ReadyToCommit] = []
        runner = EffectRunner(
            self.registry, self.engines, self.source_factory(snapshot, plan), self.deadlines,
            on_ready=ready.append, on_eligible=self.on_eligible,
        )
        runlog = await runner.run(reserved.effects, RunLog(self.clock))
        status = (await self.registry.handle(QueryAttempt(reply.token))).reply
        if status.phase is Phase.READY and ready:
            receipt = await self._commit(key, reply.token, ready[-1].expected_default_revision, runlog)
            return PublicationReport(
                key, reply.lora_name, receipt, VersionState.PUBLISHED, self.clock.monotonic() - started,
                runlog.phase_seconds(), runlog.collectives,
            )
        why = "; ".join(runlog.failures + runlog.unknown) or status.phase.value
        if status.phase is Phase.CLEAN:
            raise PublicationFailed(f"{key} failed and was cleaned on every engine: {why}", version=key)
        raise PublicationBlocked(
            f"{key} failed and cleanup is not confirmed on every engine ({status.targets}); "
            f"its slot stays held until retry_cleanup() confirms it: {why}",
            version=key,
        )

    async def _existing(self, key: VersionKey, reply, started: float) -> PublicationReport:
        status = (await self.registry.handle(QueryAttempt(reply.token))).reply
        if status.phase is Phase.COMMITTED:
            return PublicationReport(
                key, reply.lora_name, status.commit, status.version_state, self.clock.monotonic() - started, {}, 0, True
            )
        if status.phase is Phase.READY:
            # A publisher that lost the commit reply (or died after READY) finishes the same commit.
            receipt = await self._commit(key, reply.token, reply.expected_default_revision, RunLog(self.clock))
            return PublicationReport(
                key, reply.lora_name, receipt, VersionState.PUBLISHED, self.clock.monotonic() - started, {}, 0, True
            )
        raise PublicationBlocked(
            f"{key} is already {status.phase.value} from an earlier attempt; call recover() to abort and clean it",
            version=key,
        )

    async def _commit(self, key: VersionKey, token: AttemptToken, revision: int, runlog: RunLog) -> CommitReceipt:
        """Commit, and on a lost reply retry the same commit: never clean B, never start another."""
        runlog.mark("commit")
        last: Exception | None = None
        for attempt in range(self.commit_retries):
            try:
                async with asyncio.timeout(self.deadlines.commit):
                    result = await self.registry.handle(Commit(key, token, revision))
            except (OutcomeUnknown, TimeoutError, ConnectionError) as e:
                last = e
                log.warning("commit %s: reply lost (%s); replaying the same commit", token, e)
                await self.clock.sleep(min(0.05 * 2**attempt, 1.0))
                continue
            runlog.mark("commit")
            await self.control.run(result.effects)  # the retired version may be reclaimable now
            return result.reply
        raise OutcomeUnknown(f"commit of {token} unanswered after {self.commit_retries} tries: {last}", token=token)

    async def recover(self) -> list[str]:
        """Abort a dangling attempt left by a dead publisher and drive its cleanup."""
        state = (await self.registry.handle(ReadState())).reply
        notes = []
        for version in state.versions.values():
            a = state.attempts[version.attempt]
            if a.resolved:
                continue
            if a.phase is Phase.ABORTED:
                phase = await self.retry_cleanup(a.token)
            else:
                result = await self.registry.handle(RecordFailure(a.token, "publisher", "recovered after restart"))
                await self.control.run(result.effects)
                phase = (await self.registry.handle(QueryAttempt(a.token))).reply.phase
            notes.append(f"{a.token}: {phase.value}")
        return notes

    async def retry_cleanup(self, token: AttemptToken) -> Phase:
        result = await self.registry.handle(RetryCleanup(token))
        await self.control.run(result.effects)
        return (await self.registry.handle(QueryAttempt(token))).reply.phase


class Reclaimer:
    """unregister -> native wait_for_unload -> unload once -> confirm, on every engine.

    The one owner of ``ReclaimEligible``: :meth:`on_eligible` starts a background
    reclaim (when ``auto``) that retries engines whose UNLOADED receipt did not come.
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
    ) -> None:
        self.registry = registry
        self.engines = dict(engines)
        self.deadlines = deadlines or Deadlines()
        self.auto = auto
        self.retries = retries
        self.backoff = backoff
        self._background: set[asyncio.Task] = set()

    @property
    def control(self) -> EffectRunner:
        return EffectRunner(self.registry, self.engines, None, self.deadlines)

    async def reclaim(self, key: VersionKey) -> VersionState:
        result = await self.registry.handle(ClaimReclaim(key))
        await self.control.run(result.effects)
        return (await self.registry.handle(ReadVersion(key))).reply.state

    async def retry(self, key: VersionKey) -> VersionState:
        result = await self.registry.handle(RetryReclaim(key))
        await self.control.run(result.effects)
        return (await self.registry.handle(ReadVersion(key))).reply.state

    async def reclaim_eligible(self) -> dict[VersionKey, VersionState]:
        return {key: await self.reclaim(key) for key in (await self.registry.handle(ListReclaimable())).reply}

    def on_eligible(self, version: VersionKey) -> None:
        if not self.auto:
            return
        task = asyncio.get_running_loop().create_task(self._reclaim_until_done(version))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reclaim_until_done(self, version: VersionKey) -> None:
        """Reclaim, and retry engines whose UNLOADED receipt did not come (unload is idempotent)."""
        state = await self.reclaim(version)
        for attempt in range(self.retries):
            if state is not VersionState.RECLAIMING:
                return
            await asyncio.sleep(self.backoff * 2**attempt)
            state = await self.retry(version)

    async def settle(self) -> None:
        """Wait for the background reclaims started by :meth:`on_eligible`."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
