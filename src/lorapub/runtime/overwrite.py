"""The pre-lorapub path, kept bit-for-bit for ``enable_versioned_lora_publication=False``:
pause generation, flush the KV cache, overwrite one fixed adapter name, resume."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Mapping

from lorapub.errors import EngineError
from lorapub.runtime.snapshot import Snapshot

FIXED_LORA_NAME = "relax_policy_lora"


class OverwritePublisher:
    def __init__(self, engines: Mapping[str, Any], stash_dir: str, lora_name: str = FIXED_LORA_NAME) -> None:
        self.engines = dict(engines)
        self.stash_dir = stash_dir
        self.lora_name = lora_name
        self.updates = 0

    async def publish(self, snapshot: Snapshot, version_id: str) -> float:
        """Returns the seconds generation stood paused."""
        path = snapshot.save_peft_dir(os.path.join(self.stash_dir, "legacy", f"{self.updates:06d}-{version_id}"))
        started = time.monotonic()
        await asyncio.gather(*(e.admin("/pause_generation", {"mode": "abort"}) for e in self.engines.values()))
        try:
            await asyncio.gather(*(e.admin("/flush_cache") for e in self.engines.values()))
            for engine in self.engines.values():
                state = await engine.state()
                if self.lora_name in state.get("adapters", {}):
                    await engine.admin("/unload_lora_adapter", {"lora_name": self.lora_name})
                await engine.admin("/load_lora_adapter", {"lora_name": self.lora_name, "lora_path": path, "pinned": False})
        finally:
            await asyncio.gather(*(e.admin("/continue_generation") for e in self.engines.values()))
        self.updates += 1
        return time.monotonic() - started


class LegacySession:
    """Old behaviour: every request names the one fixed adapter, whatever it holds now."""

    max_resumes = 20

    def __init__(self, engine: Any, lora_name: str = FIXED_LORA_NAME) -> None:
        self.engine = engine
        self.lora_name = lora_name
        self.resumed = 0

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        # The old agentic layer resumes requests that a publication's pause aborted.
        for _ in range(self.max_resumes):
            try:
                return await self.engine.generate({**payload, "lora_path": self.lora_name})
            except EngineError as e:
                if "aborted" not in e.message:
                    raise
                self.resumed += 1
                await asyncio.sleep(0.005)
        return await self.engine.generate({**payload, "lora_path": self.lora_name})

    async def close(self) -> None:
        return None
