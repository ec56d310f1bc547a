"""The registry as a named Ray actor, so every rollout process shares one single writer.

The actor runs :class:`~lorapub.runtime.registry.RegistryService` with Ray's default
one-call-at-a-time concurrency: each transition is applied whole before the
next call starts. Typed errors cross the process boundary as (code, message)
and are raised again as the same lorapub class; a call whose reply is lost
(actor unreachable, timeout) is :class:`~lorapub.errors.OutcomeUnknown`, and
every registry command is safe to replay.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

import ray

from lorapub import errors
from lorapub.runtime.registry import _SYNC_METHODS, RegistryService
from lorapub.runtime.stores import FileStore

_ERRORS = {
    cls.code: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.LorapubError)
}


class _RegistryActor:
    def __init__(self, epoch: int, engines: Mapping[str, str], capacity: int, store_path: str | None = None) -> None:
        store = FileStore(store_path) if store_path else None  # durable: a restarted actor resumes
        self.service = RegistryService(epoch, engines, capacity, store=store)

    def call(self, method: str, *args: Any) -> tuple[str, Any]:
        if method not in _SYNC_METHODS:
            return ("error", ("INVALID_INPUT", f"no registry method {method!r}"))
        try:
            return ("ok", getattr(self.service, method)(*args))
        except errors.LorapubError as e:
            return ("error", (e.code, e.message))


RegistryActor = ray.remote(num_cpus=0)(_RegistryActor)


class RayRegistry:
    """Async registry face over a named actor (create once, look up from any process)."""

    def __init__(self, handle: Any, call_timeout: float = 30.0) -> None:
        self.handle = handle
        self.call_timeout = call_timeout

    @classmethod
    def create(
        cls, name: str, epoch: int, engines: Mapping[str, str], capacity: int = 2, namespace: str = "lorapub",
        store_path: str | None = None,
    ) -> "RayRegistry":
        """``store_path`` makes state durable and lets Ray restart the actor without losing it."""
        handle = RegistryActor.options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
            max_restarts=-1 if store_path else 0, max_task_retries=0,
        ).remote(epoch, dict(engines), capacity, store_path)
        return cls(handle)

    @classmethod
    def lookup(cls, name: str, namespace: str = "lorapub") -> "RayRegistry":
        return cls(ray.get_actor(name, namespace=namespace))

    def __getattr__(self, method: str):
        if method not in _SYNC_METHODS:
            raise AttributeError(method)

        async def call(*args: Any) -> Any:
            try:
                status, value = await asyncio.wait_for(self.handle.call.remote(method, *args), self.call_timeout)
            except (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                raise errors.OutcomeUnknown(f"registry {method}: no reply ({type(e).__name__})") from None
            if status == "error":
                code, message = value
                error = _ERRORS.get(code, errors.LorapubError)(message)
                raise error
            return value

        call.__name__ = method
        return call
