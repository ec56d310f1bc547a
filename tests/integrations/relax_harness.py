"""Stand-ins for the Relax code lorapub's hooks go into, as it is today.

Modelled on the Relax files and commits of ``relax_surface.py`` (whose table ``test_relax.py`` checks
every stand-in's signature against): ``AgenticSessionShard`` and its records, groups and in-flight
requests (``relax/agentic/session/service.py``, ``state.py``), ``SGLangBackendAdapter`` and
``BackendGenerateResult`` (``relax/agentic/pipeline/runtime.py``), ``LoraAdapterSync``
(``relax/backends/megatron/weight_update/lora_adapter_sync.py``) and ``DeviceDirectBackend``
(``relax/distributed/checkpoint_service/backends/device_direct.py``).

Names, signatures, the order of the steps and the lock discipline follow those files; the bodies are
small re-implementations for one process and one rank. What is left out: Ray (a shard is a plain
object), agent processes (a test calls ``chat`` as the agent would, and ``finish_agent`` when the
agent exits), chat templates and the session forest (a message's ``content`` is a list of token ids,
and a session keeps one flat history), admission tickets (a no-op), the fleet permit (a local semaphore of
``sglang_request_capacity``), the SGLang
router (requests go to ``args.worker_urls``, chosen by a hash of the session id; ``_worker_urls``
lists them) and NCCL (Relax's adapter push over ``/update_lora_from_distributed`` is modelled by an
unload and a load of the fixed name, which the SGLang double serves).

How a group ends follows the pinned ``service.py`` and ``runtime.py``: ``RuntimeDomain.collect_group``
(the driver) calls the shard's ``release_group`` once every member's result is in, and that pops the
group itself (it does not go through ``_drop_group``); a ``None`` result (a controlled agent failure) or
an exception ends the group through ``drop_group`` instead. ``RuntimeDomain`` and ``agentic_kv_metrics``
have no row in ``relax_surface.py`` (their lines were not recorded).

Lines marked ``# lorapub hook`` are the sites of ``docs/relax.md``; ``INJECT`` carries what a test
gives the hooks (a shared registry, short deadlines), where Relax passes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import enum
import json
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import aiohttp

from lorapub import Snapshot
from lorapub.integrations import relax as relax_lorapub

LORA_ADAPTER_NAME = "relax_policy_lora"  # relax/utils/megatron_peft_utils.py

#: What tests hand the hooks: ``INJECT["shard"]`` goes to ``RelaxLorapub``, ``INJECT["trainer"]`` to
#: ``install_weight_path``. Relax passes neither (the settings come from ``args``).
INJECT: dict[str, dict[str, Any]] = {"shard": {}, "trainer": {}}


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


class BackendContextLengthExceededError(RuntimeError):
    """The generation backend rejected a request whose context is too long."""


class BackendHTTPError(RuntimeError):
    """What Relax's ``post`` raises on a non-200 answer (an ``httpx.HTTPStatusError``)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text}")
        self.status = status
        self.text = text


async def finish_before_cancellation(work, task_name):
    """Finish owned cleanup before forwarding caller cancellation."""
    task = asyncio.ensure_future(work)
    task.set_name(task_name)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                task.result()
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class SGLangBackendAdapter:
    """Shard-owned SGLang HTTP capability (no compiler: token ids in, token ids out)."""

    def __init__(self, args):
        self._args = args
        self._session_lifecycle = bool(getattr(args, "agentic_session_lifecycle", False))
        self.tokenizer = None
        self._http: aiohttp.ClientSession | None = None
        self.shut_down = False
        self.generate_calls = 0

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def _post(self, url: str, payload: dict[str, Any]) -> Any:
        async with self._client().post(url, json=payload) as response:
            text = await response.text()
            if response.status != 200:
                raise BackendHTTPError(response.status, text)
            return json.loads(text) if text else None

    async def generate(
        self,
        *,
        input_ids,
        sampling_params,
        session_id,
        request_id,
        image_data=None,
        audio_data=None,
        video_data=None,
        return_logprob=True,
    ):
        self.generate_calls += 1
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": request_id,
                   "return_logprob": return_logprob}
        if image_data:
            payload["image_data"] = image_data
        if session_id and self._session_lifecycle:
            payload["session_id"] = session_id
        urls = await self._worker_urls()
        url = urls[zlib.crc32((session_id or "").encode()) % len(urls)]  # the router's consistent hashing
        started = time.monotonic()
        try:
            output = await self._post(f"{url}/generate", payload)
        except BackendHTTPError as error:
            if error.status == 400 and ("maximum context length" in error.text
                                        or "Requested token count exceeds" in error.text):
                raise BackendContextLengthExceededError(error.text) from error
            raise
        meta_info = dict(output["meta_info"])
        items = list(meta_info.get("output_token_logprobs") or ())
        return BackendGenerateResult(
            new_tokens=list(output["output_ids"]),
            new_log_probs=[float(x[0] if isinstance(x, (list, tuple)) else x) for x in items],
            finish_type=str(meta_info["finish_reason"]["type"]),
            meta_info=meta_info,
            elapsed=time.monotonic() - started,
        )

    async def abort_request(self, request_id):
        urls = await self._worker_urls()
        await asyncio.gather(*(self._post(f"{url}/abort_request", {"rid": request_id}) for url in urls))

    async def close_session(self, session_id, *, timeout_s):
        return True  # agentic_session_lifecycle off

    async def _worker_urls(self):
        return list(self._args.worker_urls)  # the router's /workers

    async def shutdown(self):
        self.shut_down = True
        if self._http is not None:
            await self._http.close()


class RuntimeDomain:
    """The driver side of a group's end (``RuntimeDomain.collect_group`` and ``drop_group``): every
    member's result arrives; a ``None`` result (a controlled drop: an agent that exited on failure) ends the
    group through ``drop_group``; otherwise the shard's ``release_group`` ends it. An exception drops it too."""

    def __init__(self, shard) -> None:
        self.shard = shard

    async def collect_group(self, group_id, session_ids):
        try:
            group = self.shard._groups[group_id]
            while True:  # each result as it completes (the shard's state-change stream, reduced to polling)
                done = [sid for sid in session_ids if group.result_cells[sid].terminal]
                if any(outcome is None for outcome in await self.shard.take_session_results(group_id, tuple(done))):
                    await self.drop_group(group_id)  # "Dropped 1 group": a controlled drop ends it early
                    return None
                if len(done) == len(session_ids):
                    break
                await asyncio.sleep(0.001)
            outcomes = await self.shard.take_session_results(group_id, tuple(session_ids))
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            await self.shard.release_group(group_id)
            return outcomes
        except BaseException:
            await finish_before_cancellation(self.drop_group(group_id), f"wait-group-cleanup:{group_id}")
            raise

    async def drop_group(self, group_id):
        await self.shard.drop_group(group_id)


# --------------------------------------------------------------------------------------------
# relax/agentic/session/service.py (and state.py)
# --------------------------------------------------------------------------------------------


class AgenticChatRequestError(Exception):
    """Relax's is a FastAPI ``HTTPException``; same constructor and attributes."""

    def __init__(
        self,
        message,
        *,
        code="invalid_request_error",
        param=None,
        status_code=400,
        error_type="invalid_request_error",
    ):
        super().__init__(message)
        self.status_code = status_code
        self.detail = message
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type


class RuntimeGroupError(RuntimeError):
    """Drops the whole group."""


def _backend_request_id(ir):
    return f"{ir.request_id}:{ir.abort_count}"


def _session_discarded_error(session_id: str) -> AgenticChatRequestError:
    return AgenticChatRequestError(f"Agentic session {session_id!r} was discarded.", code="session_discarded",
                                   status_code=404, error_type="not_found_error")


def _error_result(message: str, *, code: str, param: Optional[str], status_code: int, error_type: str) -> dict:
    return {"_http_status": status_code, "error": {"message": message, "type": error_type, "param": param, "code": code}}


def _internal_error_result(message: str) -> dict:
    return _error_result(message, code="internal_error", param=None, status_code=500, error_type="internal_error")


def _error_from_exception(error):
    return _error_result(error.message, code=error.code, param=error.param, status_code=error.status_code,
                         error_type=error.error_type)


class SessionPhase(enum.Enum):
    ACTIVE = "active"
    FINALIZING = "finalizing"


class GroupOwnership(enum.Enum):
    PREPARE = "prepare"
    RUNTIME = "runtime"


class RequestKind(str, enum.Enum):
    FRESH = "fresh"
    RESUMED = "resumed"
    PROTECTED = "protected"


@dataclass
class SessionSpec:
    metadata: dict[str, Any]
    input_payload: Any
    sampling_params: Optional[dict[str, Any]]
    session_id: str
    group_index: Optional[int] = None
    index: Optional[int] = None
    label: Optional[str] = None
    train_metadata: Optional[dict[str, Any]] = None


@dataclass
class SessionInput:
    session_id: str
    group_id: str
    rollout_mode: str
    input_payload: Any


class _SessionResultCell:
    def __init__(self) -> None:
        self._published = False
        self._result: Any = None

    @property
    def terminal(self) -> bool:
        return self._published

    def publish(self, result: Any) -> None:
        assert not self._published
        self._published, self._result = True, result

    def take(self) -> Any:
        return self._result


@dataclass
class _Forest:
    """Stands in for ``SessionForest``: one flat token history and the leaf's export metadata."""

    history: list[int] = field(default_factory=list)
    leaf_patch: dict[str, Any] = field(default_factory=dict)
    responses: int = 0


@dataclass(eq=False)
class InflightRequest:
    request_id: str
    rollout_id: int
    kind: RequestKind
    abort_count: int
    waiter: asyncio.Future = field(repr=False)
    wall_started_at: float
    runner_task: Optional[asyncio.Task] = field(default=None, repr=False)
    backend_started: bool = False
    sampling_params: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    history_rollout_token_prefix: list[int] = field(default_factory=list)
    history_backend_image_data: list[str] = field(default_factory=list)
    history_backend_audio_data: list[str] = field(default_factory=list)
    history_backend_video_data: list[str] = field(default_factory=list)
    pending_token_delta: list[int] = field(default_factory=list)
    pending_logprob_delta: list[float] = field(default_factory=list)
    pending_generation_elapsed_s: float = 0.0
    pending_status: Optional[str] = None
    pending_export_metadata_patch: dict[str, Any] = field(default_factory=dict)
    latest_backend_meta: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class ResidentGroup:
    rollout_mode: str
    group_id: str
    result_cells: dict[str, _SessionResultCell]
    sessions: list["_SessionRecord"]
    ownership: GroupOwnership = GroupOwnership.PREPARE
    drop_task: Optional[asyncio.Task] = None
    error: Optional[RuntimeGroupError] = None
    is_dropped: bool = False

    @property
    def first_request_barrier_crossed(self) -> bool:
        return (
            self.ownership is GroupOwnership.PREPARE and self.error is None and not self.is_dropped
            and all(s.phase is SessionPhase.ACTIVE and bool(s.live_irs) for s in self.sessions)
        )

    @property
    def terminal(self) -> bool:
        return all(cell.terminal for cell in self.result_cells.values())

    @property
    def dropped(self) -> bool:
        return self.is_dropped


@dataclass(eq=False)
class _SessionRecord:
    group: ResidentGroup
    session_id: str
    session_sampling_params: dict[str, Any]
    result_cell: _SessionResultCell
    rollout_id: int = 0
    next_ir_sequence: int = 0
    forest: Optional[_Forest] = None
    phase: SessionPhase = SessionPhase.ACTIVE
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    live_irs: set = field(default_factory=set)
    queued_irs: collections.deque = field(default_factory=collections.deque)
    resources: Any = None
    finish_task: Optional[asyncio.Task] = None
    protection_pending_until_resume: bool = False
    protected_until_finalize: bool = False


class AgenticSessionShard:
    def __init__(self, args, sglang_request_capacity, sglang_request_limiter, admission_coordinator):
        self.args = args
        self._groups: dict[str, ResidentGroup] = {}
        self._session_records: dict[str, _SessionRecord] = {}
        self._train_generation_open = False
        self._state_revision = 0
        self._permit_cleanup_tasks: set[asyncio.Task] = set()
        # shard 0 owns the fleet-global SGLang request permit (sglang_request_capacity), others borrow it
        self._sglang_request_semaphore = (
            asyncio.Semaphore(sglang_request_capacity) if sglang_request_capacity is not None else None
        )
        self._generation_backend = SGLangBackendAdapter(args)
        self._lorapub = relax_lorapub.RelaxLorapub(args, **INJECT["shard"])  # lorapub hook
        self._generation_backend = self._lorapub.wrap_backend(  # lorapub hook
            self._generation_backend,
            chat_error_type=AgenticChatRequestError,
            context_length_error_type=BackendContextLengthExceededError,
            result_type=BackendGenerateResult,
        )

    def _notify_state_change(self, group: Optional[ResidentGroup] = None) -> None:
        self._state_revision += 1

    @staticmethod
    def _raise_group_error(group: ResidentGroup) -> None:
        if group.error is not None:
            raise group.error

    # -- groups -----------------------------------------------------------------------------------
    async def start_group(self, rollout_mode, group_id, session_specs):
        if group_id in self._groups:
            raise RuntimeGroupError(f"group token is already resident: {group_id}")
        result_cells = {spec.session_id: _SessionResultCell() for spec in session_specs}
        group = ResidentGroup(rollout_mode=rollout_mode, group_id=group_id, result_cells=result_cells, sessions=[])
        for spec in session_specs:
            sampling_params = {"max_new_tokens": 4, **(spec.sampling_params or {})}
            group.sessions.append(_SessionRecord(group=group, session_id=spec.session_id,
                                                 session_sampling_params=sampling_params,
                                                 result_cell=result_cells[spec.session_id], forest=_Forest()))
        self._groups[group_id] = group
        self._session_records.update((session.session_id, session) for session in group.sessions)
        try:
            await self._lorapub.open_group(group_id, tuple(s.session_id for s in group.sessions))  # lorapub hook
            for session, spec in zip(group.sessions, session_specs, strict=True):
                self._start_session(session, SessionInput(session.session_id, group_id, rollout_mode,
                                                          spec.input_payload))
        except BaseException:
            await self.drop_group(group_id)
            raise

    async def lease_group(self, group_id, rollout_id):
        group = self._groups[group_id]
        self._raise_group_error(group)
        if group.dropped:
            raise RuntimeGroupError(f"cannot lease group that failed during Prepare: {group.group_id}")
        if not group.first_request_barrier_crossed:
            raise RuntimeGroupError(f"cannot lease group before every first IR exists: {group.group_id}")
        for session in group.sessions:
            async with session.lock:
                session.rollout_id = rollout_id
        group.ownership = GroupOwnership.RUNTIME
        await self._open_group(group)

    def _group_generation_open(self, group):
        return group.rollout_mode != "train" or self._train_generation_open

    async def _open_group(self, group):
        self._raise_group_error(group)
        if group.ownership is not GroupOwnership.RUNTIME or group.dropped or group.terminal:
            return
        if self._group_generation_open(group):
            for session in tuple(group.sessions):
                if session.result_cell.terminal:
                    continue
                async with session.lock:
                    if not self._group_generation_open(group) or session.phase is not SessionPhase.ACTIVE:
                        continue
                    self._dispatch_queued_irs_locked(session)
        self._notify_state_change(group)

    async def pause_generation(self):
        self._train_generation_open = False
        await self._interrupt_running_requests()
        self._notify_state_change()
        return self._state_revision

    async def _interrupt_running_requests(self):
        runner_tasks: list[asyncio.Task] = []
        backend_request_ids: list[str] = []
        try:
            for group in tuple(self._groups.values()):
                self._raise_group_error(group)
                if (group.rollout_mode != "train" or group.ownership is GroupOwnership.PREPARE or group.dropped
                        or group.terminal):
                    continue
                for session in tuple(group.sessions):
                    if session.result_cell.terminal:
                        continue
                    async with session.lock:
                        if session.phase is not SessionPhase.ACTIVE or session.protected_until_finalize:
                            continue
                        requeued: list[InflightRequest] = []
                        for ir in session.live_irs:
                            runner = ir.runner_task
                            if runner is None:
                                continue
                            if not ir.backend_started:
                                ir.runner_task = None
                                requeued.append(ir)
                                runner.cancel()
                                runner_tasks.append(runner)
                                continue
                            backend_request_ids.append(_backend_request_id(ir))
                            runner_tasks.append(runner)
                        session.queued_irs.extendleft(reversed(requeued))
                self._notify_state_change(group)
        finally:
            outcomes = await asyncio.gather(
                *(self._generation_backend.abort_request(rid) for rid in backend_request_ids), return_exceptions=True)
            await asyncio.gather(*runner_tasks, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def resume_generation(self, rollout_id):
        for group in tuple(self._groups.values()):
            if group.rollout_mode == "train" and group.ownership is GroupOwnership.RUNTIME:
                for session in tuple(group.sessions):
                    async with session.lock:
                        if session.phase is SessionPhase.ACTIVE:
                            session.rollout_id = rollout_id
        runtime_groups = tuple(g for g in self._groups.values()
                               if g.rollout_mode == "train" and g.ownership is GroupOwnership.RUNTIME)
        self._train_generation_open = True
        for group in runtime_groups:
            await self._open_group(group)
        self._notify_state_change()
        return self._state_revision

    async def take_session_results(self, group_id, session_ids):
        group = self._groups[group_id]
        return tuple(group.result_cells[sid].take() for sid in session_ids)

    async def release_group(self, group_id):
        # Relax pops a completed group itself: its release does not go through _drop_group
        group = self._groups[group_id]
        self._raise_group_error(group)
        if not group.terminal:
            raise RuntimeGroupError(f"cannot release unfinished group: {group_id}")
        self._groups.pop(group_id)
        await self._lorapub.release_group(group_id)  # lorapub hook: forget the completed group
        self._notify_state_change()

    async def drop_group(self, group_id):
        group = self._groups.get(group_id)
        if group is None:
            return
        if group.drop_task is None:
            group.drop_task = asyncio.create_task(self._drop_group(group), name=f"drop-group:{group.group_id}")
        await finish_before_cancellation(group.drop_task, f"drop-group:{group.group_id}")

    async def agentic_kv_metrics(self, reset=False):
        lorapub_metrics = self._lorapub.metrics(reset=reset)  # lorapub hook: cut trajectories, whatever the flags
        if not getattr(self.args, "agentic_session_lifecycle", False):
            return lorapub_metrics
        return {"session/lifecycle_enabled": 1.0, **lorapub_metrics}

    # -- chat ---------------------------------------------------------------------------------------
    async def chat(self, *, session_id, messages, tools, chat_template_kwargs, max_completion_tokens, stop, seed,
                   logprobs=False):
        try:
            session = self._session_records.get(session_id)
            if session is None:
                raise _session_discarded_error(session_id)
            return await self._chat(session=session, messages=messages, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs,
                                    max_completion_tokens=max_completion_tokens, stop=stop, seed=seed,
                                    logprobs=logprobs)
        except AgenticChatRequestError as error:
            return _error_from_exception(error)

    async def shutdown(self):
        await finish_before_cancellation(self._shutdown(), "agentic-session-shard-shutdown")

    async def _shutdown(self):
        self._train_generation_open = False
        first_error: Optional[BaseException] = None
        for group in tuple(self._groups.values()):
            try:
                await self.drop_group(group.group_id)
            except BaseException as error:
                if first_error is None:
                    first_error = error
        outcomes = await asyncio.gather(*tuple(self._permit_cleanup_tasks), return_exceptions=True)
        self._permit_cleanup_tasks.clear()
        for outcome in outcomes:
            if first_error is None and isinstance(outcome, BaseException):
                first_error = outcome
        try:
            await self._generation_backend.shutdown()  # lorapub hook: the wrapper closes lorapub first
        except BaseException as error:
            if first_error is None:
                first_error = error
        if first_error is not None:
            raise first_error

    async def _chat(self, *, session, messages, tools, chat_template_kwargs, max_completion_tokens, stop, seed,
                    logprobs):
        wall_started_at = time.monotonic()
        group = session.group
        async with session.lock:
            if session.phase is not SessionPhase.ACTIVE:
                raise _session_discarded_error(session.session_id)
            sampling_params = copy.deepcopy(session.session_sampling_params)
            if max_completion_tokens is not None:
                sampling_params["max_new_tokens"] = int(max_completion_tokens)
            if stop is not None:
                sampling_params["stop"] = stop
            if seed is not None:
                sampling_params["sampling_seed"] = int(seed)
            observation = [int(t) for t in messages[-1]["content"]]  # the template, reduced to token ids
            request_id = f"req_{session.session_id}_{session.next_ir_sequence}"
            session.next_ir_sequence += 1
            waiter = asyncio.get_running_loop().create_future()
            ir = InflightRequest(
                request_id=request_id, rollout_id=session.rollout_id, kind=RequestKind.FRESH, abort_count=0,
                waiter=waiter, wall_started_at=wall_started_at, sampling_params=sampling_params, logprobs=logprobs,
                history_rollout_token_prefix=session.forest.history + observation,
            )
            session.live_irs.add(ir)
            session.queued_irs.append(ir)
            self._dispatch_queued_irs_locked(session)
        self._notify_state_change(group)
        try:
            return await asyncio.shield(ir.waiter)
        except AgenticChatRequestError as error:  # a lorapub refusal lands here, its code kept
            return _error_from_exception(error)
        except Exception:
            return _internal_error_result("Internal error while handling agentic chat request.")

    def _start_session(self, session, session_input):
        session.resources = SimpleNamespace(process=None, process_wait=None, watcher_task=None, input=session_input)

    def _dispatch_queued_irs_locked(self, session):
        if session.phase is not SessionPhase.ACTIVE:
            return
        group = session.group
        if group.ownership is not GroupOwnership.RUNTIME:
            return
        if not self._group_generation_open(group) and not session.protected_until_finalize:
            return
        while session.queued_irs:
            ir = session.queued_irs.popleft()
            ir.rollout_id = session.rollout_id
            ir.backend_started = False
            ir.runner_task = asyncio.create_task(self._run_ir(session, ir),
                                                 name=f"chat:{session.session_id}:{ir.request_id}")

    def _fail_ir_locked(self, session, ir, error):
        session.live_irs.remove(ir)
        ir.runner_task = None
        ir.waiter.set_exception(error)
        self._dispatch_queued_irs_locked(session)

    @contextlib.asynccontextmanager
    async def _admission_lease(self, session, ir):
        yield  # no admission coordinator

    @contextlib.asynccontextmanager
    async def _sglang_request_permit(self):
        if self._sglang_request_semaphore is None:
            yield
            return
        async with self._sglang_request_semaphore:
            yield

    async def _run_ir(self, session, ir):
        group = session.group
        runner_task = asyncio.current_task()

        def is_current() -> bool:
            return session.phase is SessionPhase.ACTIVE and ir in session.live_irs and ir.runner_task is runner_task

        async with session.lock:
            if not is_current():
                return
            if not self._group_generation_open(group) and not session.protected_until_finalize:
                ir.runner_task = None
                session.queued_irs.appendleft(ir)
                return
        try:
            async with self._admission_lease(session, ir):
                async with self._sglang_request_permit():
                    async with session.lock:
                        if not is_current():
                            return
                        if not self._group_generation_open(group) and not session.protected_until_finalize:
                            ir.runner_task = None
                            session.queued_irs.appendleft(ir)
                            return
                        backend_request_id = _backend_request_id(ir)
                        ir.backend_started = True
                        remaining_tokens = int(ir.sampling_params["max_new_tokens"]) - len(ir.pending_token_delta)
                    result = await self._generation_backend.generate(
                        input_ids=ir.history_rollout_token_prefix + ir.pending_token_delta,
                        sampling_params={**ir.sampling_params, "max_new_tokens": remaining_tokens},
                        session_id=session.session_id,
                        request_id=backend_request_id,
                        image_data=ir.history_backend_image_data,
                        audio_data=ir.history_backend_audio_data,
                        video_data=ir.history_backend_video_data,
                        return_logprob=group.rollout_mode == "train" or ir.logprobs,
                    )
        except asyncio.CancelledError:
            async with session.lock:
                expected = session.phase is not SessionPhase.ACTIVE or ir.runner_task is not runner_task
                if not expected:
                    ir.runner_task = None
                    ir.backend_started = False
            if not expected:
                await self._handle_infra_failure(session, RuntimeGroupError("chat runner cancelled itself"))
            return
        except BackendContextLengthExceededError:
            async with session.lock:
                if is_current():
                    ir.runner_task = None
                    ir.backend_started = False
                    session.live_irs.remove(ir)
                    ir.waiter.set_result(_error_result("context length exceeded", code="context_length_exceeded",
                                                       param="messages", status_code=400,
                                                       error_type="invalid_request_error"))
                    self._dispatch_queued_irs_locked(session)
            return
        except RuntimeGroupError as error:
            async with session.lock:
                if ir in session.live_irs and ir.runner_task is runner_task:
                    ir.runner_task = None
                    ir.backend_started = False
            await self._handle_infra_failure(session, error)
            return
        except Exception as error:
            async with session.lock:
                if is_current():
                    ir.backend_started = False
                    self._fail_ir_locked(session, ir, error)
            return

        async with session.lock:
            if not is_current():
                return
            ir.runner_task = None
            ir.backend_started = False
            self._apply_generate_result(ir, result)
            if result.finish_type == "abort":  # pause_generation aborted it: requeue, resume later
                ir.abort_count += 1
                ir.kind = RequestKind.RESUMED
                ir.pending_status = "aborted"
                session.queued_irs.append(ir)
                self._dispatch_queued_irs_locked(session)
                return
            ir.pending_status = "truncated" if result.finish_type == "length" else "completed"
            payload = self._terminal_response_locked(session=session, ir=ir, finish_type=result.finish_type)
            session.live_irs.remove(ir)
            ir.waiter.set_result(payload)
            self._dispatch_queued_irs_locked(session)

    def _apply_generate_result(self, ir, result):
        ir.pending_token_delta.extend(result.new_tokens)
        ir.pending_logprob_delta.extend(result.new_log_probs)
        ir.pending_generation_elapsed_s += result.elapsed
        ir.latest_backend_meta = dict(result.meta_info)
        ir.pending_export_metadata_patch.update(relax_lorapub.export_metadata(result.meta_info))  # lorapub hook

    def _terminal_response_locked(self, *, session, ir, finish_type):
        ir.pending_export_metadata_patch.update({"request_id": ir.request_id, "request_kind": ir.kind.value})
        forest = session.forest
        forest.history = ir.history_rollout_token_prefix + ir.pending_token_delta
        forest.leaf_patch = dict(ir.pending_export_metadata_patch)  # append_resp: the new leaf's patch
        forest.responses += 1
        return {
            "request_id": ir.request_id,
            "message": {"role": "assistant", "content": list(ir.pending_token_delta)},
            "finish_reason": "length" if finish_type == "length" else "stop",
            "usage": {"prompt_tokens": len(ir.history_rollout_token_prefix),
                      "completion_tokens": len(ir.pending_token_delta)},
        }

    # -- the end of a session ------------------------------------------------------------------------
    async def finish_agent(self, session_id: str, reward: float = 1.0) -> None:
        """The agent process exited normally (``_watch_agent_process``): finalize its session."""
        session = self._session_records[session_id]
        session.resources.output = SimpleNamespace(reward=reward)
        await self._finalize_terminal_session(session)

    async def _finalize_terminal_session(self, session):
        async with session.lock:
            if session.phase is not SessionPhase.ACTIVE:
                return
            session.phase = SessionPhase.FINALIZING
            forest = session.forest
            # _build_session_export_transport -> _build_sample: the leaf's patch becomes the sample's metadata
            outcome = {"session_id": session.session_id, "tokens": list(forest.history),
                       "reward": session.resources.output.reward,
                       "metadata": copy.deepcopy(forest.leaf_patch)}
        await self._finish_session(session, outcome)

    async def _handle_infra_failure(self, session, error):
        session.group.error = session.group.error or error
        await self._finish_session(session, error)

    async def _finish_session(self, session, outcome):
        async with session.lock:
            finish_task = session.finish_task
            if finish_task is None:
                session.phase = SessionPhase.FINALIZING
                finish_task = asyncio.create_task(self._finish_session_once(session, outcome),
                                                  name=f"session-finish:{session.session_id}")
                session.finish_task = finish_task
        return await asyncio.shield(finish_task)

    async def _finish_session_once(self, session, outcome):
        group = session.group
        pre_backend_tasks: list[asyncio.Task] = []
        backend_tasks: list[asyncio.Task] = []
        backend_request_ids: list[str] = []
        async with session.lock:
            irs = tuple(session.live_irs)
            for ir in irs:
                if ir.runner_task is not None:
                    if ir.backend_started:
                        backend_request_ids.append(_backend_request_id(ir))
                        backend_tasks.append(ir.runner_task)
                    else:
                        pre_backend_tasks.append(ir.runner_task)
        for task in pre_backend_tasks:
            task.cancel()
        abort_outcomes = await asyncio.gather(
            *(self._generation_backend.abort_request(rid) for rid in backend_request_ids), return_exceptions=True)
        await asyncio.gather(*pre_backend_tasks, *backend_tasks, return_exceptions=True)
        await self._lorapub.release(session.session_id)  # lorapub hook: nothing of it runs any more
        async with session.lock:
            for ir in irs:
                ir.runner_task = None
                ir.backend_started = False
                if not ir.waiter.done():
                    ir.waiter.set_result(_error_from_exception(_session_discarded_error(session.session_id)))
            session.live_irs.clear()
            session.queued_irs.clear()
        async with session.lock:
            session.resources = None
        del self._session_records[session.session_id]
        cleanup_error = next((o for o in abort_outcomes if isinstance(o, BaseException)), None)
        if cleanup_error is not None:
            outcome = RuntimeGroupError(f"agent cleanup failed for {session.session_id}: {cleanup_error}")
        session.result_cell.publish(outcome)
        group.sessions.remove(session)
        self._notify_state_change(group)
        return cleanup_error

    async def _drop_group(self, group):
        group_id = group.group_id
        if self._groups.get(group_id) is not group:
            return
        group.is_dropped = True
        sessions = tuple(group.sessions)
        outcomes = await asyncio.gather(*(self._finish_session(s, None) for s in sessions), return_exceptions=True)
        await self._lorapub.release_group(group_id)  # lorapub hook: whatever a failed finish left open
        self._groups.pop(group_id, None)
        self._notify_state_change()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome


# --------------------------------------------------------------------------------------------
# relax/backends/megatron/weight_update/lora_adapter_sync.py
# --------------------------------------------------------------------------------------------


def _is_lora_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


class LoraAdapterSync:
    def __init__(self, args, model):
        self.args = args
        self.model = model
        self.prev_state: Optional[dict[str, Any]] = None
        self.base_sync_done = False
        self.adapter_loaded = False
        self.exports = 0

    def config_dict(self):
        return {
            "r": self.args.lora_rank, "lora_alpha": self.args.lora_alpha,
            "target_modules": list(self.args.lora_target_modules), "lora_dropout": self.args.lora_dropout,
            "bias": "none", "peft_type": "LORA", "task_type": "CAUSAL_LM",
        }

    def export_local_adapter(self, all_params):
        self.exports += 1
        return {name: tensor.copy() for name, tensor in all_params.items() if _is_lora_adapter_param(name)}

    def should_skip(self, all_params):
        new_state = {n: t.copy() for n, t in all_params.items() if _is_lora_adapter_param(n)}
        if self.prev_state is None or set(self.prev_state) != set(new_state):
            return False, new_state
        return all((abs(new_state[n] - self.prev_state[n]) <= 1e-6).all() for n in new_state), new_state

    def gather_full_adapter(self, local_adapter, *, all_gather):
        return dict(local_adapter)  # PP=1: the local export is the full adapter


# --------------------------------------------------------------------------------------------
# relax/distributed/checkpoint_service/backends/device_direct.py
# --------------------------------------------------------------------------------------------


class Model:
    """Stands in for the Megatron model chunk: its LoRA parameters change at every optimizer step."""

    def __init__(self, adapter_of_step) -> None:
        self.step = 1
        self._adapter_of_step = adapter_of_step

    def named_parameters(self):
        return dict(self._adapter_of_step(self.step))


def _named_params_and_buffers(args, model, convert_to_global_name=True):
    return iter(model[0].named_parameters().items())


class DeviceDirectBackend:
    """Synchronous, like Relax's (tests call it through ``asyncio.to_thread``); one rank."""

    def __init__(self, args, backend_type, role_info, model, *, model_name, quantization_config, coordinator_url=None,
                 lock=None, timeout_seconds=300):
        self._megatron = SimpleNamespace(named_params_and_buffers=_named_params_and_buffers,
                                         LoraAdapterSync=LoraAdapterSync)
        self.args = args
        self.model = model
        self.model_name = model_name
        self.weight_version = 0
        self.rollout_topology: dict[int, dict[str, Any]] = {}
        self._lora_adapter_mode = bool(args.lora_adapter_mode)
        self._lora_sync = self._megatron.LoraAdapterSync(args, model) if self._lora_adapter_mode else None
        self._lora_skip_rollout_base = False
        self.base_syncs = 0  # the base broadcast to the rollout engines
        self.actor_fwd_syncs = 0  # the weights sent to actor_fwd/reference
        self._lorapub_path = relax_lorapub.install_weight_path(self, **INJECT["trainer"])  # lorapub hook

    def init_process_group_for_rollout(self, topology_data=None):
        self.rollout_topology = {int(rank): dict(info) for rank, info in (topology_data or {}).items()}

    def _urls(self) -> list[str]:
        return [f"http://{info['ip']}:{info['port']}" for _, info in sorted(self.rollout_topology.items())]

    def _batch_request(self, endpoint, payload=None, get_rank=False):
        replies = []
        for url in self._urls():  # RolloutEngine.make_request on every engine
            request = urllib.request.Request(f"{url}{endpoint}", data=json.dumps(payload or {}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                raw = response.read()
                try:
                    replies.append(json.loads(raw or b"null"))
                except ValueError:  # /flush_cache answers plain text
                    replies.append(raw.decode(errors="replace"))
        return replies

    def update_weights_for_rollout(self, rollout_only=False, actor_fwd_only=False):
        self.weight_version += 1
        self._lora_skip_rollout_base = self._lora_adapter_mode and self._lora_sync.base_sync_done
        if not actor_fwd_only:
            self._batch_request("/pause_generation")
            self._batch_request("/flush_cache")  # RolloutEngine.flush_cache
        if not actor_fwd_only and not self._lora_skip_rollout_base:
            self.base_syncs += 1  # the bucketed NCCL broadcast of the base (the engines' base is fixed here)
        if not rollout_only:
            self.actor_fwd_syncs += 1
        push_error: Optional[Exception] = None
        if self._lora_adapter_mode and not actor_fwd_only:
            try:
                self._push_lora_adapter_distributed(first_sync=not self._lora_sync.adapter_loaded)
            except Exception as e:  # re-raised after the engines are resumed
                push_error = e
            else:
                self._lora_sync.adapter_loaded = True
                self._lora_sync.base_sync_done = True
        if not actor_fwd_only:
            self._batch_request("/continue_generation")
            if push_error is not None:
                raise RuntimeError("LoRA adapter push to the rollout engines failed") from push_error

    def _push_lora_adapter_distributed(self, *, first_sync):
        all_params = dict(self._megatron.named_params_and_buffers(self.args, self.model, convert_to_global_name=False))
        unchanged, new_state = self._lora_sync.should_skip(all_params)
        if not first_sync and unchanged:
            self._lora_sync.prev_state = new_state
            return
        local_adapter = self._lora_sync.export_local_adapter(all_params)
        merged = self._lora_sync.gather_full_adapter(local_adapter, all_gather=False)
        # rank 0: /update_lora_from_distributed + the NCCL broadcast; the engine replaces the fixed name
        folder = Snapshot(merged, self._lora_sync.config_dict()).save_peft_dir(tempfile.mkdtemp(prefix="relax-push-"))
        for url in self._urls():
            for endpoint, body in (("/unload_lora_adapter", {"lora_name": LORA_ADAPTER_NAME}),
                                   ("/load_lora_adapter", {"lora_name": LORA_ADAPTER_NAME, "lora_path": folder})):
                request = urllib.request.Request(f"{url}{endpoint}", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                try:
                    urllib.request.urlopen(request, timeout=30).close()
                except urllib.error.HTTPError:
                    if endpoint == "/load_lora_adapter":
                        raise  # a first unload finds nothing to replace
        self._lora_sync.prev_state = new_state
