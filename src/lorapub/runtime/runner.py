"""Executes the core's effects against engines and feeds every outcome back as the matching registry
command (:class:`EffectRunner`); it decides nothing.
See docs/design.md, "Shape".
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence, TypeVar

import attrs

from lorapub.core.effects import (
    SOURCE,
    Effect,
    Ignored,
    ReadyToCommit,
    ReclaimEligible,
    SendBegin,
    SendCleanup,
    SendEnd,
    SendReclaim,
    TransferBucket,
)
from lorapub.core.attempt import ReadyLocal
from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.registry import Result
from lorapub.core.commands import (
    RecordBucketDone,
    RecordCleaned,
    RecordFailure,
    RecordPrepared,
    RecordReady,
    RecordUnknown,
    RecordUnloaded,
    RegisterEngine,
)
from lorapub.errors import EngineError, InvalidInput, LorapubError, OutcomeUnknown, UnknownEngine, VersionMissing
from lorapub.ports import BucketSource, Clock, EngineAdmin, Registry
from lorapub.clock import SystemClock
from lorapub.runtime.engines import shared
from lorapub.probe import Mismatch, Probe, compare, observe

__all__ = ["OnReady", "OnEligible", "Deadlines", "RunLog", "EffectRunner"]

log = logging.getLogger(__name__)

OnReady = Callable[[ReadyToCommit], None]
OnEligible = Callable[[VersionKey], Awaitable[None] | None]

_T = TypeVar("_T")
#: The effects that are run against an engine or the source (the two notices are handed on, Ignored is logged).
_Executable = SendBegin | TransferBucket | SendEnd | SendCleanup | SendReclaim


def _seconds(instance: object, attribute: "attrs.Attribute[float]", value: object) -> None:
    """A deadline is a positive, finite number of seconds: NaN, infinity, zero, a negative
    number, a bool or a string would silently disable a timeout (or the stale-attempt rule)."""
    try:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < float(value) < math.inf
    except OverflowError:  # an int too large for a float: no timer can wait that long
        ok = False
    if not ok:
        raise InvalidInput(
            f"Deadlines.{attribute.name} must be a positive, finite number of seconds (an int or a float), "
            f"got {value!r} ({type(value).__name__})"
        )


@attrs.define
class Deadlines:
    """Per-phase deadlines in seconds. A deadline that passes is an unknown outcome.

    Each is a positive, finite int or float, checked when set (:class:`~lorapub.errors.InvalidInput`
    naming the field otherwise)."""

    begin: float = attrs.field(default=30.0, validator=_seconds)
    bucket: float = attrs.field(default=120.0, validator=_seconds)
    end: float = attrs.field(default=120.0, validator=_seconds)
    cleanup: float = attrs.field(default=60.0, validator=_seconds)
    commit: float = attrs.field(default=10.0, validator=_seconds)
    reclaim: float = attrs.field(default=600.0, validator=_seconds)


@attrs.define
class RunLog:
    """What happened while running effects, for reports and tests (never read to decide)."""

    clock: Clock = attrs.field(factory=SystemClock)

    ignored: list[str] = attrs.field(factory=list)
    failures: list[str] = attrs.field(factory=list)
    unknown: list[str] = attrs.field(factory=list)
    collectives: int = 0
    phase_started: dict[str, float] = attrs.field(factory=dict)
    phase_ended: dict[str, float] = attrs.field(factory=dict)
    # engines whose probe did not reproduce the reference: engine -> Mismatch (the numeric READY gate)
    mismatches: dict[str, Mismatch] = attrs.field(factory=dict)
    # told of every phase boundary (phase, engine, bucket index or None): a publication's progress
    listener: Callable[[str, str | None, int | None], None] | None = None

    def mark(self, phase: str, engine: str | None = None) -> None:
        now = self.clock.monotonic()
        self.phase_started.setdefault(phase, now)
        self.phase_ended[phase] = now
        if engine is not None:
            self.phase_started.setdefault(f"{phase}@{engine}", now)
            self.phase_ended[f"{phase}@{engine}"] = now
        if self.listener is not None:
            self.listener(phase, engine, None)

    def bucket_done(self, engine: str, index: int) -> None:
        """``engine`` confirmed bucket ``index``."""
        if self.listener is not None:
            self.listener("transfer", engine, index)

    def phase_seconds(self) -> dict[str, float]:
        """Each phase's span (first start to last end), over every engine."""
        return {p: self.phase_ended[p] - t for p, t in self.phase_started.items() if "@" not in p}

    def engine_phase_seconds(self) -> dict[str, dict[str, float]]:
        """``engine -> phase -> seconds``: each phase's span on one engine (its transfer half, its end…)."""
        out: dict[str, dict[str, float]] = {}
        for key, t in self.phase_started.items():
            if "@" in key:
                phase, engine = key.split("@", 1)
                out.setdefault(engine, {})[phase] = self.phase_ended[key] - t
        return out


class EffectRunner:
    """Executes the core's effects against engines and feeds every outcome back; it decides nothing.

    A reply becomes the matching registry command, an engine's "no" becomes ``RecordFailure``, a
    timeout or lost connection becomes ``RecordUnknown``. New effects from those commands run in
    turn until none is left. The two notices are handed to their one owner each:
    ``ReadyToCommit`` to ``on_ready`` (the publisher), ``ReclaimEligible`` to ``on_eligible`` (the
    reclaimer).
    """

    def __init__(
        self,
        registry: Registry,
        engines: Mapping[str, EngineAdmin],
        source: BucketSource | None = None,
        deadlines: Deadlines | None = None,
        *,
        on_ready: OnReady | None = None,
        on_eligible: OnEligible | None = None,
        probe: Probe | None = None,
        lora_name: str | None = None,
        left: Callable[[str], asyncio.Event] | None = None,
    ) -> None:
        if source is not None and not isinstance(getattr(source, "collective", None), bool):
            raise InvalidInput(f"bucket source {type(source).__name__} does not say whether it is collective "
                               "(lorapub.ports.BucketSource.collective: True or False)")
        self.registry = registry
        self.engines = shared(engines)  # the deployment's live set: membership changes it
        self.source = source
        self.deadlines = deadlines or Deadlines()
        self.on_ready = on_ready
        self.on_eligible = on_eligible
        if probe is not None and not lora_name:
            raise InvalidInput("a probe runs under the exact version name: pass lora_name with it")
        self.probe = probe  # the numeric READY gate: no READY until the engine reproduces it
        self.lora_name = lora_name
        self.left = left  # engine -> the event set when it leaves the fleet (FleetView.left)

    async def run(self, effects: Iterable[Effect], runlog: RunLog | None = None) -> RunLog:
        runlog = runlog or RunLog()
        pending: set[asyncio.Task[Sequence[Effect]]] = set()
        eligible: list[VersionKey] = []

        def schedule(batch: Iterable[Effect]) -> None:
            for fx in batch:
                if isinstance(fx, ReadyToCommit):
                    if self.on_ready is not None:
                        self.on_ready(fx)
                elif isinstance(fx, ReclaimEligible):
                    eligible.append(fx.version)
                elif isinstance(fx, Ignored):
                    runlog.ignored.append(fx.reason)
                    log.debug("ignored: %s", fx.reason)
                else:
                    pending.add(asyncio.ensure_future(self._timed(fx, runlog)))

        schedule(effects)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    pending.discard(task)
                    result = task.result()  # a registry that cannot be reached raises here
                    if result:
                        schedule(result)
        finally:
            # Never leave engine calls running unobserved; what they did stays unknown to the
            # registry, which keeps the attempt unresolved (recover() cleans it).
            for task in pending:
                task.cancel()
        for version in eligible:
            if self.on_eligible is None:
                log.debug("%s is reclaimable; no reclaimer is attached", version)
                continue
            maybe = self.on_eligible(version)
            if asyncio.iscoroutine(maybe):
                await maybe
        return runlog

    async def _call(self, seconds: float, awaitable: Awaitable[_T], engine: str | None = None) -> _T:
        """``awaitable`` within ``seconds`` (OUTCOME_UNKNOWN past them); a call to an engine that is
        removed from the fleet meanwhile stops at once (ENGINE_ERROR): nothing waits on a member gone."""
        if engine is None or self.left is None:
            try:
                async with asyncio.timeout(seconds):
                    return await awaitable
            except TimeoutError:
                raise OutcomeUnknown(f"no answer within {seconds:g}s") from None
        call = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self.left(engine).wait())
        try:
            done, _ = await asyncio.wait({call, gone}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            call.cancel()
            gone.cancel()
        if call in done:
            return call.result()
        if gone in done:
            raise EngineError(f"{engine} was removed from the fleet while this call waited on it", engine=engine)
        raise OutcomeUnknown(f"no answer within {seconds:g}s")

    _PHASES = {SendBegin: "begin", TransferBucket: "transfer", SendEnd: "end", SendCleanup: "cleanup", SendReclaim: "reclaim"}

    async def _timed(self, fx: _Executable, runlog: RunLog) -> Sequence[Effect]:
        phase = self._PHASES.get(type(fx), "other")
        engine = None if isinstance(fx, TransferBucket) else fx.engine  # a bucket goes to several engines
        runlog.mark(phase, engine)
        try:
            return await self._execute(fx, runlog)
        finally:
            runlog.mark(phase, engine)

    def _engine(self, name: str) -> EngineAdmin:
        try:
            return self.engines[name]
        except KeyError:
            raise UnknownEngine(f"the registry targets {name!r}, which this process has no adapter for: "
                                "Deployment.add_engine(<its adapter>) gives it one", engine=name) from None

    async def _execute(self, fx: _Executable, runlog: RunLog) -> Sequence[Effect]:
        """Run one effect. A target this process has no adapter for (a member another process added)
        was sent nothing: a begin, bucket or end to it fails the attempt (which aborts and is cleaned,
        never left running), a cleanup or an unload to it stays unconfirmed."""
        try:
            return await self._execute_on(fx, runlog)
        except UnknownEngine as e:
            engine = e.details.get("engine")
            if isinstance(fx, (SendBegin, SendEnd, TransferBucket)) and isinstance(engine, str):
                runlog.failures.append(f"{engine}: {e.message}")
                return (await self.registry.handle(RecordFailure(fx.token, engine, e.message))).effects
            if isinstance(fx, SendCleanup):
                runlog.unknown.append(f"{fx.engine} cleanup {fx.token}: {e.message}")
                return (await self.registry.handle(RecordUnknown(fx.token, fx.engine, "cleanup"))).effects
            if isinstance(fx, SendReclaim):
                runlog.unknown.append(f"{fx.engine} reclaim {fx.version}: {e.message}")
                return ()  # stays RECLAIMING with its slot; RetryReclaim later
            raise

    async def _execute_on(self, fx: _Executable, runlog: RunLog) -> Sequence[Effect]:
        reg, d = self.registry, self.deadlines
        if isinstance(fx, SendBegin):
            engine = self._engine(fx.engine)
            return await self._guarded(
                fx.token, fx.engine, "begin", runlog,
                lambda: self._call(d.begin, engine.begin(fx), fx.engine),
                lambda inc: reg.handle(RecordPrepared(fx.token, fx.engine, inc)),
            )
        if isinstance(fx, TransferBucket):
            runlog.collectives += 1
            return await self._transfer(fx, runlog)
        if isinstance(fx, SendEnd):
            engine = self._engine(fx.engine)
            async def ready(receipt: ReadyLocal) -> Result[Any]:
                if self.probe is None:
                    return await reg.handle(RecordReady(receipt))
                return await self._gate(fx, engine, receipt, runlog)

            return await self._guarded(
                fx.token, fx.engine, "end", runlog,
                lambda: self._call(d.end, engine.end(fx.token), fx.engine),
                ready,
            )
        if isinstance(fx, SendCleanup):
            engine = self._engine(fx.engine)
            try:
                inc = await self._call(d.cleanup, engine.cleanup(fx.token, fx.lora_name), fx.engine)
            except Exception as e:
                # A cleanup that was refused, unanswered or crashed is not a confirmed cleanup.
                runlog.unknown.append(f"{fx.engine} cleanup {fx.token}: {e}")
                return (await reg.handle(RecordUnknown(fx.token, fx.engine, "cleanup"))).effects
            if inc != fx.incarnation:
                # The engine restarted: tell the registry, which asks the new life for cleanup.
                return (await reg.handle(RegisterEngine(fx.engine, inc))).effects
            return (await reg.handle(RecordCleaned(fx.token, fx.engine, inc))).effects
        if isinstance(fx, SendReclaim):
            engine = self._engine(fx.engine)
            try:
                await self._call(d.reclaim, engine.reclaim(fx.lora_name, fx.reclaim_id), fx.engine)
            except Exception as e:
                runlog.unknown.append(f"{fx.engine} reclaim {fx.version}: {e}")
                return ()  # stays RECLAIMING with its slot; RetryReclaim later
            return (await reg.handle(RecordUnloaded(fx.version, fx.reclaim_id, fx.engine))).effects
        raise TypeError(f"no executor for {fx!r}")

    async def _gate(self, fx: SendEnd, engine: EngineAdmin, receipt: ReadyLocal, runlog: RunLog) -> Result[Any]:
        """The numeric READY gate: the engine's READY is recorded only once it reproduces the probe
        under the exact version name; a mismatch is the attempt's failure (RecordFailure)."""
        probe, name = self.probe, self.lora_name
        assert probe is not None and name is not None
        runlog.mark("probe", fx.engine)
        try:
            observed = await observe(engine, name, probe, self.deadlines.end)
        except (EngineError, VersionMissing) as e:
            runlog.failures.append(f"{fx.engine} probe: {e.message}")
            return await self.registry.handle(RecordFailure(fx.token, fx.engine, f"probe: {e.message}"))
        except OutcomeUnknown as e:
            runlog.unknown.append(f"{fx.engine} probe: {e.message}")
            return await self.registry.handle(RecordUnknown(fx.token, fx.engine, "probe"))
        except Exception as e:  # an untyped client error: we cannot know what happened
            log.exception("%s probe raised an untyped error; treating the outcome as unknown", fx.engine)
            runlog.unknown.append(f"{fx.engine} probe: {type(e).__name__}: {e}")
            return await self.registry.handle(RecordUnknown(fx.token, fx.engine, "probe"))
        finally:
            runlog.mark("probe", fx.engine)
        mismatch = compare(probe, observed)
        if mismatch is None:
            return await self.registry.handle(RecordReady(receipt))
        runlog.mismatches[fx.engine] = mismatch
        runlog.failures.append(f"{fx.engine} numeric mismatch: {mismatch.describe()}")
        return await self.registry.handle(
            RecordFailure(fx.token, fx.engine, f"numeric mismatch: {mismatch.describe()}"))

    async def _guarded(self, token: AttemptToken, engine: str, op: str, runlog: RunLog,
                       call: Callable[[], Awaitable[_T]], feed: Callable[[_T], Awaitable[Result[Any]]]) -> Sequence[Effect]:
        try:
            value = await call()
        except EngineError as e:
            runlog.failures.append(f"{engine} {op}: {e.message}")
            return (await self.registry.handle(RecordFailure(token, engine, f"{op}: {e.message}"))).effects
        except OutcomeUnknown as e:
            runlog.unknown.append(f"{engine} {op}: {e.message}")
            return (await self.registry.handle(RecordUnknown(token, engine, op))).effects
        except Exception as e:  # an adapter bug or an untyped client error: we cannot know what happened
            log.exception("%s %s raised an untyped error; treating the outcome as unknown", engine, op)
            runlog.unknown.append(f"{engine} {op}: {type(e).__name__}: {e}")
            return (await self.registry.handle(RecordUnknown(token, engine, op))).effects
        return (await feed(value)).effects

    async def _transfer(self, fx: TransferBucket, runlog: RunLog) -> Sequence[Effect]:
        source = self.source
        if source is None:
            raise LorapubError("a bucket transfer needs a BucketSource")
        d = self.deadlines
        collective = source.collective

        sent = False

        async def source_done(_: None) -> Result[Any]:
            nonlocal sent
            sent = True
            return await self.registry.handle(RecordBucketDone(fx.token, SOURCE, fx.index, None))

        async def source_half() -> Sequence[Effect]:
            return await self._guarded(
                fx.token, SOURCE, f"send bucket {fx.index}", runlog,
                lambda: self._call(d.bucket, source.send(fx.token, fx.index, fx.engines)),
                source_done,
            )

        async def engine_half(name: str) -> Sequence[Effect]:
            try:
                engine = self._engine(name)
            except UnknownEngine as e:  # sent nothing there: this half fails, the others' answers still count
                runlog.failures.append(f"{name}: {e.message}")
                return (await self.registry.handle(RecordFailure(fx.token, name, e.message))).effects
            payload = b"" if collective else source.payload(fx.token, fx.index)
            runlog.mark("transfer", name)
            try:
                async def received(inc: str) -> Result[Any]:
                    runlog.bucket_done(name, fx.index)
                    return await self.registry.handle(RecordBucketDone(fx.token, name, fx.index, inc))

                return await self._guarded(
                    fx.token, name, f"receive bucket {fx.index}", runlog,
                    lambda: self._call(d.bucket, engine.receive_bucket(fx.token, fx.index, payload), name),
                    received,
                )
            finally:
                runlog.mark("transfer", name)

        if not collective:
            # A byte transport has the bytes only once the source half ran; then every engine stores them.
            first = await source_half()
            if not sent:
                return first  # the source failed and the attempt aborted: nothing to send
            results = [first, *await asyncio.gather(*(engine_half(e) for e in fx.engines))]
        else:
            # A collective: the source and every engine must be in it at once.
            results = await asyncio.gather(source_half(), *(engine_half(e) for e in fx.engines))
        return [effect for batch in results for effect in batch]
