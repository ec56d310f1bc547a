"""SGLang over its HTTP API (aiohttp): HTTP only.

:class:`SGLangHTTP` is the client. :class:`SGLangEngine` is the
:class:`~lorapub.ports.EngineAdmin`: staging is :class:`~lorapub.adapters.staging.Staging`
(an attempt-private stash directory the engine can read, local disk or a shared
mount); ``end`` fresh-loads the verified adapter **pinned** through
``/load_lora_adapter`` and probes the exact name. :class:`SGLangOverwriteAdmin` is
the :class:`~lorapub.ports.OverwriteAdmin` of the old overwrite path (switch off).
Requires lorapub's SGLang patch (its state route gives the incarnation; managed
adapters are neither implicitly reloaded nor unloadable without a reclaim id).

Transport rules: a generation is sent once. A timeout or dropped connection
is :class:`OutcomeUnknown` and is never resent here.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Mapping

import aiohttp

from lorapub.adapters.staging import Staging
from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import RECLAIM_HEADER, STATE_ROUTE, AttemptToken
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown, VersionMissing

_MISSING_MARKERS = ("not loaded", "never been loaded", "implicit reload refused", "does not exist")


def _message(body: Any, fallback: str) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("error_message"):
            return str(body["error_message"])
    return fallback


class SGLangHTTP:
    """One SGLang server's HTTP API. A request with no (complete) answer is :class:`OutcomeUnknown`."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        http: aiohttp.ClientSession | None = None,
        request_timeout: float | None = None,
        probe_timeout: float = 30.0,
        require_patch: bool = True,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._http = http
        self._own_http = http is None
        self.request_timeout = request_timeout
        self.probe_timeout = probe_timeout
        self.require_patch = require_patch

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.close()

    async def request(self, method: str, path: str, *, json_body=None, headers=None, timeout=None) -> tuple[int, Any]:
        try:
            t = aiohttp.ClientTimeout(total=timeout)
            async with self.http.request(method, self.base_url + path, json=json_body, headers=headers, timeout=t) as r:
                text = await r.text()
                try:
                    body = json.loads(text) if text else None
                except ValueError:
                    body = text
                return r.status, body
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:  # no (complete) answer: it may have run
            raise OutcomeUnknown(f"{self.name} {path}: no answer ({type(e).__name__})") from None

    async def state(self) -> dict[str, Any]:
        """The state route of lorapub's SGLang patch: incarnation, adapters, refs, pending unloads."""
        status, body = await self.request("GET", STATE_ROUTE, timeout=self.probe_timeout)
        if status == 404 and self.require_patch:
            raise EngineError(f"{self.name} lacks lorapub's SGLang patch ({STATE_ROUTE} is missing)")
        if status != 200:
            raise EngineError(f"{self.name} {STATE_ROUTE} answered {status}: {_message(body, '')}")
        if self.require_patch and not body.get("managed_patch"):
            raise EngineError(f"{self.name} runs without lorapub's managed-adapter patch (implicit reload possible)")
        return body

    async def admin(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """POST an admin route; anything but 200 is a definite :class:`EngineError`."""
        status, reply = await self.request("POST", path, json_body=dict(body or {}), timeout=self.probe_timeout)
        if status != 200:
            raise EngineError(f"{self.name} {path} answered {status}: {_message(reply, '')}")
        return reply

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One ``/generate``, sent once; a missing adapter is :class:`VersionMissing`."""
        status, body = await self.request("POST", "/generate", json_body=dict(payload), timeout=self.request_timeout)
        if status == 200:
            return body
        message = _message(body, str(status))
        if status == 400 and any(m in message for m in _MISSING_MARKERS):
            raise VersionMissing(f"{self.name} does not hold {payload.get('lora_path')}: {message}", engine=self.name)
        raise EngineError(f"{self.name} /generate answered {status}: {message}", status=status)


class SGLangEngine:
    """A patched SGLang server as an :class:`~lorapub.ports.EngineAdmin`."""

    def __init__(
        self,
        name: str,
        base_url: str,
        stash_dir: str,
        *,
        http: aiohttp.ClientSession | None = None,
        request_timeout: float | None = None,
        probe_timeout: float = 30.0,
        require_patch: bool = True,
    ) -> None:
        self.name = name
        self.client = SGLangHTTP(
            name, base_url, http=http, request_timeout=request_timeout, probe_timeout=probe_timeout,
            require_patch=require_patch,
        )
        self.staging = Staging(name, os.path.join(stash_dir, name))

    @property
    def base_url(self) -> str:
        return self.client.base_url

    @property
    def require_patch(self) -> bool:
        return self.client.require_patch

    @require_patch.setter
    def require_patch(self, value: bool) -> None:
        self.client.require_patch = value

    async def close(self) -> None:
        await self.client.close()

    async def state(self) -> dict[str, Any]:
        return await self.client.state()

    async def incarnation(self) -> str:
        return (await self.client.state())["incarnation"]

    # -- publication ------------------------------------------------------------------
    async def begin(self, request: SendBegin) -> str:
        async with self.staging.lock(request.token):
            if self.staging.refused(request.token):
                raise EngineError(f"{self.name}: attempt {request.token} was cleaned up; late begin refused")
            state = await self.client.state()
            if state["incarnation"] != request.incarnation:
                raise EngineError(f"{self.name}: begin for life {request.incarnation}, engine is {state['incarnation']}")
            if self.staging.begun(request.token):
                return state["incarnation"]  # duplicate begin: same answer
            adapters = state.get("adapters", {})
            if request.lora_name in adapters:
                raise EngineError(f"{self.name}: {request.lora_name} is already loaded")
            if len(adapters) >= int(state.get("max_loaded_loras") or 3):
                raise EngineError(f"{self.name}: no free LoRA slot ({len(adapters)} loaded)")
            self.staging.prepare(request, state["incarnation"])
            return state["incarnation"]

    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        async with self.staging.lock(token):
            return self.staging.store_bucket(token, index, payload)

    async def end(self, token: AttemptToken) -> ReadyLocal:
        async with self.staging.lock(token):
            request, inc = self.staging.live(token)
            adapter_dir = await asyncio.to_thread(self.staging.assemble, request)
            status, body = await self.client.request(
                "POST", "/load_lora_adapter",
                json_body={"lora_name": request.lora_name, "lora_path": adapter_dir, "pinned": True},
                timeout=self.client.probe_timeout,
            )
            if status != 200:
                raise EngineError(f"{self.name}: load of {request.lora_name} failed: {_message(body, str(status))}")
            await self._probe(request.lora_name)
            state = await self.client.state()
            if state["incarnation"] != inc:
                raise EngineError(f"{self.name} restarted during end ({inc} -> {state['incarnation']})")
            entry = state["adapters"].get(request.lora_name)
            if entry is None or entry.get("lora_path") != adapter_dir or not entry.get("pinned"):
                raise EngineError(f"{self.name}: {request.lora_name} is not loaded pinned from this attempt")
            return ReadyLocal(self.name, token, request.digest, inc, entry.get("lora_id"))

    async def _probe(self, lora_name: str) -> None:
        status, body = await self.client.request(
            "POST", "/generate",
            json_body={"input_ids": [1, 2, 3], "lora_path": lora_name, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            timeout=self.client.probe_timeout,
        )
        if status != 200:
            raise EngineError(f"{self.name}: exact-version probe of {lora_name} failed: {_message(body, str(status))}")

    async def _unload(self, lora_name: str, reclaim_id: str) -> None:
        status, body = await self.client.request(
            "POST", "/unload_lora_adapter", json_body={"lora_name": lora_name},
            headers={RECLAIM_HEADER: reclaim_id}, timeout=None,
        )
        if status == 200:
            return
        # "does not exist": an earlier unload whose reply was lost, or never loaded. Check, don't assume.
        state = await self.client.state()
        if lora_name not in state.get("adapters", {}) and lora_name not in state.get("pending_unloads", {}):
            return
        raise EngineError(f"{self.name}: unload of {lora_name} failed: {_message(body, str(status))}")

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        self.staging.refuse(token)  # from now on begin/receive/end of it are refused
        async with self.staging.lock(token):
            self.staging.forget(token)
            await self._unload(lora_name, f"cleanup-{token}")
            self.staging.remove(token)
            return await self.incarnation()

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        await self._unload(lora_name, reclaim_id)

    # -- serving ----------------------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        if not payload.get("lora_path"):
            raise InvalidInput("lorapub never sends a generation without its bound lora_path")
        return await self.client.generate(payload)


class SGLangOverwriteAdmin:
    """An SGLang server as the old overwrite path drives it (``enabled=False``)."""

    def __init__(self, name: str, base_url: str, *, http: aiohttp.ClientSession | None = None,
                 request_timeout: float | None = None, probe_timeout: float = 30.0, require_patch: bool = True) -> None:
        self.name = name
        self.client = SGLangHTTP(
            name, base_url, http=http, request_timeout=request_timeout, probe_timeout=probe_timeout,
            require_patch=require_patch,
        )

    async def close(self) -> None:
        await self.client.close()

    async def pause_generation(self) -> None:
        await self.client.admin("/pause_generation", {"mode": "abort"})

    async def continue_generation(self) -> None:
        await self.client.admin("/continue_generation")

    async def flush_cache(self, attempts: int = 100) -> None:
        # SGLang refuses to flush while aborted requests are still draining: ask again.
        for _ in range(attempts - 1):
            try:
                return await self.client.admin("/flush_cache")
            except EngineError:
                await asyncio.sleep(0.05)
        await self.client.admin("/flush_cache")

    async def loaded_adapters(self) -> list[str]:
        return list((await self.client.state()).get("adapters", {}))

    async def load_adapter(self, lora_name: str, lora_path: str) -> None:
        await self.client.admin("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path, "pinned": False})

    async def unload_adapter(self, lora_name: str) -> None:
        await self.client.admin("/unload_lora_adapter", {"lora_name": lora_name})

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        return await self.client.generate(payload)
