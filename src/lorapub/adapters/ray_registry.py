"""The registry as a named Ray actor, so every rollout process shares one single writer.

The actor runs a :class:`~lorapub.runtime.registry.LocalRegistry` with Ray's default
one-call-at-a-time concurrency: each command is applied whole before the next
call starts. Typed errors cross the process boundary as (code, message) and are
raised again as the same lorapub class; a call whose reply is lost (actor
unreachable, timeout) is :class:`~lorapub.errors.OutcomeUnknown`, and every
registry command is safe to replay.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

import ray

from lorapub import errors
from lorapub.core.commands import Command
from lorapub.core.registry import COMMANDS, Result
from lorapub.runtime.registry import LocalRegistry
from lorapub.runtime.stores import FileStore

_ERRORS = {
    cls.code: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.LorapubError)
}


class _RegistryActor:
    def __init__(self, epoch: int, engines: Mapping[str, str], capacity: int, store_path: str | None = None) -> None:
        store = FileStore(store_path) if store_path else None  # durable: a restarted actor resumes
        self.registry = LocalRegistry(epoch, engines, capacity, store=store)

    def handle(self, command: Command) -> tuple[str, Any]:
        if not isinstance(command, COMMANDS):
            return ("error", ("INVALID_INPUT", f"{command!r} is not a registry command"))
        try:
            return ("ok", self.registry.apply(command))
        except errors.LorapubError as e:
            return ("error", (e.code, e.message))


RegistryActor = ray.remote(num_cpus=0)(_RegistryActor)


class RayRegistry:
    """A :class:`~lorapub.ports.Registry` over a named actor (create once, look up from any process)."""

    def __init__(self, handle: Any, call_timeout: float = 30.0) -> None:
        self.actor = handle
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

    async def handle(self, command: Command) -> Result:
        what = type(command).__name__
        try:
            status, value = await asyncio.wait_for(self.actor.handle.remote(command), self.call_timeout)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise errors.OutcomeUnknown(f"registry {what}: no reply ({type(e).__name__})") from None
        if status == "error":
            code, message = value
            raise _ERRORS.get(code, errors.LorapubError)(message)
        return value
