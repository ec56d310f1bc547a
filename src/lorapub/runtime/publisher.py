"""Publisher and Reclaimer: drive the core's effects on the target engines.

The publisher owns ``ReadyToCommit`` (it commits), the reclaimer owns
``ReclaimEligible`` (it reclaims); the effect runner hands each notice to its owner.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Callable, Mapping, cast

import attrs

from lorapub.core.attempt import Phase
from lorapub.core.effects import ReadyToCommit
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.manifest import BucketPlan
from lorapub.core.commands import (
    CancelWait,
    Commit,
    QueryAttempt,
    ReadState,
    ReadVersion,
    RecordFailure,
    RecordUnknown,
    RegisterEngine,
    Reserve,
    RetryCleanup,
)
from lorapub.core.registry import AttemptStatus, Result, ReserveReply, Waiting
from lorapub.core.version import CommitReceipt, VersionState
from lorapub.errors import (
    CapacityError,
    DeploymentClosed,
    InvalidInput,
    LorapubError,
    NumericMismatch,
    OutcomeUnknown,
    PublicationBlocked,
    PublicationFailed,
    PublicationSuperseded,
    UnknownVersion,
)
from lorapub.events import (
    Observer,
    PublishBegun,
    PublishCommitted,
    PublishFailed,
    PublishNumericMismatch,
    PublishProgress,
    PublishSuperseded,
    PublishWaiting,
)
from lorapub.ports import BucketSource, Clock, CopyStore, EndTimings, EngineAdmin, Registry, ReportsEndTimings
from lorapub.clock import SystemClock
from lorapub.runtime.fleet import FleetView
from lorapub.runtime.frozen import FrozenCopies
from lorapub.runtime.progress import progress_listener
from lorapub.runtime.retry import RetryPolicy
from lorapub.runtime.runner import Deadlines, EffectRunner, OnEligible, RunLog
from lorapub.snapshot import DEFAULT_BUCKET_CAP, InlineBucketSource, Snapshot
from lorapub.runtime.tasks import TaskOwner
from lorapub.runtime.engines import shared
from lorapub.runtime.publication_report import PublicationReport, WaitReport

__all__ = ["FrozenCopies", "Publisher"]

log = logging.getLogger(__name__)


@attrs.define
class _Call:
    """One publication running in this process, and how many callers await it."""

    digest: str
    task: asyncio.Future[PublicationReport]
    callers: int = 0
    progress: list[Callable[[PublishProgress], None]] = attrs.field(factory=list)  # each caller's progress callback
    closed_while: str | None = None  # "waiting" or "running": close() cancelled it then
    withdrawn: bool = False  # its last caller cancelled it: it only cleans up now, nobody joins it


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
        source_factory: Callable[[Snapshot, BucketPlan], BucketSource] | None = None,
        commit_retries: int = 5,
        clock: Clock | None = None,
        on_eligible: OnEligible | None = None,
        fleet: FleetView | None = None,
        tasks: TaskOwner | None = None,
        events: Observer | None = None,
        transport_name: str = "inline",
        copies: CopyStore | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.events: Observer = events or (lambda event: None)
        self.transport_name = transport_name  # how bucket bytes travel, for progress and byte counts
        self.registry = registry
        self.engines = shared(engines)  # the deployment's live set: membership changes it
        self.epoch = epoch
        self.deadlines = deadlines or Deadlines()
        self.bucket_cap_bytes = bucket_cap_bytes
        self.source_factory = source_factory or InlineBucketSource  # a Deployment gives its transport's
        self.commit_retries = commit_retries
        # a lost reserve or commit reply is replayed: waits of 50 ms, doubling, at most 1 s
        self.retry_policy = RetryPolicy(tries=commit_retries, first=0.05, factor=2.0, cap=1.0)
        self.fleet = fleet if fleet is not None else FleetView(registry, self.engines, deadline=self.deadlines.begin, clock=self.clock)
        self.tasks = tasks if tasks is not None else TaskOwner("lorapub-publisher")
        self.on_eligible = on_eligible
        self.publisher_id = uuid.uuid4().hex[:16]  # a replay of our own lost reserve resumes it
        self.frozen = FrozenCopies(copies)  # also kept in ``copies``, to outlive this process
        self._running: dict[VersionKey, _Call] = {}  # the publications running in this process
        self._waiting: set[VersionKey] = set()  # those of them waiting for a slot now
        self._reserve_in_flight: dict[VersionKey, asyncio.Future[Result[ReserveReply | Waiting]]] = {}  # a Reserve sent, its reply not read
        self._closed = False
        self.join_timeout = 2 * max(self.deadlines.begin, self.deadlines.bucket, self.deadlines.end)

    @property
    def control(self) -> EffectRunner:
        """Runs control-only effects (cleanup), which need no bucket source."""
        return EffectRunner(self.registry, self.engines, None, self.deadlines, on_eligible=self.on_eligible,
                            left=self.fleet.left)

    async def _reserve(self, command: Reserve) -> Result[ReserveReply | Waiting]:
        """Reserve; a lost reply is replayed with the same command (same publisher: it resumes)."""
        last: Exception | None = None
        async for _ in self.retry_policy.attempts(self.clock):
            # its own task, so a cancelled caller can still learn what the registry answered (_abort_own)
            sent = asyncio.ensure_future(self.registry.handle(command))
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())  # a reply nobody reads is not logged
            self._reserve_in_flight[command.key] = sent
            try:
                return await asyncio.shield(sent)
            except OutcomeUnknown as e:
                last = e
                log.warning("reserve %s: reply lost (%s); replaying it", command.key, e)
            finally:
                if sent.done() and self._reserve_in_flight.get(command.key) is sent:
                    del self._reserve_in_flight[command.key]
        raise OutcomeUnknown(
            f"reserve of {command.key} unanswered after {self.commit_retries} tries: {last}; "
            "publishing the same id and snapshot again resumes it", version=command.key,
        )

    #: How often a waiting publication asks again when nothing in this process wakes it.
    WAIT_POLL = 0.1

    async def publish(self, snapshot: Snapshot, version_id: str, *, wait: float = 0.0,
                      progress: Callable[[PublishProgress], None] | None = None) -> PublicationReport:
        """Publish ``snapshot`` as ``version_id``. With ``wait`` seconds, a call that finds every
        slot held (or another attempt running) waits for one; a newer publication supersedes it
        meanwhile (:class:`~lorapub.errors.PublicationSuperseded`). A second call for a version this
        process is already publishing joins the first (its report, ``reused=True``). ``progress``
        receives a :class:`~lorapub.events.PublishProgress` per phase and engine, and per bucket."""
        if not isinstance(snapshot, Snapshot):
            raise InvalidInput(f"publish takes a lorapub.Snapshot, not {type(snapshot).__name__}")
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait < float("inf"):
            raise InvalidInput(f"wait must be a finite number of seconds >= 0, got {wait!r}")
        if progress is not None and not callable(progress):
            raise InvalidInput(f"progress must be a callable taking a lorapub.events.PublishProgress, got {progress!r}")
        key = VersionKey(self.epoch, version_id)
        if self._closed:  # close() ran while the deployment checked this call: start nothing
            raise DeploymentClosed(f"the deployment was closed before publish of {key} began; nothing was sent — "
                                   "a closed deployment starts nothing: publish it on a new Deployment", version=key)
        call = self._running.get(key)
        if call is not None and call.withdrawn:
            # A cancelled call of this id still withdrawing its wait or aborting its attempt: a retry
            # starts afresh once that is done (asyncio.wait: cancelling the retry leaves the cleanup alone).
            await asyncio.wait([call.task], timeout=self.join_timeout)
            if self._running.get(key) is call:
                del self._running[key]
            call = None
        if call is None or call.digest != snapshot.digest:  # another digest: the registry says VERSION_CONFLICT
            # owned by the deployment's tasks (its outcome goes to its callers, so a failure is not logged
            # there): a cancelled one still cleaning its attempt is joined at close
            callbacks: list[Callable[[PublishProgress], None]] = []
            call = _Call(snapshot.digest, self.tasks.spawn(self._publish(snapshot, key, wait, callbacks),
                                                           name=f"publish-{key}", quiet=True), progress=callbacks)
            self._running[key] = call
            call.task.add_done_callback(lambda t: self._running.pop(key, None) if self._running.get(key) is call else None)
            joined = False
        else:
            joined = True
        if progress is not None:
            call.progress.append(progress)
        call.callers += 1
        try:
            report = await asyncio.shield(call.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and not current.cancelling():
                call.callers -= 1
                if call.closed_while is not None:  # not a caller: close() stopped the publication
                    raise self._closed_error(key, call.closed_while) from None
                # not this caller: the publication it joined was cancelled by the caller that started it
                raise PublicationBlocked(
                    f"the publication of {key} this call joined was cancelled by its caller; its attempt is "
                    "aborted and cleaned — publish again", version=key,
                ) from None
            # The caller gave up. The last one out aborts the attempt; the publication cleans it up
            # (shielded from this cancellation, bounded by the cleanup deadline), never leaves it ENDING.
            call.callers -= 1
            if call.callers == 0 and not call.task.done():
                call.withdrawn = True
                call.task.cancel()
            raise
        call.callers -= 1
        return attrs.evolve(report, reused=True) if joined else report

    @staticmethod
    def _closed_error(key: VersionKey, closed_while: str) -> DeploymentClosed:
        what = ("waited for a slot; it never began, nothing of it was sent or committed" if closed_while == "waiting"
                else "ran; its attempt is aborted and cleaned (a commit that had already landed stays)")
        return DeploymentClosed(f"the deployment was closed while publish of {key} {what} — a closed deployment "
                                "starts nothing: publish it on a new Deployment", version=key,
                                waiting=closed_while == "waiting")

    async def _publish(self, snapshot: Snapshot, key: VersionKey, wait: float,
                       progress: list[Callable[[PublishProgress], None]]) -> PublicationReport:
        """One publication, told as events: begun (and waiting), then committed, failed or superseded."""
        started = self.clock.monotonic()
        try:
            return await self._publish_once(snapshot, key, wait, progress, started)
        except PublicationSuperseded as e:
            by, waited = e.details.get("by"), e.details.get("waited", 0.0)
            self.events(PublishSuperseded(key, by if isinstance(by, VersionKey) else None,
                                          float(waited) if isinstance(waited, (int, float)) else 0.0))
            raise
        except LorapubError as e:
            # the whole message: its last sentence says what to do, and a cut log line would lose it
            self.events(PublishFailed(key, e.code, e.message, self.clock.monotonic() - started))
            raise
        except asyncio.CancelledError:
            self.events(PublishFailed(key, "CANCELLED", "the publish call was cancelled; its attempt is aborted "
                                      "and cleaned", self.clock.monotonic() - started))
            raise

    async def _publish_once(self, snapshot: Snapshot, key: VersionKey, wait: float,
                            progress: list[Callable[[PublishProgress], None]],
                            started: float) -> PublicationReport:
        plan = snapshot.plan(self.bucket_cap_bytes)
        try:
            reserved, waited, waited_for = await self._reserve_attempt(key, snapshot, plan, wait, started)
        except asyncio.CancelledError:
            # The registry may have applied our Reserve while its reply travelled (an actor's reply takes a
            # round trip): whatever attempt of ours it started is aborted and cleaned, never left BEGINNING.
            abort = self.tasks.spawn(self._abort_own(key), name=f"abort-own-{key}", key=("abort", key))
            await asyncio.gather(asyncio.shield(abort), return_exceptions=True)
            raise
        reply = reserved.reply
        reserved_at = self.clock.monotonic()
        if not reply.created:
            # another process's publication (a restarted trainer's, say): this process holds the same
            # snapshot, so it keeps the frozen copy a restarted engine is re-provisioned from
            self.frozen.keep(key, snapshot)
            report = await self._existing(key, reply, started)
            return attrs.evolve(report, waited=waited, waited_for=waited_for)
        self.frozen.keep(key, snapshot)
        self.events(PublishBegun(key, reply.lora_name, plan.total_bytes, len(plan), tuple(sorted(self.engines))))
        ready: list[ReadyToCommit] = []
        runner = EffectRunner(
            self.registry, self.engines, self.source_factory(snapshot, plan), self.deadlines,
            on_ready=ready.append, on_eligible=self.on_eligible, probe=snapshot.probe, lora_name=reply.lora_name,
            left=self.fleet.left,
        )
        try:
            runlog = await runner.run(reserved.effects, RunLog(self.clock, listener=progress_listener(
                key, plan, self.engines, progress, self.events, self.transport_name)))
            status = (await self.registry.handle(QueryAttempt(reply.token))).reply
            if status.phase is Phase.READY and ready:
                await self._confirm_lives(reply.token, status.targets, runlog)
                status = (await self.registry.handle(QueryAttempt(reply.token))).reply
            if status.phase is Phase.READY and ready:
                receipt = await self._commit(key, reply.token, ready[-1].expected_default_revision, runlog)
                report = PublicationReport(
                    key, reply.lora_name, receipt, VersionState.PUBLISHED, self.clock.monotonic() - started,
                    runlog.phase_seconds(), runlog.collectives, waited=waited, waited_for=waited_for,
                    engine_phases=self._engine_phases(runlog, reply.token),
                )
                phases = {"reserve": reserved_at - started, **{p: report.phases[p] for p in
                                                              ("begin", "transfer", "end", "probe", "commit")
                                                              if p in report.phases}}
                self.events(PublishCommitted(key, receipt.default_revision, receipt.retired, report.seconds, waited,
                                             plan.total_bytes, phases))
                return report
        except asyncio.CancelledError:
            # owned by the deployment's tasks: close() waits for it, and a second cancel does not stop it
            abort = self.tasks.spawn(self._abort(reply.token, "its publish call was cancelled"),
                                     name=f"abort-{reply.token}", key=("abort", reply.token))
            await asyncio.gather(asyncio.shield(abort), return_exceptions=True)
            raise
        self.fleet.changed()  # the attempt is over: another waiting publication may go
        why = "; ".join(runlog.failures + runlog.unknown) or status.phase.value
        if runlog.mismatches:  # the numeric READY gate refused it: no READY was recorded, the default stays
            engine, mismatch = sorted(runlog.mismatches.items())[0]
            for name, m in sorted(runlog.mismatches.items()):
                self.events(PublishNumericMismatch(key, name, m.sequence, m.position, m.expected, m.observed,
                                                   m.mean_abs))
            cleaned = status.phase is Phase.CLEAN
            raise NumericMismatch(
                f"{key}: engine {engine} did not reproduce the snapshot's probe under {reply.lora_name} "
                f"({mismatch.describe()}); the attempt failed, the default did not move"
                + ("" if cleaned else " and its cleanup is not confirmed yet (lorapub retries it)"),
                version=key, engine=engine, cleaned=cleaned, **mismatch.details(),
            )
        if status.phase is Phase.CLEAN:
            raise PublicationFailed(f"{key} failed and was cleaned on every engine: {why}", version=key)
        raise PublicationBlocked(
            f"{key} failed and cleanup is not confirmed on every engine "
            f"({', '.join(f'{e}: {t}' for e, t in status.targets)}); its slot stays "
            f"held until a cleanup is confirmed — lorapub retries it in the background "
            f"(`await deployment.reconcile()` retries it now): {why}",
            version=key, failed=True,  # this publication failed; it is not waiting behind another
        )

    async def _abort(self, token: AttemptToken, reason: str) -> None:
        """Abort an attempt this publisher no longer drives and clean it on every engine, within the
        cleanup deadline (what is not confirmed then is the reconciler's). A committed attempt
        stays committed: the abort of it changes nothing."""
        try:
            async with asyncio.timeout(2 * self.deadlines.cleanup):
                result = await self.registry.handle(RecordFailure(token, "publisher", reason))
                await self.control.run(result.effects)
        except (LorapubError, TimeoutError) as e:
            log.warning("abort of %s (%s) not finished: %s; the reconciler cleans it", token, reason, e)
        self.fleet.changed()

    async def _reserve_attempt(self, key: VersionKey, snapshot: Snapshot, plan: BucketPlan, wait: float,
                               started: float) -> tuple[Result[ReserveReply], float, WaitReport | None]:
        """The reserve: ``(result, waited, WaitReport)``. CAPACITY_ERROR and PUBLICATION_BLOCKED come before
        any begin (or, waiting, SUPERSEDED)."""
        reserved, waited, waited_for = await self._reserve_slot(Reserve(key, snapshot.digest, plan, self.publisher_id),
                                                                wait, started)
        reply = reserved.reply
        if not reply.created:
            status = (await self.registry.handle(QueryAttempt(reply.token))).reply
            if status.publisher == self.publisher_id and status.phase in (Phase.BEGINNING, Phase.TRANSFERRING, Phase.ENDING):
                # Our own attempt, which an earlier call of ours left behind (it raised OUTCOME_UNKNOWN):
                # nobody drives it. Abort and clean it, then publish afresh (every step is idempotent).
                log.warning("publication of %s: taking over our own unfinished attempt %s", key, reply.token)
                await self._abort(reply.token, "replayed by its own publisher after an unknown outcome")
                reserved, _, _ = await self._reserve_slot(Reserve(key, snapshot.digest, plan, self.publisher_id), 0.0, started)
        return reserved, waited, waited_for

    async def _abort_own(self, key: VersionKey) -> None:
        """A call cancelled while it reserved: wait (bounded) for the registry's answer to a Reserve still
        in flight, then abort the attempt of ``key`` that this publisher started and nobody drives now."""
        sent = self._reserve_in_flight.pop(key, None)
        if sent is not None:
            await asyncio.wait([sent], timeout=self.deadlines.commit)
        try:
            async with asyncio.timeout(self.deadlines.commit):
                found = (await self.registry.handle(ReadVersion(key))).reply
                status = (await self.registry.handle(QueryAttempt(found.attempt))).reply
        except UnknownVersion:
            return  # the registry never reserved it: nothing to abort
        except (LorapubError, TimeoutError) as e:
            log.warning("publication of %s cancelled while it reserved; its attempt is not known (%s): the "
                        "reconciler aborts one left behind once it stops making progress", key, e)
            return
        if status.publisher == self.publisher_id and status.phase in (Phase.BEGINNING, Phase.TRANSFERRING,
                                                                      Phase.ENDING):
            await self._abort(found.attempt, "its publish call was cancelled while it reserved")

    async def _reserve_slot(self, command: Reserve, wait: float, started: float) -> tuple[Result[ReserveReply], float, WaitReport | None]:
        """Reserve, waiting up to ``wait`` seconds for a slot: ``(result, waited, WaitReport)``.
        A call cancelled meanwhile withdraws its wait, so no waiter outlives its caller."""
        try:
            return await self._reserve_or_wait(command, wait, started)
        except (CapacityError, PublicationBlocked) as e:
            raise await self._with_reachability(e) from None
        except asyncio.CancelledError:
            if wait:  # the registry may hold us as its waiter (even if the cancel hit our reserve)
                await self._withdraw_wait(command.key)
            raise
        finally:
            self._waiting.discard(command.key)

    async def _with_reachability(self, e: CapacityError | PublicationBlocked) -> CapacityError | PublicationBlocked:
        """A refusal whose slots wait on engines' confirmations, told whether those engines answer now:
        one that does confirms once its running requests end; one that does not is the operator's to fix."""
        said = e.details.get("waiting_on_engines")
        engines = [n for n in said if isinstance(n, str)] if isinstance(said, (list, tuple)) else []
        if not engines:
            return e
        lives = await self.fleet.lives(engines, inventory=False, deadline=min(2.0, self.deadlines.begin))
        silent = sorted(n for n, life in lives.items() if life.error is not None)
        said = (f" Now {', '.join(silent)} does not answer: bring it back, or Deployment.remove_engine(name) "
                "frees what it holds." if silent else "")
        return type(e)(e.message + said, **{**e.details, "unreachable_engines": silent})

    async def _reserve_or_wait(self, command: Reserve, wait: float, started: float) -> tuple[Result[ReserveReply], float, WaitReport | None]:
        deadline = started + wait
        waited_for: WaitReport | None = None
        described = -1.0
        while True:
            remaining = deadline - self.clock.monotonic()
            try:
                result = await self._reserve(attrs.evolve(command, wait=remaining if remaining > 0 else None))
            except PublicationSuperseded as e:
                waited = self.clock.monotonic() - started
                # a call refused at once (its version was superseded before this call) never waited,
                # however long the registry took to say so
                said = f" (it waited {waited:.2f}s for: {waited_for.describe()})" if waited_for else ""
                raise PublicationSuperseded(
                    f"{e.message}{said}",
                    **e.details, waited=waited,
                ) from None
            except (CapacityError, PublicationBlocked) as e:
                if waited_for is None:
                    raise
                await self._cancel_wait(command.key)
                waited = self.clock.monotonic() - started
                raise type(e)(f"{e.message} (waited {waited:.2f}s for: {waited_for.describe()})", **e.details,
                              waited=waited) from None
            reply = result.reply
            if not isinstance(reply, Waiting):
                waited = self.clock.monotonic() - started if waited_for is not None else 0.0
                return cast("Result[ReserveReply]", result), waited, waited_for  # not Waiting: a ReserveReply
            now = self.clock.monotonic()
            self._waiting.add(command.key)
            if waited_for is None:
                self.events(PublishWaiting(command.key, reply.describe()))
            if waited_for is None or now - described >= 1.0:  # engines asked at most once a second
                waited_for = await self._describe_wait(reply)
                described = now
            else:
                waited_for = attrs.evolve(waited_for, reason=reply.describe(), holders=reply.holders)
            if now >= deadline:
                continue  # one last ask without waiting: a slot, or the typed refusal with the wait report
            wakeup = self.fleet.change()
            try:
                async with asyncio.timeout(min(self.WAIT_POLL, max(0.0, deadline - now))):  # a poll; the deadline is the clock's
                    await wakeup.wait()
            except TimeoutError:
                pass

    async def _cancel_wait(self, key: VersionKey) -> None:
        try:
            async with asyncio.timeout(self.deadlines.commit):
                await self.registry.handle(CancelWait(key))
        except (LorapubError, TimeoutError) as e:
            # a lost reply leaves the waiter only until the wait it asked for ends: each reserve
            # records that time (Waiter.until), and the next lease pass drops a waiter past it
            log.debug("cancel wait of %s: %s", key, e)

    async def _withdraw_wait(self, key: VersionKey) -> None:
        """CancelWait for a call being cancelled: run as a task of its own and shielded, so the
        cancellation (or a second one) does not stop the withdrawal; the deployment's close() joins it."""
        if self.tasks.closed:  # nothing starts there any more: withdraw from this task, still bounded
            await self._cancel_wait(key)
            return
        withdraw = self.tasks.spawn(self._cancel_wait(key), name=f"cancel-wait-{key}", key=("cancel-wait", key))
        await asyncio.gather(asyncio.shield(withdraw), return_exceptions=True)

    async def _describe_wait(self, reply: Waiting) -> WaitReport:
        """The wait reply, with the requests still running on the versions being reclaimed."""
        running: dict[str, dict[str, int]] = {}
        reclaiming = {h.version for h in reply.holders if h.state is VersionState.RECLAIMING}
        if reclaiming:
            names = {}
            for h in reply.holders:
                if h.version in reclaiming:
                    names[h.version] = (await self.registry.handle(ReadVersion(h.version))).reply.lora_name
            for engine_name, life in sorted((await self.fleet.lives()).items()):
                if life.inventory is None:  # keeps none, or did not answer: the report only, it says nothing
                    continue
                held = life.inventory.adapters
                for version, name in names.items():
                    if name in held:
                        running.setdefault(str(version), {})[engine_name] = held[name].refs
        return WaitReport(reply.describe(), reply.holders, running, reply.attempt)

    def _engine_phases(self, runlog: RunLog, token: AttemptToken) -> dict[str, dict[str, float]]:
        """Each engine's phases, with the breakdown of its ``end`` where its adapter keeps one."""
        phases = runlog.engine_phase_seconds()
        for name, engine in self.engines.items():
            if isinstance(engine, ReportsEndTimings) and callable(engine.end_timings):  # (an older adapter's was a dict)
                timings = engine.end_timings(token)
                if isinstance(timings, EndTimings):
                    phases.setdefault(name, {}).update(timings.phases())
        return phases

    async def close(self, grace: float = 5.0) -> None:
        """Cancel the publications still running in this process (each aborts and cleans its attempt)
        and wait up to ``grace`` s for those cleanups; the reconciler of the next process finishes
        what is left."""
        self._closed = True
        for key, call in self._running.items():  # its callers are told the deployment closed, and while doing what
            call.closed_while = "waiting" if key in self._waiting else "running"
        running = [c.task for c in self._running.values()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=grace)
        await self.tasks.wait(grace, kind="abort")

    async def _confirm_lives(self, token: AttemptToken, targets: tuple[tuple[str, str], ...], runlog: RunLog) -> None:
        """Re-check every target's life right before commit: a READY from a life that has
        since ended is void, and the attempt aborts and is cleaned (the default stays)."""
        for engine_name, _ in targets:
            try:
                incarnation = await self.fleet.incarnation(engine_name)
            except Exception as e:
                runlog.unknown.append(f"{engine_name} pre-commit life check: {e}")
                result: Result[Phase | None] = await self.registry.handle(
                    RecordUnknown(token, engine_name, "pre-commit life check"))
            else:
                result = await self.registry.handle(RegisterEngine(engine_name, incarnation))
                if result.effects:
                    runlog.failures.append(f"{engine_name} restarted after READY (now {incarnation})")
            await self.control.run(result.effects)

    async def _existing(self, key: VersionKey, reply: ReserveReply, started: float) -> PublicationReport:
        status = (await self.registry.handle(QueryAttempt(reply.token))).reply
        # Another publisher runs this very version (same id and digest): join it.
        waited, pause = 0.0, 0.02
        while status.phase in (Phase.BEGINNING, Phase.TRANSFERRING, Phase.ENDING) and waited < self.join_timeout:
            await asyncio.sleep(pause)  # a poll of another publisher's engine I/O: real time, like its deadlines
            waited += pause
            pause = min(pause * 2, 0.5)
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
        if status.phase is Phase.CLEAN:
            raise PublicationFailed(
                f"the attempt {reply.token} of {key} that this call joined failed and was cleaned; "
                "publish the same id and snapshot again to start a fresh attempt", version=key,
            )
        if status.phase is Phase.ABORTED:
            raise PublicationBlocked(
                f"{key}: attempt {reply.token} failed and its cleanup is not confirmed yet; lorapub retries it "
                "in the background (`await deployment.reconcile()` retries it now), then publish again",
                version=key,
            )
        raise PublicationBlocked(
            f"{key}: attempt {reply.token} is still {status.phase.value} after {self.join_timeout:g}s; publish "
            "again later — if its publisher died, the reconciler aborts and cleans it once it stops making "
            "progress", version=key,
        )

    async def _commit(self, key: VersionKey, token: AttemptToken, revision: int, runlog: RunLog) -> CommitReceipt:
        """Commit, and on a lost reply retry the same commit: never clean B, never start another."""
        runlog.mark("commit")
        last: Exception | None = None
        async for _ in self.retry_policy.attempts(self.clock):
            try:
                async with asyncio.timeout(self.deadlines.commit):
                    result = await self.registry.handle(Commit(key, token, revision))
            except (OutcomeUnknown, TimeoutError, ConnectionError) as e:
                last = e
                log.warning("commit %s: reply lost (%s); replaying the same commit", token, e)
                continue
            runlog.mark("commit")
            await self.control.run(result.effects)  # the retired version may be reclaimable now
            receipt: CommitReceipt = result.reply  # a Commit's reply
            return receipt
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
        status: AttemptStatus = (await self.registry.handle(QueryAttempt(token))).reply
        return status.phase
