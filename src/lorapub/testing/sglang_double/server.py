"""The SGLang contract double's HTTP server: :class:`SGLangDouble`, its engine
(:class:`~lorapub.testing.sglang_double.engine.DoubleEngine`) behind SGLang 0.5.23's LoRA routes,
the state route and staging routes lorapub's patch adds, SGLang's key middleware and the answers
of injected faults.
See docs/testing.md, "`SGLangDouble`: the SGLang contract double".
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from lorapub.sglang_patch import provenance
from lorapub.testing import numeric
from lorapub.testing.sglang_double.auth import NORMAL, ROUTE_AUTH_LEVELS
from lorapub.testing.sglang_double.engine import DoubleEngine, next_token, token_logprob
from lorapub.wire.messages import AdapterEntry, StateReply
from lorapub.wire.routes import BEGIN_ROUTE, BUCKET_ROUTE, CLEANUP_ROUTE, END_ROUTE, RECLAIM_HEADER, RELEASE_ROUTE, STATE_ROUTE

__all__ = ["BODY_LIMIT", "SGLangDouble"]

#: The largest request body the double reads (aiohttp's own default is 1 MiB). SGLang's server
#: (uvicorn and Starlette) sets no limit, nor do the staging routes lorapub's patch adds: a begin
#: request names every tensor of the adapter, so it grows with the adapter (about 1 MiB for 5,000).
BODY_LIMIT = 1 << 40


class SGLangDouble(DoubleEngine):
    """One in-process SGLang server (``await SGLangDouble("e0").start()``, then ``.url``).

    Faults: ``inject(op, mode)`` with op ``load``/``unload``/``state``/``pause``/``continue``/``flush``
    and mode ``error`` (a definite failure), ``drop`` (done, never answered), ``hang`` or ``slow``; op
    ``generate`` takes ``error`` or ``slow``; ``unload_slow`` delays the physical unload.
    ``restart()`` is a crash: every request in flight loses its connection unanswered, and a new
    incarnation starts with nothing loaded. ``events``, ``physical_unloads``, ``refs(name)`` and
    ``registered()`` show what happened.

    LoRA limits are SGLang's server arguments, with SGLang's defaults: ``max_loras_per_batch``
    (``--max-loras-per-batch``, 8) and ``max_loaded_loras`` (``--max-loaded-loras``, unset: no limit;
    given alone below 8, the batch slots follow it).

    ``/generate`` with ``"stream": true`` answers as SGLang's does: server-sent events, one
    ``data: {...}`` per token (the last one the whole answer), then ``data: [DONE]``.

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

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
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
        task = asyncio.current_task()
        assert task is not None  # a handler runs in a task of its own
        self._in_flight[task] = request
        try:
            return await handler(request)
        finally:
            self._in_flight.pop(task, None)

    def restart(self) -> None:
        """A crash and restart: the connection of every request in flight drops unanswered (a client
        sees the server disconnect, never a status), then a new incarnation with nothing loaded."""
        try:
            current = asyncio.current_task()
        except RuntimeError:  # called outside an event loop: no request of ours runs this
            current = None
        in_flight = self.__dict__.get("_in_flight", {})  # none before start()
        for task, request in list(in_flight.items()):
            if task is current:
                continue
            if request.transport is not None:
                request.transport.abort()
            task.cancel()
        in_flight.clear()
        super().restart()

    async def start(self) -> "SGLangDouble":
        self._in_flight: dict[asyncio.Task[Any], web.Request] = {}  # handler task -> its request
        app = web.Application(middlewares=[self._auth], client_max_size=BODY_LIMIT)
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
        # the port the OS chose for port 0 (the runner's addresses: its server is asyncio's or, once AReaL has
        # installed uvloop's policy, uvloop's, which is no asyncio.Server)
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        staging = self.__dict__.pop("_staging", None)
        if staging is not None:  # a server going away frees its stash, as the patched server's shutdown does
            staging.close()

    # -- faults, answered ----------------------------------------------------------
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
            name: AdapterEntry(ref.lora_id, ref.lora_path, bool(ref.pinned),
                               self.lora_registry._counters[ref.lora_id].value())
            for name, ref in self.lora_registry.get_all_adapters().items()
        }
        return web.json_response(StateReply(
            self.incarnation, adapters, self.pending_unloads, self.max_loaded_loras, self.managed_patch,
            self.managed_prefix if self.managed_patch else None, self.managed_patch, self.staging.staging_report(),
        ).to_json())

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

    def _stamped(self, name: object, lora_id: object) -> dict[str, Any]:
        found = self.stamp(name, lora_id)
        return {} if found is None else {provenance.STAMP_KEY: found}

    async def h_generate(self, request: web.Request) -> web.StreamResponse:
        created = time.perf_counter()
        self.generate_requests += 1
        body = await request.json()
        ids = list(body.get("input_ids") or [ord(c) % 1000 for c in body.get("text", "")])
        sampling = body.get("sampling_params") or {}
        max_new = int(sampling.get("max_new_tokens", 8))
        name = body.get("lora_path")
        lora_id = None
        registry = self.lora_registry
        released = False

        async def release_once() -> None:
            nonlocal released
            if lora_id is not None and not released:
                released = True
                await registry.release(lora_id)

        await self.paused.wait()  # like SGLang: new requests wait out a pause before resolving LoRA
        gen = self.abort_gen
        rid = body.get("rid")
        if isinstance(rid, str):
            self.running_rids.add(rid)
        try:
            if name:
                try:
                    lora_id = await self._resolve(name)
                    registry = self.lora_registry  # the life that counted this request (a restart makes a new one)
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
            logprobs: list[float] = []
            # "stream": SGLang's server-sent events, one "data: {...}" per token, then "data: [DONE]"
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"}) if body.get("stream") else None

            async def ended(out: dict[str, Any], status: int = 200) -> web.StreamResponse:
                if stream is None:
                    return web.json_response(out, status=status)
                await stream.write(_event(out) + b"data: [DONE]\n\n")
                await stream.write_eof()
                return stream

            if stream is not None:
                await stream.prepare(request)
            if self.first_use_stop and lora_id is not None and lora_id not in self._slot_filled:
                self._slot_filled.add(lora_id)
                await self._stop_steps(self.first_use_stop)
            for _ in range(max_new):
                if rid in self.aborted_rids:  # /abort_request: what it made so far, finish_reason abort
                    await release_once()
                    return await ended({
                        "text": " ".join(map(str, seq[len(ids):])),
                        "output_ids": seq[len(ids):],
                        "meta_info": {
                            "id": rid, "prompt_tokens": len(ids), "completion_tokens": len(seq) - len(ids),
                            "cached_tokens": cached, "lora_id": lora_id, "output_token_logprobs": logprobs,
                            "finish_reason": {"type": "abort", "message": "Abort in decode"},
                            **self._stamped(name, lora_id),
                        },
                    })
                if gen != self.abort_gen:
                    await release_once()
                    return await ended({"error": {"message": "Request aborted by pause_generation"}}, status=503)
                await self.paused.wait()
                await self.not_loading.wait()
                await asyncio.sleep(self.decode_delay)
                if lora_id is not None and lora_id not in self.loaded:
                    raise RuntimeError("adapter unloaded under a running request")  # must never happen
                tok = next_token(signature, seq)
                logprobs.append(token_logprob(signature, seq, tok))
                seq.append(tok)
                if stream is not None and len(seq) - len(ids) < max_new:  # the last token comes with the whole answer
                    await stream.write(_event({"output_ids": [tok], "meta_info": {
                        "id": rid, "completion_tokens": len(seq) - len(ids)}}))
            prompt_scores = [token_logprob(signature, ids[:i], ids[i]) for i in range(1, len(ids))]
            self.prefix_cache.setdefault(lora_id or "<base>", []).append(tuple(seq))
            self.generations += 1
            out: dict[str, Any] = {  # SGLang's /generate answer (JSON)
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
                    **self._stamped(name, lora_id),
                    "e2e_latency": time.perf_counter() - created,  # SGLang's own: seconds since it arrived
                },
            }
            if body.get("return_logprob") and lora_id in self.numeric:
                # SGLang's shape from logprob_start_len 0: (logprob, token_id, None), the first token has none
                scores = [None, *numeric.model_logprobs(self.numeric[lora_id], ids)]
                out["meta_info"]["input_token_logprobs"] = [(lp, t, None) for lp, t in zip(scores, ids)]
            await release_once()
            return await ended(out)
        finally:
            if isinstance(rid, str):
                self.running_rids.discard(rid)
                self.aborted_rids.discard(rid)
            # client disconnect / abort / crash: exactly once, whatever the path
            await asyncio.shield(release_once())

    # -- lorapub's engine-side staging routes (those lorapub's SGLang patch adds; the staging: engine.py) --
    def _add_staging_routes(self, r: web.UrlDispatcher) -> None:
        async def json_of(request: web.Request) -> Any:
            try:
                return await request.json()
            except ValueError:
                return None

        def answer(status_body: tuple[int, dict[str, Any]]) -> web.Response:
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


def _event(obj: dict[str, Any]) -> bytes:
    """One server-sent event of a streamed /generate, as SGLang frames it."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
