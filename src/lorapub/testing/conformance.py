"""The conformance suite every :class:`~lorapub.ports.EngineAdmin` must pass.

``await check_engine_admin(factory)`` builds a fresh engine for each check and
drives the admin through the contract the orchestration relies on:

* ``begin``/``receive_bucket``/``end``/``cleanup`` are idempotent: a duplicate
  answers the same way and transfers, loads or unloads nothing twice;
* late messages after ``cleanup`` are refused (a definite ``EngineError``) and
  never recreate a stash or a load;
* ``reclaim`` waits for the engine's native request refs, unloads exactly once,
  and a replayed reclaim unloads nothing;
* a generation is sent once: a lost reply is ``OutcomeUnknown`` and the request
  is never resent;
* an engine's "no" is ``EngineError``; no answer is ``OutcomeUnknown``.

``factory`` returns an :class:`EngineUnderTest`: the admin plus the few hooks on
the engine side the checks need to observe and to inject faults.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Awaitable, Callable, Literal, Mapping, Protocol

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.errors import EngineError, OutcomeUnknown
from lorapub.ports import EngineAdmin
from lorapub.testing.fixtures import lora_snapshot


class EngineUnderTest(Protocol):
    """An engine as the conformance suite sees it: its admin and hooks on the engine side."""

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
    """An engine admin broke the contract; the message names the check."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ConformanceFailure(what)


_seq = itertools.count(1)


async def _begin(engine: EngineUnderTest, epoch: int, seed: int):
    admin = engine.admin
    snapshot = lora_snapshot(seed, layers=1, hidden=16, rank=2)
    plan = snapshot.plan(512)
    key = VersionKey(epoch, f"conformance-{next(_seq)}")
    token = AttemptToken(key, 1)
    request = SendBegin(
        admin.name, await admin.incarnation(), token, lora_name_for(key, snapshot.digest), snapshot.digest, plan
    )
    inc = await admin.begin(request)
    return request, snapshot, plan, inc


async def _load(engine: EngineUnderTest, epoch: int, seed: int) -> tuple[SendBegin, ReadyLocal]:
    request, snapshot, plan, _ = await _begin(engine, epoch, seed)
    for i in range(len(plan.buckets)):
        await engine.admin.receive_bucket(request.token, i, snapshot.bucket_bytes(plan, i))
    return request, await engine.admin.end(request.token)


async def _raises(awaitable, error: type[BaseException]) -> BaseException | None:
    try:
        await awaitable
    except error as e:
        return e
    except BaseException as e:  # noqa: BLE001 - reported as a contract break
        raise ConformanceFailure(f"expected {error.__name__}, got {type(e).__name__}: {e}") from e
    return None


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


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
        ("begin", admin.begin(request)),
        ("receive_bucket", admin.receive_bucket(request.token, 0, snapshot.bucket_bytes(plan, 0))),
        ("end", admin.end(request.token)),
    ):
        _check(await _raises(late, EngineError) is not None, f"a late {what} after cleanup is a definite EngineError")
    _check(await engine.served() == before, "late messages after cleanup recreate no load")


async def reclaim_waits_for_native_refs(engine: EngineUnderTest, epoch: int) -> None:
    admin = engine.admin
    request, _ = await _load(engine, epoch, 13)
    name = request.lora_name
    running = asyncio.ensure_future(admin.generate(engine.generation(name, long=True)))
    try:
        _check(await _until(lambda: engine.native_refs(name) > 0 or running.done()), "the generation started")
        _check(not running.done(), "a long generation is still running when reclaim starts")
        reclaim = asyncio.ensure_future(admin.reclaim(name, "reclaim-conformance-1"))
        await asyncio.sleep(0.05)
        _check(not reclaim.done() or running.done(), "reclaim waits while a request holds a native ref")
        _check(engine.physical_unloads(name) == 0 or running.done(), "nothing is unloaded under a running request")
        await running
        await reclaim
    finally:
        running.cancel()
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


CHECKS: tuple[Callable[[EngineUnderTest, int], Awaitable[None]], ...] = (
    idempotent_lifecycle,
    late_messages_after_cleanup,
    reclaim_waits_for_native_refs,
    generation_never_resent,
    unknown_is_not_a_definite_error,
)


async def check_engine_admin(factory: EngineFactory, *, epoch: int = 1) -> list[str]:
    """Run every check on a fresh engine from ``factory``; returns the names of the checks passed.

    Raises :class:`ConformanceFailure` naming the first check an engine breaks.
    """
    passed = []
    for check in CHECKS:
        engine = await factory()
        try:
            await check(engine, epoch)
        except ConformanceFailure as e:
            raise ConformanceFailure(f"{check.__name__}: {e}") from e
        finally:
            await engine.close()
        passed.append(check.__name__)
    return passed
