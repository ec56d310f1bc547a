"""The registry as a named Ray actor, so every rollout process shares one single writer: the actor
runs a :class:`~lorapub.runtime.registry.LocalRegistry` one call at a time, typed errors come back
as the same lorapub class, and only a lost reply is :class:`~lorapub.errors.OutcomeUnknown`.
See docs/design.md, "Durable store".
"""

from __future__ import annotations

import asyncio
import functools
import gc
from typing import Any, Callable, Mapping

import ray

from lorapub import errors
from lorapub.core.commands import Command
from lorapub.core.registry import COMMANDS, DEFAULT_LEASE_TTL, Result, check_capacity, check_max_lag, check_room_for_lag
from lorapub.ports import RegistryStore
from lorapub.core.identity import MANAGED_PREFIX
from lorapub.runtime.registry import LocalRegistry
from lorapub.runtime.stores import SQLiteStore

__all__ = ["RegistryActor", "RayRegistry"]

_ERRORS = {
    cls.code: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.LorapubError)
}


class _RegistryActor:
    """Opens its registry lazily: a store that cannot be opened answers every call with its
    typed error (and is tried again on the next call) instead of killing the actor, which
    callers would only see as a lost reply."""

    def __init__(
        self, epoch: int, engines: Mapping[str, str], capacity: int, store_path: str | None = None,
        store_factory: Callable[[], RegistryStore] | None = None, lease_ttl: float | None = DEFAULT_LEASE_TTL,
        max_lag: int | None = None, on_stale: str | None = None, name_prefix: str = MANAGED_PREFIX,
        avoid_suspect: bool = False,
    ) -> None:
        if store_factory is None and store_path:
            store_factory = functools.partial(SQLiteStore, store_path)  # durable: a restarted actor resumes
        self._open_args = (epoch, dict(engines), capacity)
        self._options = dict(lease_ttl=lease_ttl, max_lag=max_lag, on_stale=on_stale, name_prefix=name_prefix,
                             avoid_suspect=avoid_suspect)
        self._store_factory = store_factory
        self.registry: LocalRegistry | None = None
        try:
            self._registry()
        except Exception:
            pass  # answered to every caller by handle(), typed, and tried again there
        if _owns_its_process():
            # This process is the registry's alone: take what Ray's worker and the imports made
            # (hundreds of thousands of objects) out of every later collection. A full collection
            # of them took 42-43 ms inside a batch (the p99 of 100 callers); the registry's own
            # state is built to cost the collector almost nothing (docs/benchmarks.md, Part 2).
            gc.collect()
            gc.freeze()

    def _registry(self) -> LocalRegistry:
        if self.registry is None:
            store = self._store_factory() if self._store_factory is not None else None
            try:
                self.registry = LocalRegistry(*self._open_args, store=store, **self._options)
            except BaseException:
                if store is not None and hasattr(store, "close"):
                    store.close()  # release the file so the next try (or an operator) can open it
                raise
        return self.registry

    def handle_many(self, commands: list[Command]) -> list[tuple[str, Any]]:
        """A batch from one caller process, applied in order, each answered on its own, made
        durable by one group commit (one actor call and one fsync instead of one per command:
        what lets 100 callers share the actor)."""
        bad = [c for c in commands if not isinstance(c, COMMANDS)]
        if bad:
            return [self.handle(c) for c in commands]  # each answered (and refused) on its own
        try:
            answers = self._registry().apply_many(list(commands))
        except errors.LorapubError as e:
            return [("error", _refusal(e))] * len(commands)
        except Exception as e:
            failure = ("error", ("LORAPUB_ERROR", f"registry actor failed on a batch: {type(e).__name__}: {e}"))
            return [failure] * len(commands)
        return [("error", _refusal(a)) if isinstance(a, errors.LorapubError) else ("ok", a) for a in answers]

    def handle(self, command: Command) -> tuple[str, Any]:
        if not isinstance(command, COMMANDS):
            return ("error", ("INVALID_INPUT", f"{command!r} is not a registry command"))
        try:
            return ("ok", self._registry().apply(command))
        except errors.LorapubError as e:
            return ("error", _refusal(e))
        except Exception as e:  # a definite answer all the same: nothing was applied
            return ("error", ("LORAPUB_ERROR", f"registry actor failed on {type(command).__name__}: "
                                               f"{type(e).__name__}: {e}"))


def _owns_its_process() -> bool:
    """True in a Ray worker process (an actor's own), never in a driver or local mode."""
    try:
        return ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001 - no Ray context: a plain object in someone's process
        return False


RegistryActor = ray.remote(num_cpus=0)(_RegistryActor)


class RayRegistry:
    """A :class:`~lorapub.ports.Registry` over a named actor (create once, look up from any process).

    The actor runs a :class:`~lorapub.runtime.registry.LocalRegistry` with Ray's default
    one-call-at-a-time concurrency: each command is applied whole before the next call starts.
    Every typed error raised in the actor (a rejection, and a store that cannot be read, is
    corrupted, belongs to another epoch or cannot save) crosses the process boundary as (code,
    message) and is raised again here as the same lorapub class with the same code. Only a call
    whose reply is lost (actor unreachable or dead, timeout) is
    :class:`~lorapub.errors.OutcomeUnknown`; every registry command is safe to replay.

    With ``batch=True`` (the default) the commands that callers of one process submit in
    the same event-loop turn travel in **one** actor call and are applied in submission
    order, each answered (or rejected) on its own; a lost batch reply is OutcomeUnknown
    for each of its commands, which are all safe to replay.
    """

    def __init__(self, handle: Any, call_timeout: float = 30.0, *, batch: bool = True, max_batch: int = 512) -> None:
        self.actor = handle
        self.call_timeout = call_timeout
        self.batch = batch
        self.max_batch = max_batch
        self._pending: list[tuple[Command, asyncio.Future]] = []
        self._flush_scheduled = False
        self.calls = 0  # actor calls made (for benchmarks)

    @classmethod
    def create(
        cls, name: str, epoch: int, engines: Mapping[str, str], capacity: int = 2, namespace: str = "lorapub",
        store_path: str | None = None, store_factory: Callable[[], RegistryStore] | None = None,
        call_timeout: float = 30.0, lease_ttl: float | None = DEFAULT_LEASE_TTL, batch: bool = True,
        max_lag: int | None = None, on_stale: str | None = None, name_prefix: str = MANAGED_PREFIX,
        avoid_suspect: bool = False,
    ) -> "RayRegistry":
        """A durable store lets Ray restart the actor without losing its state.

        ``store_path`` keeps it in a :class:`~lorapub.runtime.stores.SQLiteStore` at that
        path (on the actor's node); ``store_factory`` builds any other store inside the
        actor (it is pickled there), e.g. ``functools.partial(FileStore, path)``.
        """
        # refused here, before a detached actor is made that could only fail its every call
        check_capacity(capacity)
        on_stale = check_max_lag(max_lag, on_stale)
        check_room_for_lag(capacity, max_lag)
        durable = bool(store_path) or store_factory is not None
        handle = RegistryActor.options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
            max_restarts=-1 if durable else 0, max_task_retries=0,
        ).remote(epoch, dict(engines), capacity, store_path, store_factory, lease_ttl, max_lag, on_stale, name_prefix,
                 avoid_suspect)
        return cls(handle, call_timeout=call_timeout, batch=batch)

    @classmethod
    def lookup(cls, name: str, namespace: str = "lorapub", call_timeout: float = 30.0, batch: bool = True) -> "RayRegistry":
        return cls(ray.get_actor(name, namespace=namespace), call_timeout=call_timeout, batch=batch)

    async def handle(self, command: Command) -> Result:
        if not self.batch:
            self.calls += 1
            return _answer(command, await self._call(self.actor.handle, command, type(command).__name__))
        future = asyncio.get_running_loop().create_future()
        self._pending.append((command, future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)
        return _answer(command, await future)

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            asyncio.ensure_future(self._flush(batch))

    async def _flush(self, batch: list[tuple[Command, asyncio.Future]]) -> None:
        self.calls += 1
        try:
            answers = await self._call(self.actor.handle_many, [c for c, _ in batch], f"batch of {len(batch)}")
        except errors.LorapubError as e:
            for _, future in batch:
                if not future.done():
                    future.set_exception(type(e)(e.message))
            return
        for (_, future), answer in zip(batch, answers):
            if not future.done():
                future.set_result(answer)

    async def _call(self, method: Any, argument: Any, what: str) -> tuple[str, Any]:
        try:
            return await asyncio.wait_for(method.remote(argument), self.call_timeout)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise errors.OutcomeUnknown(f"registry {what}: no reply ({type(e).__name__})") from None
        except ray.exceptions.RayTaskError as e:  # the actor answered by raising: definite, not lost
            raise errors.LorapubError(f"registry {what}: the actor raised {e.cause!r}") from None


def _refusal(e: errors.LorapubError) -> tuple[str, str, dict[str, Any]]:
    """A typed refusal as it crosses the actor boundary: its code, message and details (the caller
    reads details, e.g. CapacityError's ``held_by_sessions``, as it would in one process)."""
    return e.code, e.message, dict(e.details)


def _answer(command: Command, answer: tuple[str, Any]) -> Result:
    status, value = answer
    if status == "error":
        code, message, details = value if len(value) == 3 else (*value, {})  # an actor of an earlier release: no details
        cls = _ERRORS.get(code)
        if cls is None:
            raise errors.LorapubError(f"{code}: {message}", **details)
        raise cls(message, **details)
    return value
