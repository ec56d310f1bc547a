"""lorapub for one AReaL rollout engine: a :class:`lorapub.Deployment` on an event loop of its own.

AReaL runs its workflows on the loop of its ``WorkflowExecutor`` thread and its weight updates on a
thread pool, each update under a loop of its own; a deployment (its HTTP clients, its sessions) lives
on one loop. So it gets a daemon thread with its loop, and both sides call into it. Nothing here
imports AReaL."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import itertools
import json
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, Coroutine, Mapping, Sequence, TypeVar

from lorapub import (Deployment, DeploymentClosed, InvalidInput, NoPublishedVersion, PublicationFailed, PublicationReport,
                     Session, Snapshot)
from lorapub.snapshot import load_safetensors
from lorapub.ports import EngineAdmin

from .config import LorapubAReaLConfig, version_id

__all__ = ["Episode", "LorapubRollout", "current_episode", "engine_name", "read_adapter"]

log = logging.getLogger("lorapub.integrations.areal")
T = TypeVar("T")

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")  # what PEFT's save_pretrained writes


def engine_name(address: str) -> str:
    """A stable engine name from an AReaL server address (``10.0.0.7:30000`` -> ``10.0.0.7_30000``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", address.split("://", 1)[-1].rstrip("/"))


def read_adapter(path: str) -> Snapshot:
    """The PEFT adapter AReaL's trainer saved under ``path``, frozen in memory (AReaL may delete the folder
    once the update is done: ``clear_checkpoint_after_load``). Read with torch where it is installed (AReaL's
    trainer saves bfloat16, which numpy has no dtype for: a live run's every update failed so), else numpy."""
    missing = [name for name in ADAPTER_FILES if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise InvalidInput(
            f"{path} holds no PEFT adapter ({', '.join(missing)} missing): lorapub publishes the LoRA adapter "
            "AReaL's trainer saves for a disk update (actor.weight_update_mode: disk, actor.use_lora: true), or "
            "a folder PEFT's save_pretrained wrote; nothing was published", path=path, missing=missing)
    tensors = load_safetensors(os.path.join(path, ADAPTER_FILES[0]))
    with open(os.path.join(path, ADAPTER_FILES[1])) as f:
        serving_config = json.load(f)
    return Snapshot(tensors, serving_config)


@dataclasses.dataclass
class Episode:
    """One AReaL episode (one ``submit``: a prompt and its ``group_size`` samples) as one lorapub group.

    Each asyncio task that generates in it (one per sample: ``GroupedRolloutWorkflow`` gathers them) is
    one lorapub session of the group, opened at its first request and kept through every turn."""

    group: str
    sessions: dict[int, Session] = dataclasses.field(default_factory=dict)
    counter: itertools.count[int] = dataclasses.field(default_factory=itertools.count)


_EPISODE: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("lorapub_areal_episode", default=None)


def current_episode() -> Episode | None:
    return _EPISODE.get()


class LorapubRollout:
    """The deployment behind one AReaL rollout engine, on its own loop (a daemon thread)."""

    def __init__(self, config: LorapubAReaLConfig, *, max_lag: int, engines: Mapping[str, EngineAdmin] | None = None,
                 **deployment_options: Any) -> None:
        self.config = config
        self.max_lag = max_lag
        self.deployment: Deployment | None = None
        self._given_engines = dict(engines) if engines is not None else None
        self._deployment_options = deployment_options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lorapub-areal", daemon=True)
        self._thread.start()
        #: What AReaL's own path would have sent and lorapub made unnecessary.
        self.skipped_pauses = 0

    # -- calling into the loop ----------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        if self._loop.is_closed():
            coro.close()
            raise DeploymentClosed("this rollout engine's lorapub was closed (destroy()): make a new engine and "
                                   "initialize it to generate or publish again")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """From a thread that is not the loop's (AReaL's initialize, its update thread pool)."""
        return self.submit(coro).result(timeout)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """From another event loop (AReaL's workflow executor): cancelling the await cancels the work."""
        return await asyncio.wrap_future(self.submit(coro))

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, addresses: Sequence[str]) -> None:
        self.run(self._start(list(addresses)))

    async def _start(self, addresses: list[str]) -> None:
        if self.deployment is not None:
            return
        engines: Mapping[str, EngineAdmin]
        if self._given_engines is not None:
            engines = self._given_engines
        else:
            from lorapub.adapters.sglang_wire import SGLangWireEngine  # aiohttp: lazily

            engines = {
                engine_name(a): SGLangWireEngine(engine_name(a), a if "://" in a else f"http://{a}",
                                                 api_key=self.config.api_key, admin_api_key=self.config.admin_api_key)
                for a in sorted(set(addresses))
            }
        config = self.config
        options: dict[str, Any] = {
            "capacity": config.capacity_for(self.max_lag), "max_lag": self.max_lag, "on_stale": config.on_stale,
            "idle_ttl": config.idle_ttl, "name_prefix": config.name_prefix,
        }
        options.update(self._deployment_options)
        epoch = config.epoch if config.epoch is not None else int(time.time())
        self.deployment = await Deployment(engines, epoch=epoch, **options).start()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            if self.deployment is not None:
                self.run(self.deployment.close())
        finally:
            self.run(_cancel_leftover_tasks())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _started(self) -> Deployment:
        if self.deployment is None:
            raise InvalidInput("this rollout engine's lorapub is not started: call initialize() first")
        return self.deployment

    # -- weight updates ----------------------------------------------------------------------------
    def publish(self, snapshot: Snapshot, version: int, *, attempts: int = 1, delay: float = 1.0) -> PublicationReport:
        """Publish AReaL's weight version ``version`` on every server; the :class:`lorapub.PublicationReport`
        once every server holds it and it is the default, or the typed error (the previous version stays).

        A ``PUBLICATION_FAILED`` (a definite failure, cleaned up on every server) is tried again, up to
        ``attempts`` in all, ``delay`` seconds apart: AReaL's own load retries each server's request as
        often (``request_retries``). Nothing else is retried (an unknown outcome, a capacity refusal)."""
        for attempt in range(1, max(1, attempts) + 1):
            try:
                return self.run(self._started().publish(snapshot, version_id(version), wait=self.config.publish_wait))
            except PublicationFailed as e:
                if attempt >= attempts:
                    raise
                log.warning("lorapub: publishing v%s failed (attempt %d of %d), trying again in %gs: %s",
                            version, attempt, attempts, delay, e)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- generation --------------------------------------------------------------------------------
    async def generate(self, episode: Episode | None, member: int, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One request of the trajectory ``member`` of ``episode``, sent once, on its bound version (run on
        this loop). Outside an episode (``agenerate`` called directly) the request is a session of its own."""
        try:
            if episode is None:
                alone = self._started().session(f"areal-{uuid.uuid4().hex[:16]}")
                try:
                    return await alone.generate(payload)
                finally:
                    await alone.close()
            session = episode.sessions.get(member)
            if session is None:  # no await between the look-up and the insert: one session per member
                session = self._started().session(f"{episode.group}.{next(episode.counter)}", group=episode.group)
                episode.sessions[member] = session
            return await session.generate(payload)
        except NoPublishedVersion as e:
            # No waiting here, unlike Relax's shards: AReaL's trainer publishes v1 only after a batch of
            # rollouts, so a rollout waiting for it would wait for itself. AReaL's own path has v0 loaded at
            # launch (sglang.lora_paths); lorapub's has it once publish_initial ran.
            raise NoPublishedVersion(
                f"{e.message}: call publish_initial(<the initial adapter folder>) after initialize() and before "
                "the first rollout (AReaL's own path loads it at launch from sglang.lora_paths; docs/areal.md)"
            ) from e

    async def end_episode(self, episode: Episode) -> None:
        """Release every session of the episode (its versions become reclaimable once nothing else uses them)."""
        sessions = list(episode.sessions.values())
        episode.sessions.clear()
        results = await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.warning("lorapub: releasing a session of %s failed (its lease will expire): %s", episode.group, result)

    @staticmethod
    def new_episode(task_id: Any) -> Episode:
        tag = str(task_id) if isinstance(task_id, int) else "x"
        return Episode(group=f"areal-{tag}-{uuid.uuid4().hex[:10]}")

    @staticmethod
    def enter(episode: Episode) -> contextvars.Token[Episode | None]:
        return _EPISODE.set(episode)

    @staticmethod
    def leave(token: contextvars.Token[Episode | None]) -> None:
        _EPISODE.reset(token)


async def _cancel_leftover_tasks() -> None:
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
