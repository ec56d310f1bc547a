"""SGLang contract double: an aiohttp server speaking SGLang 0.5.23's LoRA HTTP contract. A test
double, not an engine: no model runs; what it keeps faithful is the lifecycle lorapub depends on,
running SGLang's own ``LoRARegistry`` (the installed SGLang's, or lorapub's verbatim copy of
0.5.23's), with injectable faults. Outputs are a deterministic function of (adapter content, tokens).
See docs/testing.md, "`SGLangDouble`: the SGLang contract double".
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import mmap
import os
import sys
import uuid
from typing import Any

from aiohttp import web

from lorapub.core.identity import MANAGED_PREFIX, RECLAIM_HEADER, STATE_ROUTE
from lorapub.sglang_patch import staging as engine_side
from lorapub.testing._sglang_registry import lora_registry_module, registry_root
from lorapub.wire.codec import json_bytes
from lorapub.wire.routes import BEGIN_ROUTE, BUCKET_ROUTE, CLEANUP_ROUTE, END_ROUTE, RELEASE_ROUTE, ROUTES

__all__ = [
    "NORMAL", "ADMIN_OPTIONAL", "ADMIN_FORCE", "ROUTE_AUTH_LEVELS", "decide_request_auth", "content_signature",
    "token_logprob", "next_token", "Fault", "SGLangDouble", "SGLangUnderTest",
]

NORMAL, ADMIN_OPTIONAL, ADMIN_FORCE = "normal", "admin_optional", "admin_force"

#: Each route's auth level, as SGLang's ``http_server.py`` marks it with ``@auth_level`` (unmarked:
#: NORMAL) and as lorapub's patch registers its state route (ADMIN_OPTIONAL, like the LoRA routes).
#: A test keeps this equal to SGLang's own file.
ROUTE_AUTH_LEVELS: dict[tuple[str, str], str] = {
    ("POST", "/load_lora_adapter"): ADMIN_OPTIONAL,
    ("POST", "/unload_lora_adapter"): ADMIN_OPTIONAL,
    ("POST", "/pause_generation"): ADMIN_OPTIONAL,
    ("POST", "/continue_generation"): ADMIN_OPTIONAL,
    ("POST", "/flush_cache"): ADMIN_OPTIONAL,
    ("POST", "/abort_request"): ADMIN_OPTIONAL,
    ("GET", STATE_ROUTE): ADMIN_OPTIONAL,
    ("POST", "/generate"): NORMAL,
    ("GET", "/v1/models"): NORMAL,
    ("GET", "/server_info"): NORMAL,
    ("GET", "/health"): NORMAL,
}
# lorapub's engine-side staging routes: admin-level, like SGLang's LoRA admin routes (see below).
ROUTE_AUTH_LEVELS.update({route: ADMIN_OPTIONAL for route in ROUTES})


def decide_request_auth(*, method: str, path: str, authorization_header: str | None, api_key: str | None,
                        admin_api_key: str | None, auth_level: str) -> tuple[bool, int]:
    """SGLang's rule (``srt/utils/auth.py``: ``decide_request_auth``), restated for where SGLang
    is not installed; ``(allowed, status when refused)``. A test checks it against 0.5.17's and
    0.5.23's own function for every combination."""
    import secrets

    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True, 401

    def bearer(expected: str) -> bool:
        if not authorization_header:
            return False
        parts = authorization_header.split(" ", 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return False
        return secrets.compare_digest(parts[1], expected)

    if auth_level == ADMIN_FORCE:
        if not admin_api_key:
            return False, 403
        return bearer(admin_api_key), 401
    if auth_level == ADMIN_OPTIONAL:
        if admin_api_key:
            return bearer(admin_api_key), 401
        if api_key:
            return bearer(api_key), 401
        return True, 401
    if api_key:
        return bearer(api_key), 401
    return True, 401


@functools.lru_cache(maxsize=1)
def _sglang_decide():
    """SGLang's own ``decide_request_auth`` (the installed tree's ``srt/utils/auth.py``, which
    imports nothing beyond the standard library), adapted to this module's levels; None where
    SGLang is not installed."""
    path = os.path.join(registry_root(), "srt", "utils", "auth.py")
    if not os.path.exists(path):
        return None
    name = "lorapub_sglang.auth"  # a private name: the ``sglang`` namespace is left alone
    spec = importlib.util.spec_from_file_location(name, path)
    auth = importlib.util.module_from_spec(spec)
    sys.modules[name] = auth  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(auth)

    def decide(*, auth_level: str, **kw: Any) -> tuple[bool, int]:
        decision = auth.decide_request_auth(auth_level=auth.AuthLevel(auth_level), **kw)
        return decision.allowed, decision.error_status_code

    return decide


def content_signature(path: str) -> str:
    """SHA-256 of the adapter folder's files: every byte read, as a loader reads them (mapped, not
    copied into a buffer of their own first)."""
    h = hashlib.sha256()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        with open(os.path.join(path, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                h.update(m)
    return h.hexdigest()


def token_logprob(signature: str, prefix: list[int], token: int) -> float:
    """Deterministic stand-in for log p(token | prefix) under one adapter."""
    h = hashlib.sha256(f"{signature}|{len(prefix)}|{prefix[-8:]}|{token}".encode()).digest()
    return -(int.from_bytes(h[:4], "big") % 100000) / 10000.0


def next_token(signature: str, prefix: list[int]) -> int:
    h = hashlib.sha256(f"{signature}|next|{prefix[-8:]}|{len(prefix)}".encode()).digest()
    return int.from_bytes(h[:2], "big") % 1000


class Fault:
    def __init__(self, mode: str, count: int, delay: float, status: int) -> None:
        self.mode, self.count, self.delay, self.status = mode, count, delay, status


class SGLangDouble:
    """One in-process SGLang server (``await SGLangDouble("e0").start()``, then ``.url``).

    Faults: ``inject(op, mode)`` with op ``load``/``unload``/``state``/``pause``/``continue``/``flush``
    and mode ``error`` (a definite failure), ``drop`` (done, never answered), ``hang`` or ``slow``; op
    ``generate`` takes ``error`` or ``slow``; ``unload_slow`` delays the physical unload. ``restart()`` is a crash: a new incarnation
    with nothing loaded. ``events``, ``physical_unloads``, ``refs(name)`` and
    ``registered()`` show what happened.

    ``api_key``/``admin_api_key`` are the server's ``--api-key``/``--admin-api-key``: requests
    are let in or refused (401/403, ``{"error": "Unauthorized"}``) exactly as SGLang's
    middleware decides. ``stock=True`` is SGLang without lorapub's patch: ``/lorapub/state``
    does not exist (404) and managed names get no protection.

    ``blocking_load=True`` models SGLang's scheduler, which loads an adapter between batches:
    while a load runs (``load_delay``, an implicit reload included) no prefill or decode step
    starts on this engine; steps resume when the adapter is registered. Off (the default),
    decoding goes on beside a load. ``install_stop`` and ``first_use_stop`` model lorapub's patched
    server, whose load runs beside decoding (measured live: docs/gpu-acceptance.md): once the load
    is done every step waits ``install_stop`` (the scheduler swapping the prepared adapter in), and
    the first step that uses an adapter waits ``first_use_stop`` for every request (its memory-pool
    slot being filled).
    """

    def __init__(
        self,
        name: str,
        *,
        max_loaded_loras: int = 3,
        max_loras_per_batch: int | None = None,
        context_len: int = 4096,
        managed_prefix: str = MANAGED_PREFIX,
        managed_patch: bool = True,
        decode_delay: float = 0.002,
        load_delay: float = 0.0,
        prefill_per_token: float = 0.0,
        blocking_load: bool = False,
        install_stop: float = 0.0,
        first_use_stop: float = 0.0,
        stock: bool = False,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        served_model_name: str = "lorapub-tiny-qwen3",
    ) -> None:
        self.name = name
        self.max_loaded_loras = max_loaded_loras
        self.managed_prefix = managed_prefix  # the names its patch protects (SGLANG_LORAPUB_MANAGED_PREFIX)
        # SGLang refuses max_loaded_loras < max_loras_per_batch; the double defaults them equal
        self.max_loras_per_batch = max_loaded_loras if max_loras_per_batch is None else max_loras_per_batch
        self.context_len = context_len
        self.stock = stock
        self.managed_patch = managed_patch and not stock
        self.served_model_name = served_model_name
        self._api_key, self._admin_api_key = api_key, admin_api_key
        self._decide = _sglang_decide() or decide_request_auth
        self.refused: list[tuple[str, str, int]] = []  # (method, path, status) turned away at the door
        self.decode_delay = decode_delay
        self.load_delay = load_delay  # simulated adapter load + GPU preparation time
        self.prefill_per_token = prefill_per_token  # uncached prompt tokens cost prefill time
        self.blocking_load = blocking_load  # a load holds this engine's batches (SGLang's scheduler)
        self.install_stop = install_stop  # every step waits this long once a load is done
        self.first_use_stop = first_use_stop  # ... and this long at an adapter's first step
        self._slot_filled: set[str] = set()  # adapters whose first step ran
        self.faults: dict[str, Fault] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.events: list[tuple[str, str]] = []
        self.generations = 0  # generations that ran to the end
        self.generate_requests = 0  # /generate requests that reached the engine, whatever became of them
        registry = lora_registry_module()
        self._LoRARegistry, self._LoRARef = registry.LoRARegistry, registry.LoRARef
        self._boot()

    # -- process life --------------------------------------------------------
    def _boot(self) -> None:
        self.incarnation = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.lora_registry = self._LoRARegistry()
        self.ref_cache: dict[str, Any] = {}
        self.pending_unloads: dict[str, str] = {}
        self.update_lock = asyncio.Lock()
        self.loaded: dict[str, str] = {}  # lora_id -> content signature (the "GPU pool")
        self.prefix_cache: dict[str, list[tuple[int, ...]]] = {}
        self.paused = asyncio.Event()
        self.paused.set()
        self.not_loading = asyncio.Event()  # cleared while a blocking load (or a modelled stop) holds the batches
        self.not_loading.set()
        self._holds = 0
        self.abort_gen = 0  # bumped by pause_generation(mode="abort"): running requests end aborted
        self.running_rids: set[str] = set()  # rids of /generate requests running now
        self.aborted_rids: set[str] = set()  # ... of which /abort_request asked these to end
        self.physical_unloads: list[str] = []

    def restart(self) -> None:
        """A crash and restart: every adapter, counter and cache is gone; new incarnation."""
        self._boot()
        self.events.append(("restart", self.incarnation))

    def __repr__(self) -> str:
        return f"SGLangDouble({self.name!r}, url={self.url!r}, stock={self.stock})"  # never the keys

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """SGLang's ``add_api_key_middleware``: unknown routes are NORMAL, as there."""
        level = ROUTE_AUTH_LEVELS.get((request.method, request.path), NORMAL)
        if request.method == "HEAD":
            level = ROUTE_AUTH_LEVELS.get(("GET", request.path), NORMAL)
        allowed, status = self._decide(
            method=request.method, path=request.path, authorization_header=request.headers.get("Authorization"),
            api_key=self._api_key, admin_api_key=self._admin_api_key, auth_level=level,
        )
        if not allowed:
            self.refused.append((request.method, request.path, status))
            return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"}, status=status)
        return await handler(request)

    async def start(self) -> "SGLangDouble":
        app = web.Application(middlewares=[self._auth])
        r = app.router
        r.add_post("/load_lora_adapter", self.h_load)
        r.add_post("/unload_lora_adapter", self.h_unload)
        r.add_post("/generate", self.h_generate)
        if not self.stock:
            r.add_get(STATE_ROUTE, self.h_state)
            self._add_staging_routes(r)
        r.add_get("/health", self.h_health)
        r.add_get("/server_info", self.h_server_info)
        r.add_get("/v1/models", self.h_models)
        r.add_get("/model_info", self.h_model_info)  # the SGLang router reads it when a worker joins
        r.add_get("/get_model_info", self.h_model_info)  # its deprecated alias, which the router falls back to
        r.add_post("/pause_generation", self.h_pause)
        r.add_post("/continue_generation", self.h_continue)
        r.add_post("/flush_cache", self.h_flush)
        r.add_post("/abort_request", self.h_abort_request)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        staging = self.__dict__.pop("_staging", None)
        if staging is not None:  # a server going away frees its stash, as the patched server's shutdown does
            staging.close()

    # -- faults ----------------------------------------------------------------
    def inject(self, op: str, mode: str = "error", count: int = 1, delay: float = 0.0, status: int = 500) -> None:
        """mode: error (definite failure), drop (do it, never answer), hang (never answer), slow."""
        self.faults[op] = Fault(mode, count, delay, status)

    def _fault(self, op: str) -> Fault | None:
        f = self.faults.get(op)
        if f is None or f.count == 0:
            return None
        f.count -= 1
        return f

    async def _apply_fault(self, op: str, before: bool) -> web.Response | None:
        f = self._fault(op) if before else None
        if f is None:
            return None
        if f.mode == "error":
            return web.json_response({"error": {"message": f"injected {op} failure"}}, status=f.status)
        if f.mode == "hang":
            await asyncio.sleep(3600)
        if f.mode == "slow":
            await asyncio.sleep(f.delay)
        if f.mode == "drop":
            self.faults[f"__drop_{op}"] = f
        return None

    async def _maybe_drop_reply(self, op: str) -> None:
        if self.faults.pop(f"__drop_{op}", None) is not None:
            await asyncio.sleep(3600)  # the work happened; the reply never comes

    # -- admin -----------------------------------------------------------------
    async def h_state(self, request: web.Request) -> web.Response:
        refused = await self._apply_fault("state", True)
        if refused is not None:
            return refused
        adapters = {
            name: {
                "lora_id": ref.lora_id,
                "lora_path": ref.lora_path,
                "pinned": bool(ref.pinned),
                "refs": self.lora_registry._counters[ref.lora_id].value(),
            }
            for name, ref in self.lora_registry.get_all_adapters().items()
        }
        return web.json_response(
            {
                "incarnation": self.incarnation,
                "max_loaded_loras": self.max_loaded_loras,
                "managed_patch": self.managed_patch,
                "managed_prefix": self.managed_prefix if self.managed_patch else None,
                "adapters": adapters,
                "pending_unloads": dict(self.pending_unloads),
                "staging": self.staging.report(),
            }
        )

    async def h_health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def h_server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"max_loaded_loras": self.max_loaded_loras, "max_loras_per_batch": self.max_loras_per_batch,
                                  "enable_lora": True, "version": "0.5.23"})

    async def h_models(self, request: web.Request) -> web.Response:
        """SGLang's ``/v1/models``: the base model, then a card per loaded adapter (parent = base)."""
        base = self.served_model_name
        cards = [{"id": base, "object": "model", "owned_by": "sglang", "root": base, "parent": None,
                  "max_model_len": self.context_len}]
        cards += [{"id": name, "object": "model", "owned_by": "sglang", "root": ref.lora_path, "parent": base,
                   "max_model_len": None}
                  for name, ref in self.lora_registry.get_all_adapters().items()]
        return web.json_response({"object": "list", "data": cards})

    async def h_model_info(self, request: web.Request) -> web.Response:
        # SGLang 0.5.23's /model_info fields (model_path stays None: no model, and the SGLang router
        # would try to load a tokenizer from it); the router reads model_type and architectures.
        return web.json_response(
            {
                "model_path": None,
                "served_model_name": None,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
            }
        )

    def _hold_steps(self) -> asyncio.Event:
        """Stop every step until the matching :meth:`_release_steps`; returns this incarnation's gate."""
        self._holds += 1
        self.not_loading.clear()
        return self.not_loading

    def _release_steps(self, gate: asyncio.Event) -> None:
        if gate is not self.not_loading:  # taken before a restart: that incarnation's gate is gone
            return
        self._holds -= 1
        if not self._holds:
            self.not_loading.set()

    async def _stop_steps(self, seconds: float) -> None:
        """No prefill or decode step starts on this engine for ``seconds``."""
        gate = self._hold_steps()
        try:
            await asyncio.sleep(seconds)
        finally:
            self._release_steps(gate)

    async def _load(self, lora_name: str, lora_path: str, pinned: bool, signature: str | None = None) -> dict[str, Any]:
        if lora_name in self.pending_unloads:
            raise ValueError(f"LoRA adapter '{lora_name}' has an incomplete unload.")
        gate = self._hold_steps() if self.blocking_load else None  # callers hold update_lock: one load at a time
        try:
            if signature is None:  # from tensors: the caller computed it
                signature = await asyncio.to_thread(content_signature, lora_path)  # raises on a bad path, like the real loader
            if self.load_delay:
                await asyncio.sleep(self.load_delay)
            if self.install_stop:
                await self._stop_steps(self.install_stop)
            pinned_now = sum(1 for r in self.lora_registry.get_all_adapters().values() if r.pinned)
            if pinned and pinned_now >= self.max_loras_per_batch - 1:  # SGLang's LoRAManager.validate_new_adapter
                raise ValueError(
                    f"Failed to load LoRA adapter {lora_name} as a pinned adapter. It is not allowed to pin all slots "
                    "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
                )
            ref = self._LoRARef(lora_name=lora_name, lora_path=lora_path, pinned=pinned)
            await self.lora_registry.register(ref)  # "already exists" -> ValueError
            self.loaded[ref.lora_id] = signature
            self.ref_cache[lora_name] = ref
            self.events.append(("load", lora_name))
        finally:
            if gate is not None:
                self._release_steps(gate)
        while self.lora_registry.num_registered_loras > self.max_loaded_loras:
            lru = await self.lora_registry.lru_lora_name(exclude_pinned=True)
            if lru is None:
                raise ValueError("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter.")
            await self._unload_locked(lru)
        return {n: r.lora_path for n, r in self.lora_registry.get_all_adapters().items()}

    async def h_load(self, request: web.Request) -> web.Response:
        body = await request.json()
        refused = await self._apply_fault("load", True)
        if refused is not None:
            return refused
        try:
            async with self.update_lock:
                loaded = await self._load(body["lora_name"], body["lora_path"], bool(body.get("pinned", False)))
        except (ValueError, OSError) as e:
            return web.json_response({"success": False, "error_message": str(e)}, status=400)
        await self._maybe_drop_reply("load")
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": loaded})

    async def _unload_locked(self, lora_name: str) -> None:
        lora_id = self.pending_unloads.get(lora_name)
        if lora_id is None:
            lora_id = await self.lora_registry.unregister(lora_name)
            self.pending_unloads[lora_name] = lora_id
        await self.lora_registry.wait_for_unload(lora_id)
        f = self.faults.get("unload_slow")
        if f is not None:
            await asyncio.sleep(f.delay)
        self.loaded.pop(lora_id, None)
        self.prefix_cache.pop(lora_id, None)
        self.physical_unloads.append(lora_name)
        self.events.append(("unload", lora_name))
        self.pending_unloads.pop(lora_name)

    async def h_unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body["lora_name"]
        refused = await self._apply_fault("unload", True)
        if refused is not None:
            return refused
        ref = self.lora_registry.get_all_adapters().get(name)
        if (
            self.managed_patch
            and name.startswith(self.managed_prefix)
            and name not in self.pending_unloads
            and ref is not None
            and not request.headers.get(RECLAIM_HEADER)
        ):
            return web.json_response(
                {"success": False, "error_message": f"LoRA adapter '{name}' is managed by lorapub; unload refused"},
                status=400,
            )
        try:
            async with self.update_lock:
                await self._unload_locked(name)
        except ValueError as e:
            return web.json_response({"success": False, "error_message": str(e)}, status=400)
        await self._maybe_drop_reply("unload")
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": {}})

    async def h_pause(self, request: web.Request) -> web.Response:
        refused = await self._apply_fault("pause", True)
        if refused is not None:
            return refused
        body = await request.json() if request.can_read_body else {}
        if (body or {}).get("mode", "abort") == "abort":
            self.abort_gen += 1
        self.paused.clear()
        self.events.append(("pause", ""))
        await self._maybe_drop_reply("pause")
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def h_continue(self, request: web.Request) -> web.Response:
        refused = await self._apply_fault("continue", True)
        if refused is not None:
            return refused
        self.paused.set()
        self.events.append(("continue", ""))
        await self._maybe_drop_reply("continue")
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def h_flush(self, request: web.Request) -> web.Response:
        refused = await self._apply_fault("flush", True)
        if refused is not None:
            return refused
        self.prefix_cache.clear()
        self.events.append(("flush", ""))
        await self._maybe_drop_reply("flush")
        # SGLang answers in plain text, not JSON
        return web.Response(text=(
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        ))

    async def h_abort_request(self, request: web.Request) -> web.Response:
        """SGLang's ``/abort_request``: a running request of that ``rid`` ends aborted; an unknown
        ``rid`` is ignored. Answers 200 with an empty body, as SGLang does."""
        body = await request.json() if request.can_read_body else {}
        rid = (body or {}).get("rid")
        self.events.append(("abort_request", str(rid)))
        if rid in self.running_rids:
            self.aborted_rids.add(rid)
        return web.Response(status=200)

    @property
    def is_paused(self) -> bool:
        """Whether generation stands paused (a pause without its continue)."""
        return not self.paused.is_set()

    # -- generation --------------------------------------------------------------
    async def _resolve(self, name: str) -> str:
        if name not in self.lora_registry.get_all_adapters():
            if name not in self.ref_cache:
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}")
            if self.managed_patch and name.startswith(self.managed_prefix):
                raise ValueError(f"LoRA adapter {name} is managed and not loaded; implicit reload refused")
            ref = self.ref_cache[name]
            async with self.update_lock:  # the unpatched hazard: a fresh lora_id behind lorapub's back
                try:
                    await self._load(ref.lora_name, ref.lora_path, bool(ref.pinned))
                except OSError as e:  # live SGLang answers 400 when the adapter's files are gone
                    raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
            self.events.append(("implicit_reload", name))
        return await self.lora_registry.acquire(name)

    def _cached_tokens(self, lora_id: str | None, ids: list[int]) -> int:
        best = 0
        for seq in self.prefix_cache.get(lora_id or "<base>", []):
            n = 0
            for a, b in zip(seq, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        self.generate_requests += 1
        body = await request.json()
        ids = list(body.get("input_ids") or [ord(c) % 1000 for c in body.get("text", "")])
        sampling = body.get("sampling_params") or {}
        max_new = int(sampling.get("max_new_tokens", 8))
        name = body.get("lora_path")
        lora_id = None
        released = False

        async def release_once() -> None:
            nonlocal released
            if lora_id is not None and not released:
                released = True
                await self.lora_registry.release(lora_id)

        await self.paused.wait()  # like SGLang: new requests wait out a pause before resolving LoRA
        gen = self.abort_gen
        rid = body.get("rid")
        if isinstance(rid, str):
            self.running_rids.add(rid)
        try:
            if name:
                try:
                    lora_id = await self._resolve(name)
                except ValueError as e:
                    return web.json_response({"error": {"message": str(e)}}, status=400)
            if len(ids) + max_new > self.context_len:  # pre-dispatch validation
                await release_once()
                return web.json_response(
                    {"error": {"message": f"Requested token count exceeds the model's context length {self.context_len}"}},
                    status=400,
                )
            f = self._fault("generate")
            if f is not None:
                if f.mode == "error":
                    await release_once()
                    return web.json_response({"error": {"message": "injected"}}, status=f.status)
                if f.mode == "slow":
                    await asyncio.sleep(f.delay)
            signature = self.loaded.get(lora_id, "<base>") if lora_id else "<base>"
            cached = self._cached_tokens(lora_id, ids)
            if self.prefill_per_token:
                await self.not_loading.wait()
                await asyncio.sleep(self.prefill_per_token * (len(ids) - cached))
            seq = list(ids)
            logprobs = []
            if self.first_use_stop and lora_id is not None and lora_id not in self._slot_filled:
                self._slot_filled.add(lora_id)
                await self._stop_steps(self.first_use_stop)
            for _ in range(max_new):
                if rid in self.aborted_rids:  # /abort_request: what it made so far, finish_reason abort
                    await release_once()
                    return web.json_response({
                        "text": " ".join(map(str, seq[len(ids):])),
                        "output_ids": seq[len(ids):],
                        "meta_info": {
                            "id": rid, "prompt_tokens": len(ids), "completion_tokens": len(seq) - len(ids),
                            "cached_tokens": cached, "lora_id": lora_id, "output_token_logprobs": logprobs,
                            "finish_reason": {"type": "abort", "message": "Abort in decode"},
                        },
                    })
                if gen != self.abort_gen:
                    await release_once()
                    return web.json_response({"error": {"message": "Request aborted by pause_generation"}}, status=503)
                await self.paused.wait()
                await self.not_loading.wait()
                await asyncio.sleep(self.decode_delay)
                if lora_id is not None and lora_id not in self.loaded:
                    raise RuntimeError("adapter unloaded under a running request")  # must never happen
                tok = next_token(signature, seq)
                logprobs.append(token_logprob(signature, seq, tok))
                seq.append(tok)
            prompt_scores = [token_logprob(signature, ids[:i], ids[i]) for i in range(1, len(ids))]
            self.prefix_cache.setdefault(lora_id or "<base>", []).append(tuple(seq))
            self.generations += 1
            out = {
                "text": " ".join(map(str, seq[len(ids):])),
                "output_ids": seq[len(ids):],
                "meta_info": {
                    "id": body.get("rid") or uuid.uuid4().hex,
                    "prompt_tokens": len(ids),
                    "completion_tokens": max_new,
                    "cached_tokens": cached,
                    "lora_id": lora_id,
                    "output_token_logprobs": logprobs,
                    "input_token_logprobs": prompt_scores,
                    "finish_reason": {"type": "length", "length": max_new},
                },
            }
            await release_once()
            return web.json_response(out)
        finally:
            if isinstance(rid, str):
                self.running_rids.discard(rid)
                self.aborted_rids.discard(rid)
            # client disconnect / abort / crash: exactly once, whatever the path
            await asyncio.shield(release_once())


    # -- lorapub's engine-side staging (the routes lorapub's SGLang patch adds) -------------------
    # The same code the patched server runs (lorapub.sglang_patch.staging), with this double
    # as its engine: a load from a staged folder or from tensors goes through the double's own load.
    # Set ``stash_root``, ``shm_dir`` or ``stage_idle_s`` (seconds an undriven attempt is kept) on
    # the double before its first staging call to stage elsewhere or age attempts out sooner.
    @property
    def staging(self) -> engine_side.EngineStaging:
        current = self.__dict__.get("_staging")
        if current is None or current.incarnation != self.incarnation:  # a new life stages afresh
            if current is not None:
                current.close()
            current = self.__dict__["_staging"] = engine_side.EngineStaging(
                _DoubleHooks(self), incarnation=self.incarnation,
                stash_root=self.__dict__.get("stash_root"), shm_dir=self.__dict__.get("shm_dir"),
                idle_timeout=self.__dict__.get("stage_idle_s"),  # None: LORAPUB_STAGE_IDLE_S, as the server
            )
        return current

    def _add_staging_routes(self, r: web.UrlDispatcher) -> None:
        async def json_of(request: web.Request) -> Any:
            try:
                return await request.json()
            except ValueError:
                return None

        def answer(status_body: tuple[int, dict]) -> web.Response:
            return web.json_response(status_body[1], status=status_body[0])

        async def begin(request: web.Request) -> web.Response:
            return answer(await self.staging.begin(await json_of(request)))

        async def bucket(request: web.Request) -> web.Response:
            refused = await self._apply_fault("bucket", True)
            if refused is not None:
                await request.read()
                return refused
            out = await self.staging.receive(dict(request.query), request.content.iter_chunked(1 << 20),
                                             request.content_length)
            await self._maybe_drop_reply("bucket")
            return answer(out)

        async def end(request: web.Request) -> web.Response:
            body = await json_of(request)
            refused = await self._apply_fault("load", True)  # the end's load fails like a load would
            if refused is not None:
                return refused
            out = await self.staging.end(body)
            await self._maybe_drop_reply("load")
            return answer(out)

        async def cleanup(request: web.Request) -> web.Response:
            return answer(await self.staging.cleanup(await json_of(request)))

        async def release(request: web.Request) -> web.Response:
            return answer(await self.staging.release(await json_of(request)))

        for path, handler in ((BEGIN_ROUTE, begin), (BUCKET_ROUTE, bucket),
                              (END_ROUTE, end), (CLEANUP_ROUTE, cleanup),
                              (RELEASE_ROUTE, release)):
            r.add_post(path, handler)

    # -- introspection for tests ----------------------------------------------------
    def refs(self, name: str) -> int | None:
        ref = self.lora_registry.get_all_adapters().get(name)
        if ref is None:
            return None
        return self.lora_registry._counters[ref.lora_id].value()

    def registered(self) -> list[str]:
        return list(self.lora_registry.get_all_adapters())


class SGLangUnderTest:
    """lorapub's SGLang engine adapter (:class:`~lorapub.adapters.sglang_wire.SGLangWireEngine`)
    against a fresh :class:`SGLangDouble`, as the conformance suite sees it
    (:class:`~lorapub.testing.conformance.EngineUnderTest`)."""

    def __init__(self, double: SGLangDouble, admin: Any) -> None:
        self.double = double
        self.admin = admin

    @classmethod
    async def start(
        cls, stash_dir: str, name: str = "e0", *, request_timeout: float = 1.0, transport: Any = None,
        api_key: str | None = None, admin_api_key: str | None = None,
    ) -> "SGLangUnderTest":
        """A fresh double staging on its own disk ``stash_dir`` and the adapter on it, sending buckets
        ``transport``'s way (None: HTTP bodies; a shared-memory or shared-folder transport's folder
        is the double's too); with keys, the server requires them and the adapter holds them."""
        from lorapub.adapters.sglang_wire import SGLangWireEngine

        double = SGLangDouble(name, decode_delay=0.005, api_key=api_key, admin_api_key=admin_api_key)
        double.stash_root = stash_dir  # the engine's own disk
        double.shm_dir = getattr(transport, "shm_dir", None)
        await double.start()
        admin = SGLangWireEngine(
            name, double.url, request_timeout=request_timeout, probe_timeout=request_timeout,
            load_timeout=request_timeout, api_key=api_key, admin_api_key=admin_api_key,
        )
        if transport is not None:
            admin.use_transport(transport)
        return cls(double, admin)

    async def served(self) -> set[str]:
        return set(self.double.registered())

    def physical_unloads(self, lora_name: str) -> int:
        return self.double.physical_unloads.count(lora_name)

    def native_refs(self, lora_name: str) -> int:
        return self.double.refs(lora_name) or 0

    def generate_requests(self) -> int:
        return self.double.generate_requests

    def generation(self, lora_name: str, *, long: bool = False) -> dict[str, Any]:
        return {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 60 if long else 2}, "lora_path": lora_name}

    def fail_next(self, op: str) -> None:
        self.double.inject(op, "error", status=500)

    def drop_next_reply(self, op: str) -> None:
        timeout = self.admin.client.request_timeout if op == "generate" else self.admin.client.probe_timeout
        if op == "generate":  # the request runs on; its reply comes after the client gave up
            self.double.inject(op, "slow", delay=2 * timeout)
        else:  # the work is done, the reply never comes
            self.double.inject(op, "drop")

    def restart(self) -> None:
        self.double.restart()

    async def close(self) -> None:
        await self.admin.close()
        await self.double.stop()


class _DoubleHooks:
    """The double as the engine of :class:`~lorapub.sglang_patch.staging.EngineStaging`."""

    def __init__(self, double: SGLangDouble) -> None:
        self.double = double

    def adapters(self) -> dict[str, dict[str, Any]]:
        return {n: {"lora_id": r.lora_id, "pinned": bool(r.pinned), "lora_path": r.lora_path}
                for n, r in self.double.lora_registry.get_all_adapters().items()}

    def max_loaded_loras(self) -> int:
        return self.double.max_loaded_loras

    def managed_prefix(self) -> str:
        return self.double.managed_prefix

    async def _load(self, lora_name: str, lora_path: str, signature: str | None) -> str | None:
        try:
            async with self.double.update_lock:
                await self.double._load(lora_name, lora_path, True, signature)
        except (ValueError, OSError) as e:
            return str(e)
        return None

    async def load_dir(self, lora_name: str, path: str) -> str | None:
        return await self._load(lora_name, path, None)

    async def load_tensors(self, lora_name: str, tensors: dict[str, Any], config: dict[str, Any],
                           checksums: dict[str, str]) -> str | None:
        def signature() -> str:  # what SGLang's ranks check (expected_checksums), then the content
            import torch

            h = hashlib.sha256()
            for name in sorted(tensors):
                raw = tensors[name].reshape(-1).view(torch.uint8).numpy()
                got = hashlib.sha256(raw).hexdigest()
                if got != checksums.get(name):
                    raise ValueError(f"[LORA-CHECK] adapter sync MISMATCH: {name}")
                # the content's identity from each tensor's checked digest: one pass over the bytes
                h.update(name.encode() + b"\0" + got.encode())
            h.update(json_bytes(config))
            return h.hexdigest()

        try:
            sig = await asyncio.to_thread(signature)
        except ValueError as e:
            return str(e)
        return await self._load(lora_name, "__tensor__", sig)
