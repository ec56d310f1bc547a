"""The conformance suite every :class:`~lorapub.ports.EngineAdmin` must pass: ``await
check_engine_admin(factory)`` builds a fresh :class:`EngineUnderTest` for each check, each under a
deadline, and drives the admin through the contract the orchestration relies on; a check whose
optional hook is missing is reported under ``not_checked``, never passed.
See docs/testing.md, "`check_engine_admin`: the conformance suite".
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import time
import warnings
from typing import Any, Awaitable, Callable, Iterable, Literal, Mapping, Protocol, TypeVar

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.core.manifest import BucketPlan
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown, VersionMissing
from lorapub.ports import EngineAdmin
from lorapub.snapshot import Snapshot
from lorapub.testing.fixtures import lora_snapshot

__all__ = [
    "DEFAULT_DEADLINE", "DEFAULT_CALL_DEADLINE", "EngineUnderTest", "EngineFactory", "ConformanceFailure", "NotChecked", "NotCheckedWarning",
    "ConformanceResult", "idempotent_lifecycle", "late_messages_after_cleanup", "reclaim_waits_for_native_refs",
    "generation_never_resent", "unknown_is_not_a_definite_error", "end_verifies_the_digest",
    "stale_incarnation_refused", "no_fallback_on_a_missing_version", "new_incarnation_after_restart", "CHECKS",
    "check_engine_admin",
]

#: Seconds one check may take (its engine's start and close each get as long again).
DEFAULT_DEADLINE = 60.0
#: Seconds one admin call may take inside a check (a reclaim's includes the "long" generation it
#: waits for, a few hundred ms): one call that never answers fails its check in this time, not the
#: whole check's. Generous for a loaded machine, where one call to a local engine takes well under a second.
DEFAULT_CALL_DEADLINE = 15.0

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


class EngineUnderTest(Protocol):
    """An engine as the conformance suite sees it: its admin and hooks on the engine side.

    Optional hook, for the checks that need it (without it they are reported not checked):

    * ``restart()`` (plain or async): the engine crashes and comes back as a new life; every
      adapter, stash and running request is gone and ``admin.incarnation()`` answers anew.
    """

    admin: EngineAdmin

    async def served(self) -> set[str]:
        """The adapter names the engine holds now."""

    def physical_unloads(self, lora_name: str) -> int:
        """How many times the engine physically unloaded ``lora_name``."""

    def native_refs(self, lora_name: str) -> int:
        """Requests the engine is running on ``lora_name`` (its own refcount)."""

    def generate_requests(self) -> int:
        """Generation requests that reached the engine, whatever became of them."""

    def generation(self, lora_name: str, *, long: bool = False) -> Mapping[str, Any]:
        """A generation payload bound to ``lora_name``; ``long`` runs for a few hundred ms."""

    def fail_next(self, op: Literal["load", "generate"]) -> None:
        """The engine answers its next ``op`` with a definite failure."""

    def drop_next_reply(self, op: Literal["load", "generate"]) -> None:
        """The engine does (or starts) its next ``op`` and its reply never arrives in time."""

    async def close(self) -> None: ...


EngineFactory = Callable[[], Awaitable[EngineUnderTest]]


class ConformanceFailure(AssertionError):
    """An engine admin broke the contract; the message names the check, one line per check broken.

    ``failures``: each check broken -> why, in the suite's order; ``result``: the
    :class:`ConformanceResult` of the rest (the checks passed, those not checked)."""

    def __init__(self, message: str, failures: Mapping[str, str] | None = None,
                 result: "ConformanceResult | None" = None) -> None:
        super().__init__(message)
        self.failures: dict[str, str] = dict(failures or {})
        self.result = result


class NotChecked(Exception):
    """Raised by a check the engine under test cannot take (it lacks an optional hook)."""


class NotCheckedWarning(UserWarning):
    """A check was not run on this engine under test: it is not passed, only not checked."""


class ConformanceResult(list[str]):
    """What :func:`check_engine_admin` found: the names of the checks passed, in order (the list
    itself), and ``not_checked``: each check the engine under test could not take, with why. A
    check not checked is not in the list."""

    def __init__(self, passed: Iterable[str] = (), not_checked: Mapping[str, str] | None = None) -> None:
        super().__init__(passed)
        self.not_checked: dict[str, str] = dict(not_checked or {})

    @property
    def passed(self) -> list[str]:
        return list(self)

    @property
    def complete(self) -> bool:
        """Every check ran (and passed)."""
        return not self.not_checked

    def __repr__(self) -> str:
        skipped = "".join(f"; not checked: {n} ({why})" for n, why in self.not_checked.items())
        return f"ConformanceResult(passed={list(self)!r}{skipped})"


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ConformanceFailure(what)


def _typed(op: str, value: object, kind: type[T]) -> T:
    if not isinstance(value, kind):
        raise ConformanceFailure(
            f"{op} returned {'None' if value is None else 'a ' + type(value).__name__}, not a {kind.__name__}: "
            f"{value!r:.120}"
        )
    return value


class _TypedAdmin:
    """The admin as the checks call it: every answer is checked against the type the
    :class:`~lorapub.ports.EngineAdmin` protocol promises, and each call is bounded by its own
    deadline (one that never answers fails in that time, naming the call)."""

    def __init__(self, admin: EngineAdmin, call_deadline: float = DEFAULT_CALL_DEADLINE) -> None:
        self._admin = admin
        self._deadline = call_deadline
        self.name = admin.name  # an engine's name is stable (EngineAdmin)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._admin, name)

    async def _call(self, op: str, awaitable: Awaitable[T]) -> T:
        return await _within(self._deadline, f"{op} on {getattr(self._admin, 'name', '?')}", awaitable,
                             "did not answer")

    async def incarnation(self) -> str:
        return _typed("incarnation", await self._call("incarnation", self._admin.incarnation()), str)

    async def begin(self, request: SendBegin) -> str:
        return _typed("begin", await self._call("begin", self._admin.begin(request)), str)

    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        return _typed("receive_bucket",
                      await self._call("receive_bucket", self._admin.receive_bucket(token, index, payload)), str)

    async def end(self, token: AttemptToken) -> ReadyLocal:
        return _typed("end", await self._call("end", self._admin.end(token)), ReadyLocal)

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        return _typed("cleanup", await self._call("cleanup", self._admin.cleanup(token, lora_name)), str)

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        await self._call("reclaim", self._admin.reclaim(lora_name, reclaim_id))  # its answer is not used

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]:
        # a dict, as the protocol promises: lorapub stamps its provenance (result["lorapub"]) into it
        return _typed("generate", await self._call("generate", self._admin.generate(payload)), dict)

    async def close(self) -> None:
        await self._call("close", self._admin.close())

    async def release(self) -> None:
        await self._call("release", self._admin.release())


class _UnderCheck:
    """The engine under test as a check sees it: its hooks, and its admin behind :class:`_TypedAdmin`."""

    def __init__(self, engine: EngineUnderTest, call_deadline: float = DEFAULT_CALL_DEADLINE) -> None:
        self._engine = engine
        self.admin: EngineAdmin = _TypedAdmin(engine.admin, call_deadline)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


_seq = itertools.count(1)


async def _begin(engine: EngineUnderTest, epoch: int, seed: int, *,
                 incarnation: str | None = None) -> tuple[SendBegin, Snapshot, BucketPlan, str]:
    admin = engine.admin
    snapshot = lora_snapshot(seed, layers=1, hidden=16, rank=2)
    plan = snapshot.plan(512)
    key = VersionKey(epoch, f"conformance-{next(_seq)}")
    token = AttemptToken(key, 1)
    life = incarnation if incarnation is not None else await admin.incarnation()
    request = SendBegin(admin.name, life, token, lora_name_for(key, snapshot.digest), snapshot.digest, plan)
    inc = await admin.begin(request)
    return request, snapshot, plan, inc


async def _load(engine: EngineUnderTest, epoch: int, seed: int) -> tuple[SendBegin, ReadyLocal]:
    request, snapshot, plan, _ = await _begin(engine, epoch, seed)
    for i in range(len(plan.buckets)):
        await engine.admin.receive_bucket(request.token, i, snapshot.bucket_bytes(plan, i))
    return request, await engine.admin.end(request.token)


async def _raises(awaitable: Awaitable[object], error: type[E]) -> E | None:
    """The ``error`` the awaitable raised, or None if it answered. Any other exception is a contract
    break; cancellation and interrupts (not :class:`Exception`) go through untouched."""
    try:
        await awaitable
    except error as e:
        return e
    except ConformanceFailure:
        raise
    except Exception as e:  # noqa: BLE001 - reported as a contract break
        raise ConformanceFailure(f"expected {error.__name__}, got {type(e).__name__}: {e}") from e
    return None


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    """Cancel the tasks a check started and give them a moment to end (none outlives its check
    on purpose); their outcomes are read here, the check has judged what it needed."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()


# -- the checks ------------------------------------------------------------------------
async def idempotent_lifecycle(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    request, snapshot, plan, inc = await _begin(engine, epoch, 11)
    _check(await admin.begin(request) == inc, "a duplicate begin answers the same incarnation")
    for i in range(len(plan.buckets)):
        payload = snapshot.bucket_bytes(plan, i)
        first = await admin.receive_bucket(request.token, i, payload)
        _check(await admin.receive_bucket(request.token, i, payload) == first == inc,
               f"a duplicate receive of bucket {i} answers the same incarnation")
    ready = await admin.end(request.token)
    _check(ready.token == request.token and ready.digest == request.digest and ready.incarnation == inc,
           "end proves the exact attempt, digest and life it loaded")
    _check(request.lora_name in await engine.served(), "after end the engine serves the exact name")
    _check(await admin.cleanup(request.token, request.lora_name) == inc, "cleanup answers the incarnation")
    _check(await admin.cleanup(request.token, request.lora_name) == inc, "a duplicate cleanup answers the same")
    _check(request.lora_name not in await engine.served(), "after cleanup nothing of the attempt is loaded")
    _check(engine.physical_unloads(request.lora_name) == 1, "two cleanups unload once")


async def late_messages_after_cleanup(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    request, snapshot, plan, inc = await _begin(engine, epoch, 12)
    await admin.receive_bucket(request.token, 0, snapshot.bucket_bytes(plan, 0))
    await admin.cleanup(request.token, request.lora_name)
    before = await engine.served()
    for what, late in (
        ("begin", lambda: admin.begin(request)),
        ("receive_bucket", lambda: admin.receive_bucket(request.token, 0, snapshot.bucket_bytes(plan, 0))),
        ("end", lambda: admin.end(request.token)),
    ):
        _check(await _raises(late(), EngineError) is not None, f"a late {what} after cleanup is a definite EngineError")
    _check(await engine.served() == before, "late messages after cleanup recreate no load")


async def reclaim_waits_for_native_refs(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    request, _ = await _load(engine, epoch, 13)
    name = request.lora_name
    running = asyncio.ensure_future(admin.generate(engine.generation(name, long=True)))
    reclaim: asyncio.Future[None] | None = None
    try:
        _check(await _until(lambda: engine.native_refs(name) > 0 or running.done()), "the generation started")
        _check(not running.done(), "a long generation is still running when reclaim starts")
        reclaim = asyncio.ensure_future(admin.reclaim(name, "reclaim-conformance-1"))  # waits out the generation
        await asyncio.sleep(0.05)
        _check(not reclaim.done() or running.done(), "reclaim waits while a request holds a native ref")
        _check(engine.physical_unloads(name) == 0 or running.done(), "nothing is unloaded under a running request")
        await running
        await reclaim
    finally:
        await _cancel(running, *([reclaim] if reclaim is not None else []))
    _check(engine.physical_unloads(name) == 1, "reclaim unloads exactly once")
    _check(name not in await engine.served(), "a reclaimed name is not served")
    await admin.reclaim(name, "reclaim-conformance-1")  # the reply of the first was lost: replay
    _check(engine.physical_unloads(name) == 1, "a replayed reclaim unloads nothing more")


async def generation_never_resent(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    request, _ = await _load(engine, epoch, 14)
    before = engine.generate_requests()
    await admin.generate(engine.generation(request.lora_name))
    _check(engine.generate_requests() == before + 1, "one generation is one request")
    engine.drop_next_reply("generate")
    error = await _raises(admin.generate(engine.generation(request.lora_name)), OutcomeUnknown)
    _check(error is not None, "a generation whose reply is lost is OutcomeUnknown")
    await asyncio.sleep(0.1)
    _check(engine.generate_requests() == before + 2, "a generation whose reply was lost is never resent")


async def unknown_is_not_a_definite_error(engine: EngineUnderTest, epoch: int) -> None:
    engine.fail_next("load")
    request, snapshot, plan, _ = await _begin(engine, epoch, 15)
    for i in range(len(plan.buckets)):
        await engine.admin.receive_bucket(request.token, i, snapshot.bucket_bytes(plan, i))
    error = await _raises(engine.admin.end(request.token), EngineError)
    _check(error is not None and not isinstance(error, OutcomeUnknown), "an engine's no is a definite EngineError")
    engine.drop_next_reply("load")
    request, snapshot, plan, _ = await _begin(engine, epoch, 16)
    for i in range(len(plan.buckets)):
        await engine.admin.receive_bucket(request.token, i, snapshot.bucket_bytes(plan, i))
    _check(await _raises(engine.admin.end(request.token), OutcomeUnknown) is not None,
           "no answer is OutcomeUnknown, never a definite error")
    loaded, _ = await _load(engine, epoch, 17)
    engine.fail_next("generate")
    error = await _raises(engine.admin.generate(engine.generation(loaded.lora_name)), EngineError)
    _check(error is not None and not isinstance(error, OutcomeUnknown), "a refused generation is a definite EngineError")


async def end_verifies_the_digest(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    request, snapshot, plan, _ = await _begin(engine, epoch, 18)
    refused: Exception | None = None
    for i in range(len(plan.buckets)):
        payload = snapshot.bucket_bytes(plan, i)
        if i == len(plan.buckets) - 1:  # one bit of the last tensor's data flipped: same layout, other bytes
            payload = payload[:-1] + bytes([payload[-1] ^ 0x01])
        refused = await _raises(admin.receive_bucket(request.token, i, payload), EngineError)
        if refused is not None:  # an engine may refuse the bytes as they arrive
            break
    if refused is None:
        refused = await _raises(admin.end(request.token), EngineError)
        _check(refused is not None,
               "end answered READY for bytes that do not match the manifest (end must verify the digest)")
    _check(not isinstance(refused, OutcomeUnknown),
           f"bytes that do not match the manifest are a definite EngineError, not {type(refused).__name__}")
    _check(request.lora_name not in await engine.served(), "nothing of bytes that do not match the manifest is served")


async def stale_incarnation_refused(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    life = await admin.incarnation()
    before = await engine.served()
    stale = f"{life}-an-earlier-life"
    attempt = _begin(engine, epoch, 19, incarnation=stale)
    error = await _raises(attempt, EngineError)
    _check(error is not None, f"a begin for another life ({stale!r}) than the engine's ({life!r}) is refused")
    _check(not isinstance(error, OutcomeUnknown), "a begin for another life is a definite EngineError")
    _check(await engine.served() == before, "a refused begin loads nothing")


async def no_fallback_on_a_missing_version(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    never = lora_name_for(VersionKey(epoch, f"conformance-never-{next(_seq)}"),
                          hashlib.sha256(b"never loaded here").hexdigest())
    error = await _raises(admin.generate(engine.generation(never)), VersionMissing)
    _check(error is not None, f"a generation naming {never}, never loaded here, must be refused with VersionMissing "
                              "(it ran: a fallback to the base model or another adapter)")
    request, _ = await _load(engine, epoch, 20)
    await admin.reclaim(request.lora_name, "reclaim-conformance-no-fallback")
    error = await _raises(admin.generate(engine.generation(request.lora_name)), VersionMissing)
    _check(error is not None, f"a generation naming {request.lora_name}, reclaimed, must be refused with "
                              "VersionMissing (it ran: a fallback or an implicit reload)")
    _check(request.lora_name not in await engine.served(), "a refused generation reloads nothing")


async def new_incarnation_after_restart(engine: EngineUnderTest, epoch: int) -> None:
    restart = getattr(engine, "restart", None)
    if restart is None:
        raise NotChecked("the engine under test offers no restart hook")
    admin = engine.admin
    request, ready = await _load(engine, epoch, 21)
    old = ready.incarnation
    done = restart()
    if inspect.isawaitable(done):
        await done
    new = await admin.incarnation()
    _check(new != old, f"after a restart the incarnation changes (still {old!r})")
    _check(request.lora_name not in await engine.served(), "a restarted engine holds nothing of its earlier life")
    _check(await _raises(admin.generate(engine.generation(request.lora_name)), VersionMissing) is not None,
           "after a restart a generation naming a version of the earlier life is VersionMissing (no fallback)")
    error = await _raises(_begin(engine, epoch, 22, incarnation=old), EngineError)
    _check(error is not None and not isinstance(error, OutcomeUnknown),
           "a begin carrying the incarnation of the life before the restart is a definite EngineError")
    fresh, ready = await _load(engine, epoch, 23)
    _check(ready.incarnation == new and ready.token == fresh.token, "a load after the restart proves the new life")
    _check(fresh.lora_name in await engine.served(), "a load after the restart is served")


CHECKS: tuple[Callable[[EngineUnderTest, int], Awaitable[None]], ...] = (
    idempotent_lifecycle,
    late_messages_after_cleanup,
    reclaim_waits_for_native_refs,
    generation_never_resent,
    unknown_is_not_a_definite_error,
    end_verifies_the_digest,
    stale_incarnation_refused,
    no_fallback_on_a_missing_version,
    new_incarnation_after_restart,
)


async def _within(deadline: float, what: str, awaitable: Awaitable[T], overran: str = "did not finish") -> T:
    """Await under the deadline; an overrun is a :class:`ConformanceFailure` saying what and how long."""
    timeout = asyncio.timeout(deadline)
    try:
        async with timeout:
            return await awaitable
    except TimeoutError:
        if timeout.expired():
            raise ConformanceFailure(f"{what} {overran} within its deadline of {deadline:g} s") from None
        raise


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidInput(f"check_engine_admin({name}=) is a positive number of seconds, got {value!r}")
    return float(value)


async def check_engine_admin(
    factory: EngineFactory, *, epoch: int = 1, deadline: float = DEFAULT_DEADLINE,
    call_deadline: float = DEFAULT_CALL_DEADLINE,
) -> ConformanceResult:
    """Run every check on a fresh engine from ``factory``; returns a :class:`ConformanceResult`: the
    names of the checks passed (a list) and ``not_checked``, the checks the engine under test lacks
    a hook for (each also a :class:`NotCheckedWarning`).

    Every check runs, whatever the others found; if any broke the contract,
    :class:`ConformanceFailure` names each (one line per check, the first check broken first).
    A check that runs past ``deadline`` seconds fails (as do the factory and ``close``, each
    bounded by it), and so does one admin call that takes longer than ``call_deadline`` seconds.
    A factory that fails stops the run: the checks left are named as not run.
    """
    deadline = _seconds("deadline", deadline)
    call_deadline = min(_seconds("call_deadline", call_deadline), deadline)
    passed: list[str] = []
    not_checked: dict[str, str] = {}
    failures: dict[str, str] = {}
    for position, check in enumerate(CHECKS):
        name = check.__name__
        try:
            engine = await _within(deadline, "making the engine under test", factory())
        except Exception as e:  # noqa: BLE001 - the factory's own failure, named; nothing more can run
            why = str(e) if isinstance(e, ConformanceFailure) else f"making the engine under test: {type(e).__name__}: {e}"
            failures[name] = why
            for later in CHECKS[position + 1:]:
                failures[later.__name__] = "not run: making the engine under test failed"
            break
        try:
            await _within(deadline, "the check", check(_UnderCheck(engine, call_deadline), epoch))
        except NotChecked as e:
            not_checked[name] = str(e)
            warnings.warn(f"{name} not checked: {e}", NotCheckedWarning, stacklevel=2)
        except ConformanceFailure as e:
            failures[name] = str(e)
        except Exception as e:  # noqa: BLE001 - whatever else the engine raised, named by its check
            failures[name] = f"unexpected {type(e).__name__}: {e}"
        else:
            passed.append(name)
        finally:
            try:
                await _within(deadline, "closing the engine under test", engine.close())
            except Exception as e:  # noqa: BLE001 - named by its check, as the check's own failure is
                if name in passed:
                    passed.remove(name)
                failures.setdefault(name, str(e) if isinstance(e, ConformanceFailure)
                                    else f"closing the engine under test: {type(e).__name__}: {e}")
    result = ConformanceResult(passed, not_checked)
    if failures:
        lines = [f"{name}: {why}" for name, why in failures.items()]
        summary = f"({len(failures)} of {len(CHECKS)} checks failed; passed: {', '.join(passed) or 'none'})"
        raise ConformanceFailure("\n".join([*lines, summary]), failures, result)
    return result
