"""A minimal harness of the Relax interfaces that lorapub's Relax hooks go into.

Read in the public repository redai-infra/Relax:

* ``relax/agentic/session/service.py`` @ f522784eb4d7add03b54c0677df3a363dc632b08 —
  ``_SessionRecord``, ``AgenticSessionShard``: ``_register_session``, ``chat``,
  ``_build_ir_locked``, ``_enqueue_ir_locked``, ``_maybe_start_next_ir_locked``, ``_run_ir``,
  ``_complete_waiter_locked``, ``_release_ir_locked``, ``gate_rollout_irs_for_partial_resume``,
  ``release_partial_resume_gate``, ``_discard_session_locked``, ``_finish_discarded_session``,
  ``_abort_backend_request_ids``, ``finalize_and_discard``, ``discard_session``.
* ``relax/agentic/pipeline/runtime.py`` @ 8b2f96e41777430cfa1b90be4694511d5dc37685 —
  ``SGLangBackendAdapter.generate`` and ``BackendGenerateResult``.
* ``relax/backends/megatron/weight_update/lora_adapter_sync.py`` @
  2789adf6483bfa2cf03b2f87bfc18e8b358f16f1 — ``LoraAdapterSync``: ``config_dict``,
  ``should_skip``, ``export_local_adapter``, ``gather_full_adapter``, ``prev_state``,
  ``base_sync_done``, ``adapter_loaded``.
* ``relax/distributed/checkpoint_service/backends/device_direct.py`` @ 2789adf… —
  ``DeviceDirectBackend.update_weights_for_rollout`` (pause, flush, base sync, adapter push,
  continue) and ``_push_lora_adapter_distributed(first_sync=...)`` (delta-skip, export,
  gather, then write + unload + load of the fixed name ``relax_policy_lora``).

Class and method names, their arguments and their call order follow those files; the
bodies are small re-implementations for one process and one rank (no Ray, no Megatron,
no collectives, no chat templates: an agent sends token ids). Lines marked
``# lorapub hook`` are the sites ``docs/relax.md`` describes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import urllib.request
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from lorapub import CapacityError, LorapubError
from lorapub.integrations.relax import error_result

LORA_ADAPTER_NAME = "relax_policy_lora"  # relax/utils/megatron_peft_utils.py
_GATE_PARTIAL_RESUME = "partial_resume"


# --------------------------------------------------------------------------------------------
# relax/agentic/pipeline/runtime.py
# --------------------------------------------------------------------------------------------


@dataclass
class BackendGenerateResult:
    new_tokens: list[int]
    new_log_probs: list[float]
    finish_type: str
    meta_info: dict[str, Any]
    elapsed: float


class BackendHTTPError(RuntimeError):
    """What ``relax.utils.http_utils.post`` raises on a non-200 answer (an httpx status error)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text}")
        self.status = status


class SGLangBackendAdapter:
    """Relax sends to its SGLang router; here the router is consistent hashing over the workers."""

    def __init__(self, args: Any, *, worker_urls: list[str], lora_publication: Any) -> None:
        self._args = args
        self._worker_urls = list(worker_urls)
        self._lora_publication = lora_publication
        self._http: aiohttp.ClientSession | None = None

    async def _post(self, payload: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        url = self._worker_urls[zlib.crc32((session_id or "").encode()) % len(self._worker_urls)]
        if self._http is None:
            self._http = aiohttp.ClientSession()
        async with self._http.post(f"{url}/generate", json=payload) as response:
            if response.status != 200:
                raise BackendHTTPError(response.status, await response.text())
            return await response.json()

    async def generate(
        self,
        *,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        session_id: str | None,
        request_id: str | None = None,
        return_logprob: bool = True,
        lora: Any = None,  # lorapub hook: the record's RelaxLoraSession
    ) -> BackendGenerateResult:
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": bool(return_logprob),
        }
        if request_id:
            payload["request_id"] = request_id
        started = time.time()
        if self._lora_publication.enabled:  # lorapub hook: the bound version, sent once
            output = await self._lora_publication.generate(lora, payload)
        else:  # the old path, unchanged: the one fixed adapter name (sglang_rollout's rule)
            payload["lora_path"] = LORA_ADAPTER_NAME
            output = await self._post(payload, session_id)
        meta_info = dict(output.get("meta_info", {}))
        logprobs = [item[0] if isinstance(item, (list, tuple)) else item
                    for item in meta_info.get("output_token_logprobs") or []]
        return BackendGenerateResult(
            new_tokens=list(output["output_ids"]),
            new_log_probs=[float(x) for x in logprobs],
            finish_type=str(meta_info.get("finish_reason", {}).get("type", "stop")),
            meta_info=meta_info,
            elapsed=time.time() - started,
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


# --------------------------------------------------------------------------------------------
# relax/agentic/session/service.py
# --------------------------------------------------------------------------------------------


@dataclass
class InflightRequest:
    request_id: str
    rollout_id: int
    input_ids: list[int]
    sampling_params: dict[str, Any]
    backend_started: bool = False
    runner_epoch: int = 0
    pending_status: str | None = None


@dataclass
class _SessionRecord:
    rollout_id: int = -1
    scope_id: str | None = None
    next_ir_sequence: int = 0
    session_sampling_params: dict[str, Any] = field(default_factory=dict)
    irs_by_id: dict[str, InflightRequest] = field(default_factory=dict)
    ir_queue: deque[str] = field(default_factory=deque)
    active_ir_runner_tasks: dict[str, asyncio.Task[Any]] = field(default_factory=dict)
    pending_chat_waiters: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    gate_reason: str | None = None
    lora: Any = None  # lorapub hook: RelaxLoraSession while versioned publication is on


def _openai_error_result(message: str, *, code: str, status_code: int, error_type: str) -> dict[str, Any]:
    return {"_http_status": status_code, "error": {"message": message, "type": error_type, "param": None, "code": code}}


class AgenticSessionShard:
    def __init__(self, args: Any, *, backend: SGLangBackendAdapter, lora_publication: Any,
                 worker_urls: Callable[[], list[str]], abort_delay: float = 0.0) -> None:
        self.args = args
        self.backend = backend
        self.lora_publication = lora_publication  # lorapub hook: one RelaxLoraPublication per shard
        self._session_records: dict[str, _SessionRecord] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._worker_urls = worker_urls
        self.abort_delay = abort_delay
        self.aborted_request_ids: list[str] = []

    def _ensure_session_lock(self, session_id: str) -> asyncio.Lock:
        return self._session_locks.setdefault(session_id, asyncio.Lock())

    def _get_session_lock(self, session_id: str) -> asyncio.Lock | None:
        return self._session_locks.get(session_id)

    async def _register_session(self, *, session_id: str, scope_id: str, rollout_id: int,
                                gate_reason: str | None = None) -> bool:
        async with self._ensure_session_lock(session_id):
            record = self._session_records.get(session_id)
            if record is None:
                record = _SessionRecord(rollout_id=rollout_id, scope_id=scope_id, gate_reason=gate_reason,
                                        session_sampling_params={"max_new_tokens": 4})
                record.lora = await self.lora_publication.open_session(session_id)  # lorapub hook
                self._session_records[session_id] = record
            else:
                record.rollout_id = rollout_id
        return True

    def _build_ir_locked(self, *, record: _SessionRecord, session_id: str, input_ids: list[int],
                         sampling_params: dict[str, Any]) -> InflightRequest:
        request_id = f"req_{session_id}_{record.next_ir_sequence}"
        record.next_ir_sequence += 1
        ir = InflightRequest(request_id, record.rollout_id, list(input_ids), copy.deepcopy(sampling_params))
        record.irs_by_id[request_id] = ir
        return ir

    def _enqueue_ir_locked(self, record: _SessionRecord, ir: InflightRequest) -> None:
        ir.backend_started = False
        record.ir_queue.append(ir.request_id)

    def _maybe_start_next_ir_locked(self, *, session_id: str, record: _SessionRecord) -> bool:
        if record.gate_reason is not None:  # _decide_ir_release: a gated session starts nothing
            return False
        started = False
        while record.ir_queue:
            ir = record.irs_by_id.get(record.ir_queue.popleft())
            if ir is None:
                continue
            ir.rollout_id = record.rollout_id
            ir.runner_epoch += 1
            record.active_ir_runner_tasks[ir.request_id] = asyncio.create_task(
                self._run_ir(session_id=session_id, ir_id=ir.request_id, runner_epoch=ir.runner_epoch)
            )
            started = True
        return started

    def _complete_waiter_locked(self, record: _SessionRecord, ir_id: str, *, result: Any = None,
                                exc: Exception | None = None) -> None:
        waiter = record.pending_chat_waiters.pop(ir_id, None)
        if waiter is None or waiter.done():
            return
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(result)

    def _release_ir_locked(self, record: _SessionRecord, ir_id: str) -> None:
        while ir_id in record.ir_queue:
            record.ir_queue.remove(ir_id)
        record.irs_by_id.pop(ir_id, None)
        record.active_ir_runner_tasks.pop(ir_id, None)

    async def _run_ir(self, *, session_id: str, ir_id: str, runner_epoch: int) -> None:
        lock = self._get_session_lock(session_id)
        if lock is None:
            return
        async with lock:
            record = self._session_records.get(session_id)
            if record is None:
                return
            ir = record.irs_by_id.get(ir_id)
            if ir is None or ir_id not in record.active_ir_runner_tasks or ir.runner_epoch != runner_epoch:
                return
            if record.gate_reason is not None:  # _should_requeue_active_ir_locked -> park behind the gate
                record.active_ir_runner_tasks.pop(ir_id, None)
                self._enqueue_ir_locked(record, ir)
                return
            ir.backend_started = True
        try:
            result = await self.backend.generate(
                input_ids=ir.input_ids,
                sampling_params=ir.sampling_params,
                session_id=session_id,
                request_id=ir.request_id,
                return_logprob=record.scope_id == "train",
                lora=record.lora,  # lorapub hook: the record's binding, for every request of it
            )
        except Exception as exc:
            async with lock:
                current = self._session_records.get(session_id)
                if current is None:
                    return
                self._complete_waiter_locked(current, ir_id, exc=exc)
                self._release_ir_locked(current, ir_id)
            return
        async with lock:
            current = self._session_records.get(session_id)
            if current is None or ir_id not in current.active_ir_runner_tasks:
                return
            self._complete_waiter_locked(current, ir_id, result={
                "request_id": ir_id,
                "output_ids": result.new_tokens,
                "finish_reason": result.finish_type,
                "lora_id": result.meta_info.get("lora_id"),
            })
            self._release_ir_locked(current, ir_id)
            self._maybe_start_next_ir_locked(session_id=session_id, record=current)

    async def chat(self, *, session_id: str, input_ids: list[int], max_completion_tokens: int | None = None) -> dict:
        try:
            lock = self._get_session_lock(session_id)
            if lock is None:
                raise KeyError(session_id)
            async with lock:
                record = self._session_records.get(session_id)
                if record is None:
                    raise KeyError(session_id)
                sampling_params = copy.deepcopy(record.session_sampling_params)
                if max_completion_tokens is not None:
                    sampling_params["max_new_tokens"] = int(max_completion_tokens)
                ir = self._build_ir_locked(record=record, session_id=session_id, input_ids=input_ids,
                                           sampling_params=sampling_params)
                waiter = asyncio.get_running_loop().create_future()
                record.pending_chat_waiters[ir.request_id] = waiter
                self._enqueue_ir_locked(record, ir)
                self._maybe_start_next_ir_locked(session_id=session_id, record=record)
        except KeyError:
            return _openai_error_result(f"Unknown or discarded agentic session {session_id!r}.",
                                        code="session_discarded", status_code=404, error_type="not_found_error")
        try:
            return await waiter
        except LorapubError as exc:  # lorapub hook: typed, code kept, never a fallback
            return error_result(exc)
        except Exception:
            return _openai_error_result("Internal error while handling agentic chat request.",
                                        code="internal_error", status_code=500, error_type="internal_error")

    async def gate_rollout_irs_for_partial_resume(self, *, rollout_id: int) -> int:
        gated = 0
        for session_id in list(self._session_records):
            async with self._session_locks[session_id]:
                record = self._session_records.get(session_id)
                if record is None or record.rollout_id != rollout_id:
                    continue
                record.gate_reason = _GATE_PARTIAL_RESUME
                gated += 1
        return gated

    async def release_partial_resume_gate(self, *, rollout_id: int) -> int:
        opened = 0
        for session_id in list(self._session_records):
            async with self._session_locks[session_id]:
                record = self._session_records.get(session_id)
                if record is None:
                    continue
                record.rollout_id = rollout_id
                if record.gate_reason == _GATE_PARTIAL_RESUME:
                    record.gate_reason = None
                    if self._maybe_start_next_ir_locked(session_id=session_id, record=record):
                        opened += 1
        return opened

    async def _abort_backend_request_ids(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        if not self._worker_urls():
            raise RuntimeError("Cannot abort discarded agentic session requests because no SGLang worker urls "
                               "are available.")
        await asyncio.sleep(self.abort_delay)  # the POST /abort_request fan-out
        self.aborted_request_ids.extend(request_ids)

    def _discard_session_locked(self, *, session_id: str):
        removed = self._session_records.pop(session_id, None)
        active_tasks: list[asyncio.Task[Any]] = []
        waiters: list[asyncio.Future[Any]] = []
        backend_request_ids: list[str] = []
        if removed is not None:
            self.lora_publication.begin_release(removed.lora)  # lorapub hook: close starts with the removal
            active_tasks = list(removed.active_ir_runner_tasks.values())
            waiters = list(removed.pending_chat_waiters.values())
            backend_request_ids = [ir.request_id for ir in removed.irs_by_id.values() if ir.backend_started]
            removed.irs_by_id.clear()  # _clear_removed_record_state (it leaves record.lora alone)
            removed.ir_queue.clear()
            removed.active_ir_runner_tasks.clear()
            removed.pending_chat_waiters.clear()
        return removed, active_tasks, waiters, backend_request_ids

    async def _finish_discarded_session(self, *, session_id: str, lock: asyncio.Lock, removed: Any,
                                        active_tasks: list, backend_request_ids: list[str], waiters: list) -> bool:
        try:
            for task in active_tasks:
                if not task.done():
                    task.cancel()
            await self._abort_backend_request_ids(backend_request_ids)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(_openai_error_result(
                        f"Agentic session {session_id!r} was discarded.", code="session_discarded",
                        status_code=404, error_type="not_found_error"))
            async with lock:
                if self._session_locks.get(session_id) is lock and session_id not in self._session_records:
                    self._session_locks.pop(session_id, None)
            return removed is not None
        finally:
            if removed is not None:
                await self.lora_publication.release(removed.lora)  # lorapub hook: exactly once

    async def finalize_and_discard(self, *, session_id: str) -> dict[str, Any]:
        lock = self._get_session_lock(session_id)
        if lock is None:
            return {"status": "discarded", "metadata": {"discard_reason": "already_discarded"}}
        async with lock:
            if session_id not in self._session_records:
                return {"status": "discarded", "metadata": {"discard_reason": "already_discarded"}}
            removed, active_tasks, waiters, ids = self._discard_session_locked(session_id=session_id)
        await self._finish_discarded_session(session_id=session_id, lock=lock, removed=removed,
                                             active_tasks=active_tasks, backend_request_ids=ids, waiters=waiters)
        return {"status": "completed"}

    async def discard_session(self, *, session_id: str) -> bool:
        lock = self._get_session_lock(session_id)
        if lock is None:
            return False
        async with lock:
            removed, active_tasks, waiters, ids = self._discard_session_locked(session_id=session_id)
        return await self._finish_discarded_session(session_id=session_id, lock=lock, removed=removed,
                                                    active_tasks=active_tasks, backend_request_ids=ids,
                                                    waiters=waiters)


# --------------------------------------------------------------------------------------------
# relax/backends/megatron/weight_update/lora_adapter_sync.py
# --------------------------------------------------------------------------------------------


class LoraAdapterSync:
    """``model`` stands for the Megatron model: a callable giving the current adapter tensors."""

    def __init__(self, args: Any, model: Callable[[], dict[str, Any]]) -> None:
        self.args = args
        self.model = model
        self.prev_state: dict[str, Any] | None = None
        self.base_sync_done = False
        self.adapter_loaded = False

    def config_dict(self) -> dict:
        return {
            "r": self.args.lora_rank, "lora_alpha": self.args.lora_alpha,
            "target_modules": list(self.args.lora_target_modules), "lora_dropout": self.args.lora_dropout,
            "bias": "none", "peft_type": "LORA", "task_type": "CAUSAL_LM",
        }

    def export_local_adapter(self, all_params: dict[str, Any]) -> dict[str, Any]:
        return {name: tensor.copy() for name, tensor in all_params.items()}

    def should_skip(self, all_params: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        new_state = {name: tensor.copy() for name, tensor in all_params.items()}
        if self.prev_state is None or set(self.prev_state) != set(new_state):
            return False, new_state
        unchanged = all((abs(new_state[n] - self.prev_state[n]) <= 1e-6).all() for n in new_state)
        return bool(unchanged), new_state

    def gather_full_adapter(self, local_adapter: dict, *, all_gather: bool) -> dict | None:
        return dict(local_adapter)  # one pipeline rank: the local export is the full adapter


# --------------------------------------------------------------------------------------------
# relax/distributed/checkpoint_service/backends/device_direct.py
# --------------------------------------------------------------------------------------------


class DeviceDirectBackend:
    """Synchronous, like Relax's (tests call it through ``asyncio.to_thread``)."""

    def __init__(self, args: Any, model: Callable[[], dict[str, Any]], *, rollout_urls: list[str],
                 lora_publication: Any) -> None:
        self.args = args
        self.weight_version = 0
        self.rollout_urls = list(rollout_urls)
        self._lora_adapter_mode = bool(args.lora_adapter_mode)
        self._lora_sync = LoraAdapterSync(args, model) if self._lora_adapter_mode else None
        self._lora_skip_rollout_base = False
        self._lora_publication = lora_publication  # lorapub hook: BlockingRelaxLoraPublication on rank 0
        self.reports: list[Any] = []
        self.deferred: list[LorapubError] = []

    def _batch_request(self, endpoint: str, payload: dict | None = None) -> list[Any]:
        replies = []
        for url in self.rollout_urls:  # RolloutEngine.make_request: a synchronous POST per engine
            request = urllib.request.Request(f"{url}{endpoint}", data=json.dumps(payload or {}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                raw = response.read()
                try:
                    replies.append(json.loads(raw or b"null"))
                except ValueError:  # SGLang's /flush_cache answers plain text
                    replies.append(raw.decode(errors="replace"))
        return replies

    def update_weights_for_rollout(self, rollout_only: bool = False, actor_fwd_only: bool = False) -> None:
        self.weight_version += 1
        self._lora_skip_rollout_base = self._lora_adapter_mode and self._lora_sync.base_sync_done
        versioned = self._lora_publication.enabled  # lorapub hook
        pause = not actor_fwd_only and not (versioned and self._lora_skip_rollout_base)  # lorapub hook
        if pause:
            self._batch_request("/pause_generation")
            self._batch_request("/flush_cache")
        # (base weights: broadcast over NCCL on the first sync only; the engines here hold a fixed base)
        if self._lora_adapter_mode and not actor_fwd_only and not versioned:
            self._push_lora_adapter_distributed(first_sync=not self._lora_sync.adapter_loaded)
            self._lora_sync.adapter_loaded = True
            self._lora_sync.base_sync_done = True
        if pause:
            self._batch_request("/continue_generation")
        if self._lora_adapter_mode and not actor_fwd_only and versioned:  # lorapub hook: outside any pause
            self._push_lora_adapter_distributed(first_sync=not self._lora_sync.adapter_loaded)
            self._lora_sync.adapter_loaded = True
            self._lora_sync.base_sync_done = True

    def _push_lora_adapter_distributed(self, *, first_sync: bool) -> None:
        all_params = self._lora_sync.model()
        unchanged, new_state = self._lora_sync.should_skip(all_params)
        if not first_sync and unchanged:
            self._lora_sync.prev_state = new_state
            return
        local_adapter = self._lora_sync.export_local_adapter(all_params)
        merged = self._lora_sync.gather_full_adapter(local_adapter, all_gather=False)
        # rank 0 (the only rank here). lorapub hook: replaces write_adapter_dir + /unload + /load
        try:
            report = self._lora_publication.publish(merged, self._lora_sync.config_dict(),
                                                    weight_version=self.weight_version)
        except CapacityError as exc:
            # Both version slots are held by versions sessions still use. Sessions keep their
            # versions; prev_state stays as it was, so the next update publishes this adapter.
            self.deferred.append(exc)
            return
        self.reports.append(report)
        self._lora_sync.prev_state = new_state
