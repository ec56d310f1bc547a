"""SGLang engine over its HTTP admin API (aiohttp).

begin/receive_bucket/end run against an attempt-private stash directory that
the engine can read (local disk or a shared mount); ``end`` verifies the
manifest, fresh-loads the adapter **pinned** through ``/load_lora_adapter`` and
probes the exact name. Requires lorapub's SGLang patch (``/lorapub/state``
gives the incarnation; managed adapters are neither implicitly reloaded nor
unloadable without a reclaim id).

Transport rules: a generation is sent once. A timeout or dropped connection
is :class:`OutcomeUnknown` and is never resent here.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from typing import Any, Mapping

import aiohttp

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import RECLAIM_HEADER, AttemptToken
from lorapub.core.manifest import BucketPlan
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


class SGLangEngine:
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
        self.base_url = base_url.rstrip("/")
        self.stash_root = os.path.join(stash_dir, name)
        self._http = http
        self._own_http = http is None
        self.request_timeout = request_timeout
        self.probe_timeout = probe_timeout
        self.require_patch = require_patch
        self._plans: dict[AttemptToken, tuple[SendBegin, str]] = {}
        self._tombstones: set[AttemptToken] = set()
        self._locks: dict[AttemptToken, asyncio.Lock] = {}

    # -- plumbing -----------------------------------------------------------------
    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._own_http and self._http is not None:
            await self._http.close()

    async def _request(self, method: str, path: str, *, json_body=None, headers=None, timeout=None) -> tuple[int, Any]:
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
        status, body = await self._request("GET", "/lorapub/state", timeout=self.probe_timeout)
        if status == 404 and self.require_patch:
            raise EngineError(f"{self.name} lacks lorapub's SGLang patch (/lorapub/state is missing)")
        if status != 200:
            raise EngineError(f"{self.name} /lorapub/state answered {status}: {_message(body, '')}")
        if self.require_patch and not body.get("managed_patch"):
            raise EngineError(f"{self.name} runs without lorapub's managed-adapter patch (implicit reload possible)")
        return body

    async def incarnation(self) -> str:
        return (await self.state())["incarnation"]

    # -- publication ------------------------------------------------------------------
    def _stash(self, token: AttemptToken) -> str:
        return os.path.join(self.stash_root, f"{token.version}-a{token.seq}")

    def _live(self, token: AttemptToken) -> tuple[SendBegin, str]:
        if token in self._tombstones:
            raise EngineError(f"{self.name}: attempt {token} was cleaned up; refusing to recreate it")
        found = self._plans.get(token)
        if found is None:
            raise EngineError(f"{self.name}: attempt {token} was never begun here")
        return found

    def _lock(self, token: AttemptToken) -> asyncio.Lock:
        # One operation per attempt at a time: a cleanup waits for an in-flight end
        # instead of racing it (else the load could land after the cleanup).
        return self._locks.setdefault(token, asyncio.Lock())

    async def begin(self, request: SendBegin) -> str:
        async with self._lock(request.token):
            return await self._begin(request)

    async def _begin(self, request: SendBegin) -> str:
        if request.token in self._tombstones:
            raise EngineError(f"{self.name}: attempt {request.token} was cleaned up; late begin refused")
        state = await self.state()
        if state["incarnation"] != request.incarnation:
            raise EngineError(f"{self.name}: begin for life {request.incarnation}, engine is {state['incarnation']}")
        if request.token in self._plans:
            return state["incarnation"]  # duplicate begin: same answer
        adapters = state.get("adapters", {})
        if request.lora_name in adapters:
            raise EngineError(f"{self.name}: {request.lora_name} is already loaded")
        if len(adapters) >= int(state.get("max_loaded_loras") or 3):
            raise EngineError(f"{self.name}: no free LoRA slot ({len(adapters)} loaded)")
        stash = self._stash(request.token)
        shutil.rmtree(stash, ignore_errors=True)
        os.makedirs(stash)
        with open(os.path.join(stash, "adapter_config.json"), "w") as f:
            f.write(request.plan.serving_config_json)
        self._plans[request.token] = (request, state["incarnation"])
        return state["incarnation"]

    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        async with self._lock(token):
            return self._store_bucket(token, index, payload)

    def _store_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        request, inc = self._live(token)
        path = os.path.join(self._stash(token), f"bucket-{index:05d}.safetensors")
        if not os.path.exists(path):  # a duplicate receive stores nothing twice
            tmp = path + ".part"
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
        return inc

    def _assemble(self, request: SendBegin, stash: str) -> str:
        """Verify every bucket and the whole manifest, then write the PEFT dir SGLang loads."""
        from lorapub.runtime.snapshot import Snapshot, load_safetensors

        plan: BucketPlan = request.plan
        tensors: dict[str, Any] = {}
        config = None
        for bucket in plan.buckets:
            path = os.path.join(stash, f"bucket-{bucket.index:05d}.safetensors")
            if not os.path.exists(path):
                raise EngineError(f"{self.name}: bucket {bucket.index} of {request.token} never arrived")
            got = load_safetensors(path)
            if sorted(got) != sorted(bucket.tensor_names):
                raise EngineError(f"{self.name}: bucket {bucket.index} holds {sorted(got)}")
            tensors.update(got)
        with open(os.path.join(stash, "adapter_config.json")) as f:
            config = json.load(f)
        snapshot = Snapshot(tensors, config)
        if snapshot.digest != request.digest:
            raise EngineError(f"{self.name}: manifest digest {snapshot.digest[:12]} != {request.digest[:12]}")
        return snapshot.save_peft_dir(os.path.join(stash, "adapter"))

    async def end(self, token: AttemptToken) -> ReadyLocal:
        async with self._lock(token):
            return await self._end(token)

    async def _end(self, token: AttemptToken) -> ReadyLocal:
        request, inc = self._live(token)
        stash = self._stash(token)
        adapter_dir = await asyncio.to_thread(self._assemble, request, stash)
        status, body = await self._request(
            "POST", "/load_lora_adapter",
            json_body={"lora_name": request.lora_name, "lora_path": adapter_dir, "pinned": True},
            timeout=self.probe_timeout,
        )
        if status != 200:
            raise EngineError(f"{self.name}: load of {request.lora_name} failed: {_message(body, str(status))}")
        await self._probe(request.lora_name)
        state = await self.state()
        if state["incarnation"] != inc:
            raise EngineError(f"{self.name} restarted during end ({inc} -> {state['incarnation']})")
        entry = state["adapters"].get(request.lora_name)
        if entry is None or entry.get("lora_path") != adapter_dir or not entry.get("pinned"):
            raise EngineError(f"{self.name}: {request.lora_name} is not loaded pinned from this attempt")
        return ReadyLocal(self.name, token, request.digest, inc, entry.get("lora_id"))

    async def _probe(self, lora_name: str) -> None:
        status, body = await self._request(
            "POST", "/generate",
            json_body={"input_ids": [1, 2, 3], "lora_path": lora_name, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            timeout=self.probe_timeout,
        )
        if status != 200:
            raise EngineError(f"{self.name}: exact-version probe of {lora_name} failed: {_message(body, str(status))}")

    async def _unload(self, lora_name: str, reclaim_id: str) -> None:
        status, body = await self._request(
            "POST", "/unload_lora_adapter", json_body={"lora_name": lora_name},
            headers={RECLAIM_HEADER: reclaim_id}, timeout=None,
        )
        if status == 200:
            return
        # "does not exist": an earlier unload whose reply was lost, or never loaded. Check, don't assume.
        state = await self.state()
        if lora_name not in state.get("adapters", {}) and lora_name not in state.get("pending_unloads", {}):
            return
        raise EngineError(f"{self.name}: unload of {lora_name} failed: {_message(body, str(status))}")

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        self._tombstones.add(token)  # from now on begin/receive/end of it are refused
        async with self._lock(token):
            self._plans.pop(token, None)
            await self._unload(lora_name, f"cleanup-{token}")
            shutil.rmtree(self._stash(token), ignore_errors=True)
            return await self.incarnation()

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        await self._unload(lora_name, reclaim_id)

    # -- serving ----------------------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        if not payload.get("lora_path"):
            raise InvalidInput("lorapub never sends a generation without its bound lora_path")
        status, body = await self._request("POST", "/generate", json_body=dict(payload), timeout=self.request_timeout)
        if status == 200:
            return body
        message = _message(body, str(status))
        if status == 400 and any(m in message for m in _MISSING_MARKERS):
            raise VersionMissing(f"{self.name} does not hold {payload['lora_path']}: {message}", engine=self.name)
        raise EngineError(f"{self.name} /generate answered {status}: {message}", status=status)

    # -- legacy overwrite path (switch off) ----------------------------------------------
    async def admin(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        status, reply = await self._request("POST", path, json_body=dict(body or {}), timeout=self.probe_timeout)
        if status != 200:
            raise EngineError(f"{self.name} {path} answered {status}: {_message(reply, '')}")
        return reply
