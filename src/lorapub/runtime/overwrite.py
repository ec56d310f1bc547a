"""The pre-lorapub path, kept behaviour-for-behaviour for ``enabled=False``:
pause generation, flush the KV cache, overwrite one fixed adapter name, resume.

Its own type (:class:`OverwriteDeployment`), with its own port
(:class:`~lorapub.ports.OverwriteAdmin`); :func:`lorapub.runtime.deployment.deploy`
is the one switch between it and :class:`~lorapub.runtime.deployment.Deployment`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, Mapping

from lorapub.core.identity import LORA_NAME_PREFIX
from lorapub.errors import EngineError, InvalidInput
from lorapub.ports import OverwriteAdmin
from lorapub.runtime.snapshot import Snapshot

FIXED_LORA_NAME = LORA_NAME_PREFIX


class OverwritePublisher:
    def __init__(self, engines: Mapping[str, OverwriteAdmin], stash_dir: str, lora_name: str = FIXED_LORA_NAME) -> None:
        self.engines = dict(engines)
        self.stash_dir = stash_dir
        self.lora_name = lora_name
        self.updates = 0

    async def publish(self, snapshot: Snapshot, version_id: str) -> float:
        """Returns the seconds generation stood paused."""
        path = snapshot.save_peft_dir(os.path.join(self.stash_dir, "legacy", f"{self.updates:06d}-{version_id}"))
        started = time.monotonic()
        await asyncio.gather(*(e.pause_generation() for e in self.engines.values()))
        try:
            await asyncio.gather(*(e.flush_cache() for e in self.engines.values()))
            for engine in self.engines.values():
                if self.lora_name in await engine.loaded_adapters():
                    await engine.unload_adapter(self.lora_name)
                await engine.load_adapter(self.lora_name, path)
        finally:
            await asyncio.gather(*(e.continue_generation() for e in self.engines.values()))
        self.updates += 1
        return time.monotonic() - started


class OverwriteSession:
    """Old behaviour: every request names the one fixed adapter, whatever it holds now."""

    max_resumes = 20

    def __init__(self, engine: OverwriteAdmin, lora_name: str = FIXED_LORA_NAME) -> None:
        self.engine = engine
        self.lora_name = lora_name
        self.resumed = 0

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        # The old agentic layer resumes requests that a publication's pause aborted.
        for _ in range(self.max_resumes):
            try:
                out = await self.engine.generate({**payload, "lora_path": self.lora_name})
            except EngineError as e:
                if "aborted" not in e.message:
                    raise
            else:
                # SGLang answers a request that pause_generation(mode="abort") cut short with 200 and
                # finish_reason "abort"; the old agentic layer resumes it.
                if ((out.get("meta_info") or {}).get("finish_reason") or {}).get("type") != "abort":
                    return out
            self.resumed += 1
            await asyncio.sleep(0.005)
        return await self.engine.generate({**payload, "lora_path": self.lora_name})

    async def close(self) -> None:
        return None


class OverwriteDeployment:
    """The switch-off product: ``publish`` returns the seconds paused, ``session`` an :class:`OverwriteSession`."""

    def __init__(self, engines: Mapping[str, OverwriteAdmin], *, stash_dir: str | None = None) -> None:
        if not engines:
            raise InvalidInput("a deployment needs at least one engine")
        self.engines = dict(engines)
        self.publisher = OverwritePublisher(self.engines, stash_dir or "/tmp/lorapub-legacy")
        self._round_robin = itertools.count()

    async def start(self) -> "OverwriteDeployment":
        return self

    async def publish(self, snapshot: Snapshot, version_id: str) -> float:
        return await self.publisher.publish(snapshot, version_id)

    def session(self, session_id: str, nonce: str | None = None) -> OverwriteSession:
        engines = list(self.engines.values())
        return OverwriteSession(engines[next(self._round_robin) % len(engines)])

    async def settle(self) -> None:
        return None
