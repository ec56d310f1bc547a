"""SGLang for the old overwrite path (switch off, ``enabled=False``): :class:`SGLangOverwriteAdmin`,
lorapub's :class:`~lorapub.ports.OverwriteAdmin` for stock SGLang, over the HTTP client of
:mod:`lorapub.adapters.sglang_http`.
See docs/embedding.md, "The switch-off path on stock SGLang".
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

import aiohttp

from lorapub.adapters.sglang_http import SGLangHTTP
from lorapub.errors import EngineError

__all__ = ["SGLangOverwriteAdmin"]


class SGLangOverwriteAdmin:
    """An SGLang server as the old overwrite path drives it (``enabled=False``).

    Needs nothing of lorapub's SGLang patch: it uses only stock SGLang routes (the adapter
    list comes from ``/v1/models``), so it runs against any SGLang 0.5.17/0.5.23 server.
    ``require_patch`` is accepted for symmetry with the versioned path's adapter
    (:class:`~lorapub.adapters.sglang_wire.SGLangWireEngine`) and changes nothing here.
    """

    def __init__(self, name: str, base_url: str, *, http: aiohttp.ClientSession | None = None,
                 request_timeout: float | None = None, probe_timeout: float | None = 30.0,
                 require_patch: bool = True, api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self.client = SGLangHTTP(
            name, base_url, http=http, request_timeout=request_timeout, probe_timeout=probe_timeout,
            require_patch=require_patch, api_key=api_key, admin_api_key=admin_api_key,
        )
        self.name = self.client.name

    def __repr__(self) -> str:
        return f"SGLangOverwriteAdmin({self.client!r})"

    async def close(self) -> None:
        await self.client.close()

    async def pause_generation(self) -> None:
        await self.client.admin("/pause_generation", {"mode": "abort"})

    async def continue_generation(self) -> None:
        await self.client.admin("/continue_generation")

    async def flush_cache(self, attempts: int = 100) -> None:
        # SGLang refuses to flush while aborted requests are still draining (400): ask again.
        # Its answer is plain text ("Cache flushed. ..."), not JSON. A refusal at the door
        # (401/403) will not change by asking again.
        for _ in range(attempts - 1):
            try:
                await self.client.admin("/flush_cache", expect_json=False)
                return
            except EngineError as e:
                if e.details.get("status") in (401, 403):
                    raise
                await asyncio.sleep(0.05)  # a retry of an engine call (I/O) on the old path: real time
        await self.client.admin("/flush_cache", expect_json=False)

    async def loaded_adapters(self) -> list[str]:
        # Stock SGLang lists its LoRA adapters as model cards with a parent (the base model).
        return [card["id"] for card in await self.client.models() if card.get("parent")]

    async def load_adapter(self, lora_name: str, lora_path: str) -> None:
        await self.client.admin("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": False})

    async def unload_adapter(self, lora_name: str) -> None:
        await self.client.admin("/unload_lora_adapter", {"lora_name": lora_name})

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return await self.client.generate(payload)
