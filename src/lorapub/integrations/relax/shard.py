"""The shard side: :class:`RelaxLorapub` in an ``AgenticSessionShard`` and the generation
backend wrapper that binds each Relax group to one version."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Sequence, Union

from lorapub import (BindingStale, Deployment, EngineError, EngineUnavailable, InvalidInput, LorapubError,
                     NoPublishedVersion, Session, SessionClosed, UnknownEngine)
from lorapub.ports import CopyStore, EngineAdmin, Registry, Transport

from .errors import CONTEXT_MARKERS, chat_error
from .options import ENABLE_FLAG, LorapubConfig, config_from_args, engine_name, make_transport, safe_id, takes_keyword

if TYPE_CHECKING:
    from .copies import RayCopies

__all__ = ['GenerateResult', 'LorapubGenerationBackend', 'RelaxLorapub']

log = logging.getLogger("lorapub.integrations.relax")  # one logger for the whole integration

# ---------------------------------------------------------------------------------------------
# The shard side
# ---------------------------------------------------------------------------------------------

#: How often a request that waits for the first version asks again.
FIRST_VERSION_POLL = 0.1

WorkerUrls = Union[Sequence[str], Callable[[], Union[Sequence[str], Awaitable[Sequence[str]]]]]


async def _each(coros: list[Awaitable[Any]]) -> None:
    """Await them together; one is awaited in place (no task: a shard ends groups by the hundred thousand)."""
    if len(coros) == 1:
        await coros[0]
    elif coros:
        await asyncio.gather(*coros)


def _failed(task: asyncio.Task[None] | None) -> bool:
    return task is not None and task.done() and (task.cancelled() or task.exception() is not None)


def _metrics() -> list[Any]:
    """The Metrics observer the status endpoint serves at /metrics, where prometheus-client is installed
    (a registry of its own: a process may hold other lorapub deployments)."""
    try:
        from prometheus_client import CollectorRegistry

        from lorapub.adapters.prometheus import Metrics
    except ImportError:
        log.info("lorapub: prometheus-client is not installed; the status endpoint serves no /metrics")
        return []
    return [Metrics(CollectorRegistry())]


@dataclasses.dataclass
class _Group:
    key: str  # the lorapub group: one per start_group, so a reused Relax group id starts afresh
    members: dict[str, Session]


class RelaxLorapub:
    """lorapub in one Relax process: an ``AgenticSessionShard`` (``role="shard"``) or rank 0 of the
    trainer (``role="trainer"``, through :class:`LorapubPublisher`).

    It starts on first use: engines are built from ``worker_urls`` (a list, or a callable, sync or
    async; a shard's default is its backend's ``_worker_urls``) unless ``engines`` are given. With the
    switch off every hook returns at once and nothing is started.
    """

    def __init__(
        self,
        args: Any,
        *,
        config: LorapubConfig | None = None,
        worker_urls: WorkerUrls | None = None,
        engines: Mapping[str, EngineAdmin] | None = None,
        registry: Registry | None = None,
        role: str = "shard",
        copies: CopyStore | None = None,
        **deployment_options: Any,
    ) -> None:
        self.args = args
        self.config = config.resolved(args) if config is not None else config_from_args(args)
        self.enabled = self.config is not None
        if self.config is not None and self.config.epoch is None:  # enabled
            # Each actor picking its own epoch would split one run into several deployments.
            raise InvalidInput(f"{ENABLE_FLAG}: the epoch is unset; call validate_args(args) on the driver first")
        if role not in ("shard", "trainer"):
            raise InvalidInput(f"role must be 'shard' or 'trainer', got {role!r}")
        self.role = role
        self.deployment: Deployment | None = None
        #: Whether the deployment names versions with ``config.name_prefix`` (None until started).
        self.name_prefix_applied: bool | None = None
        self._worker_urls = worker_urls
        self._given_engines = dict(engines) if engines is not None else None
        self._built_engines: list[EngineAdmin] = []
        self._transport: Transport | None = None  # the built engines' transport, named on their deployment
        self._registry = registry
        self._copies = copies  # the trainer's: where its frozen copies outlive it (copies.py)
        self._own_copies: RayCopies | None = None  # the store this object made (and ends at aclose)
        self._deployment_options = deployment_options
        self._start: asyncio.Task[None] | None = None
        self._groups: dict[str, _Group] = {}
        self._members: dict[str, Session] = {}
        self._rebinds_seen: dict[str, int] = {}  # per open member: the group rebinds its last turn carried
        self._closed = False
        self._following: asyncio.Task[None] | None = None  # the running look at the workers (one at a time)
        self._followed_at: float | None = None
        self._leaving: dict[str, asyncio.Task[None]] = {}  # engine -> its drain and removal
        #: cut trajectories since the last :meth:`metrics` reset (Relax's ``agentic_kv_metrics``)
        self._counts = {"rebound": 0, "stale": 0, "waited_first_version": 0}

    @property
    def _config(self) -> LorapubConfig:
        assert self.config is not None, "lorapub is off"  # only reached with the switch on
        return self.config

    def _deployed(self) -> Deployment:
        assert self.deployment is not None, "lorapub is not started"  # only reached after start()
        return self.deployment

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> "RelaxLorapub":
        """Idempotent; concurrent first callers share one start (a failed start is retried)."""
        if not self.enabled:
            return self
        if self._closed:
            raise SessionClosed("this shard's lorapub was closed (shard shutdown)")
        if self._start is None or _failed(self._start):
            self._start = asyncio.get_running_loop().create_task(self._start_once())
        await asyncio.shield(self._start)
        return self

    async def _start_once(self) -> None:
        try:
            await self._start_deployment()
        except BaseException:
            # a failed start is retried with adapters built afresh: the ones built here leak nothing
            built, self._built_engines = self._built_engines, []
            for engine in built:
                await engine.close()
            raise

    async def _start_deployment(self) -> None:
        if not self._config.registry and self._registry is None and self._given_engines is None:
            # Relax runs its trainer and each rollout shard in processes of their own: registries of
            # their own, under one epoch, would each take the other's versions for orphans and unload them
            raise InvalidInput(
                "lorapub registry: \"\" (in-process) cannot serve Relax's workers: the trainer and every "
                "shard run in processes of their own, and each would unload the versions the others publish "
                "and bind — set registry: <a Ray actor name> (the default, lorapub_relax_registry)")
        engines = self._given_engines if self._given_engines is not None else await self._build_engines()
        if not engines:
            raise InvalidInput("lorapub needs at least one SGLang worker: Relax's router lists none")
        config = self._config
        assert config.epoch is not None  # __init__ refused an unset epoch
        options: dict[str, Any] = {"capacity": config.capacity, "max_lag": config.max_lag,
                                   "on_stale": config.on_stale, "idle_ttl": config.idle_ttl}
        if self._transport is not None:
            options["transport"] = self._transport
        if self.role == "trainer" and config.status is not None:
            # one endpoint, the trainer's: what it shows is the shared registry's view of the whole fleet
            options.update(status=config.status_address(), status_token=config.status_token,
                           observers=[*options.get("observers", ()), *_metrics()])
        options.update(self._deployment_options)
        # the engines' SGLang must protect the same prefix (engine_env(): SGLANG_LORAPUB_MANAGED_PREFIX);
        # Deployment.start() refuses an engine that protects another
        self.name_prefix_applied = takes_keyword(Deployment, "name_prefix")
        if self.name_prefix_applied:
            options["name_prefix"] = config.name_prefix
        else:  # an older lorapub
            log.warning(
                "lorapub: name_prefix %r is not applied: this lorapub names versions with its built-in prefix "
                "(the Deployment takes no name_prefix)", config.name_prefix,
            )
        registry = self._registry if self._registry is not None else await self._shared_registry(engines, options)
        if registry is not None:
            options["registry"] = registry
            for shared in ("capacity", "max_lag", "on_stale"):
                options.pop(shared, None)  # a shared registry's settings are made where it is created
            # (name_prefix stays: the deployment refuses a shared registry that names versions otherwise)
        if self.role == "trainer":
            # its frozen copies outlive it, and a trainer started again takes back those kept before it: it loads
            # every live version on an engine that joins or restarts, whichever trainer process published it
            copies = self._copies
            if copies is None and config.registry and self._registry is None:
                from .copies import RayCopies

                copies = self._own_copies = RayCopies(f"{config.registry}-{config.epoch}-copies")
            if copies is not None:
                options.setdefault("copies", copies)
        self.deployment = await Deployment(engines, epoch=config.epoch, **options).start()

    async def _build_engines(self) -> dict[str, EngineAdmin]:
        urls = await self._current_urls()
        from lorapub.adapters.sglang_wire import HTTPBytes  # aiohttp: lazily

        self._transport = make_transport(self._config, self.args) if self.role == "trainer" else HTTPBytes()
        engines: dict[str, EngineAdmin] = {engine_name(url): self._engine(url) for url in sorted(set(urls or ()))}
        self._built_engines = list(engines.values())
        self._followed_at = time.monotonic()
        return engines

    def _engine(self, url: str) -> EngineAdmin:
        from lorapub.adapters.sglang_wire import SGLangWireEngine  # aiohttp: lazily

        return SGLangWireEngine(engine_name(url), url, api_key=self._config.api_key,
                                admin_api_key=self._config.admin_api_key)

    async def _current_urls(self) -> list[str]:
        urls = self._worker_urls
        if callable(urls):
            found = urls()
            if inspect.isawaitable(found):
                return list(await found or ())
            return list(found or ())
        return list(urls or ())

    # -- engines that come and go ---------------------------------------------------------------
    async def follow_workers(self, urls: Sequence[str] | None = None, *, join_timeout: float | None = 60.0) -> dict[str, list[str]]:
        """Bring this deployment's engines to ``urls`` (default: the workers now, from ``worker_urls``: the
        router's list on a shard): a worker that appeared is added (``add_engine``: it takes traffic once it
        holds every version a live session may use), one that left is drained, then removed, in the
        background (``drain_engine`` for up to ``drain_wait`` s, then ``remove_engine``). An empty list is
        ignored (a router between two lists). Returns the names ``added`` and ``leaving``."""
        if not self.enabled or self.deployment is None or self._closed:
            return {"added": [], "leaving": []}
        wanted = {engine_name(u): u for u in (urls if urls is not None else await self._current_urls())}
        if not wanted:
            log.warning("lorapub: the worker list is empty; the engines stay as they are")
            return {"added": [], "leaving": []}
        have = set(self.deployment.engines)
        added = sorted(set(wanted) - have)
        leaving = sorted(name for name in have - set(wanted) if name not in self._leaving)
        for name in added:
            engine = self._engine(wanted[name])
            self._built_engines.append(engine)
            try:
                await self.deployment.add_engine(engine, timeout=join_timeout)
                log.info("lorapub: engine %s joined (it holds every version a live session may use)", name)
            except EngineUnavailable as e:  # a member now: it keeps joining in the background
                log.warning("lorapub: engine %s is joining but takes no traffic yet: %s", name, e)
            except LorapubError as e:  # refused (its LoRA slots, its protected prefix): a later look asks again
                self._built_engines.remove(engine)
                await engine.close()
                log.error("lorapub: engine %s was refused and serves nothing: %s", name, e)
        for name in leaving:
            self._leaving[name] = asyncio.get_running_loop().create_task(self._leave(name))
        self._followed_at = time.monotonic()
        return {"added": added, "leaving": leaving}

    async def _leave(self, name: str) -> None:
        try:
            await self._deployed().drain_engine(name, timeout=self._config.drain_wait)
            await self._deployed().remove_engine(name)
            log.info("lorapub: engine %s left the workers: drained and removed", name)
        except UnknownEngine:
            # another process of the run (the trainer, another shard) removed it from the shared registry
            # first: nothing routes there any more; this process lets go of its adapter once its own requests
            # running there end (the removal finishes here)
            engine = self._deployed().engines.get(name)
            try:
                await self._deployed().remove_engine(name, timeout=self._config.drain_wait)
            except UnknownEngine:
                pass
            if engine is not None and engine in self._built_engines:
                self._built_engines.remove(engine)
                await engine.close()
            log.info("lorapub: engine %s left the workers (removed by another process of the run)", name)
        except LorapubError as e:  # it stays draining (no new binding goes there); a later look tries again
            log.warning("lorapub: engine %s left the workers but is not removed yet: %s", name, e)
        finally:
            self._leaving.pop(name, None)

    def _maybe_follow(self) -> None:
        """A shard looks at the router's workers at most every ``worker_refresh`` s, beside its groups."""
        every = self._config.worker_refresh
        if every is None or self._given_engines is not None or self._worker_urls is None:
            return
        if self._following is not None and not self._following.done():
            return
        if self._followed_at is not None and time.monotonic() - self._followed_at < every:
            return
        self._followed_at = time.monotonic()
        self._following = asyncio.get_running_loop().create_task(self._follow_logged())

    async def _follow_logged(self) -> None:
        try:
            await self.follow_workers()
        except Exception as e:  # noqa: BLE001 - a failed look is retried at the next one
            log.warning("lorapub: looking at the router's workers failed: %s", e)

    async def _shared_registry(self, engines: Mapping[str, EngineAdmin], options: Mapping[str, Any]) -> Registry | None:
        config = self._config
        if not config.registry:
            return None  # in-process: one process publishes and serves sessions
        from lorapub.adapters.ray_registry import RayRegistry  # ray: lazily

        assert config.epoch is not None  # __init__ refused an unset epoch
        incarnations = {name: await engine.incarnation() for name, engine in engines.items()}
        # keywords a RayRegistry.create of an older lorapub may lack
        extra: dict[str, Any] = {"name_prefix": config.name_prefix} if takes_keyword(RayRegistry.create, "name_prefix") else {}
        # get-if-exists: the first process to get here creates it (with these settings), every other joins it
        return RayRegistry.create(
            f"{config.registry}-{config.epoch}", config.epoch, incarnations,
            capacity=options["capacity"], store_path=config.registry_store, max_lag=options["max_lag"],
            on_stale=options["on_stale"], **extra,
        )

    async def aclose(self) -> None:
        """``_shutdown``: release every member still open, stop the deployment, close the engines."""
        self._closed = True
        for task in [self._following, *self._leaving.values()]:
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._members:
            await asyncio.gather(*(self._close(sid) for sid in list(self._members)), return_exceptions=True)
        self._groups.clear()
        if self.deployment is not None:
            await self.deployment.close()
        if self._own_copies is not None:  # its last copies sent, its sending thread ends
            await asyncio.to_thread(self._own_copies.close)
            self._own_copies = None
        for engine in self._built_engines:
            await engine.close()
        self._built_engines = []

    # -- hooks of AgenticSessionShard ----------------------------------------------------------
    async def open_group(self, group_id: str, session_ids: Sequence[str]) -> None:
        """``start_group``: one lorapub group for the Relax group, every member opened now, so the
        group keeps the version it binds at its first request while any member is open.

        Relax refuses a resident group id before this hook runs, so an id still known here belongs to a
        group that ended (Relax's train ids restart at ``train:prepare_group_0`` whenever a PrepareDomain
        is rebuilt): what it left open is released, and the id starts a new lorapub group."""
        if not self.enabled:
            return
        await self.start()
        self._maybe_follow()
        ended = self._groups.pop(group_id, None)
        if ended is not None:
            log.info("lorapub: Relax group id %s comes back as a new group; releasing what its previous group "
                     "left open (%d member(s))", group_id, sum(self._members.get(s) is m for s, m in ended.members.items()))
            await self._release_members(ended)
        key = f"{safe_id(group_id, 'group', 100)}.{uuid.uuid4().hex[:8]}"  # a closed lorapub group never reopens
        members = {sid: self._deployed().session(safe_id(sid, "session"), group=key) for sid in session_ids}
        self._groups[group_id] = _Group(key, members)
        self._members.update(members)
        await _each([member.open() for member in members.values()])

    def member(self, session_id: str) -> Session | None:
        """The lorapub session of a Relax session record (None when none is open)."""
        return self._members.get(session_id)

    async def generate(self, session_id: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One backend request of the session: the group's first one binds the current default for the
        whole group; every later one (tool turns, aborts and resumes) carries the same ``lora_path``.
        SGLang's reply, with ``reply["lorapub"]`` (version, version_id, lag, lora_name, rebinds)."""
        member = self._members.get(session_id)
        if member is None:
            raise SessionClosed(
                f"Relax session {session_id!r} holds no lorapub session (its group was not opened, or the session "
                "was released); nothing was sent"
            )
        try:
            reply = await member.generate(payload)
        except BindingStale:
            self._counts["stale"] += 1  # on_stale: error — the trajectory ends here
            raise
        rebinds = int((reply.get("lorapub") or {}).get("rebinds") or 0)
        if rebinds > self._rebinds_seen.get(session_id, 0):
            self._counts["rebound"] += 1  # on_stale: rebind — the trajectory goes on on a newer version
        self._rebinds_seen[session_id] = rebinds
        return reply

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Cut trajectories for Relax's own metrics (``agentic_kv_metrics``; Relax's runtime reports them
        as ``agentic_kv/lorapub/...``): turns that moved to a newer version (``on_stale: rebind``), requests
        refused BINDING_STALE (``on_stale: error``), and requests that waited for the first version."""
        if not self.enabled:
            return {}
        counts = dict(self._counts)
        if reset:
            self._counts = dict.fromkeys(self._counts, 0)
        return {
            "lorapub/cut_trajectories": float(counts["rebound"] + counts["stale"]),
            "lorapub/rebound_turns": float(counts["rebound"]),
            "lorapub/stale_refusals": float(counts["stale"]),
            "lorapub/waited_first_version": float(counts["waited_first_version"]),
        }

    async def release(self, session_id: str) -> None:
        """``_finish_session_once``, once the session's requests are aborted and joined: release its
        ref exactly once. A failure is logged: its lease expires and the version is reclaimed anyway."""
        if self.enabled:
            await self._close(session_id)

    async def release_group(self, group_id: str) -> None:
        """Relax's ``release_group`` (a completed group, after ``collect_group`` has every result) and
        ``_drop_group`` (a failed or dropped one): release every member not released yet and forget the
        group, so a long-lived shard keeps nothing of the groups that ended."""
        if not self.enabled:
            return
        group = self._groups.pop(group_id, None)
        if group is not None:
            await self._release_members(group)

    async def _release_members(self, group: _Group) -> None:
        # only this group's own records: a member id of an ended group may be live again in a new one
        await _each([self._close(sid, member) for sid, member in group.members.items()])

    async def _close(self, session_id: str, member: Session | None = None) -> None:
        if member is not None and self._members.get(session_id) is not member:
            return  # released already (its own finish), or the id now belongs to a newer group
        member = self._members.pop(session_id, None)
        self._rebinds_seen.pop(session_id, None)
        if member is None:
            return
        try:
            await member.close()
        except LorapubError as e:
            log.warning("lorapub: releasing Relax session %s failed (its lease will expire): %s", session_id, e)

    @property
    def open_sessions(self) -> tuple[str, ...]:
        """The Relax session ids whose lorapub session is open here."""
        return tuple(self._members)

    # -- the backend ------------------------------------------------------------------------------
    def wrap_backend(
        self,
        backend: Any,
        *,
        chat_error_type: type | None = None,
        context_length_error_type: type | None = None,
        result_type: Callable[..., Any] | None = None,
        sanitize_tokens: Callable[[list[int]], list[int]] | None = None,
    ) -> Any:
        """``__init__``: the shard's generation backend. Off: ``backend`` itself (Relax's path unchanged)."""
        if not self.enabled:
            return backend
        if self._worker_urls is None and self._given_engines is None:
            self._worker_urls = backend._worker_urls  # the router's healthy workers
        return LorapubGenerationBackend(
            backend, self, chat_error_type=chat_error_type, context_length_error_type=context_length_error_type,
            result_type=result_type, sanitize_tokens=sanitize_tokens,
        )


@dataclasses.dataclass
class GenerateResult:
    """The fields of Relax's ``BackendGenerateResult`` (used where that class is not passed)."""

    new_tokens: list[int]
    new_log_probs: list[float]
    finish_type: str
    meta_info: dict[str, Any]
    elapsed: float


class LorapubGenerationBackend:
    """Relax's ``SGLangBackendAdapter`` with lorapub on: ``generate`` has its exact keywords and sends
    through the session's lorapub binding; everything else (``tokenizer``, ``compiler``,
    ``abort_request``, ``close_session``) is Relax's own; ``shutdown`` closes lorapub first."""

    def __init__(
        self,
        inner: Any,
        lorapub: RelaxLorapub,
        *,
        chat_error_type: type | None = None,
        context_length_error_type: type | None = None,
        result_type: Callable[..., Any] | None = None,
        sanitize_tokens: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.inner = inner
        self.lorapub = lorapub
        self._chat_error_type = chat_error_type
        self._context_length_error_type = context_length_error_type
        self._result_type = result_type or GenerateResult
        self._sanitize_tokens = sanitize_tokens
        self._waiting: dict[str, asyncio.Event] = {}  # request id -> set by abort_request while it waits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(
        self,
        *,
        input_ids: Iterable[int],
        sampling_params: Mapping[str, Any],
        session_id: str,
        request_id: str,
        image_data: object = None,  # Relax's multimodal inputs: sent to SGLang as they are
        audio_data: Iterable[object] | None = None,
        video_data: object = None,
        return_logprob: bool = True,
    ) -> Any:
        args = self.lorapub.args
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "rid": request_id,
            "return_logprob": return_logprob,
        }
        if getattr(args, "use_rollout_routing_replay", False):
            payload["return_routed_experts"] = True
        if image_data:
            payload["image_data"] = image_data
        if audio_data:
            payload["audio_data"] = list(audio_data)
        if video_data:
            payload["video_data"] = video_data
        if session_id and getattr(args, "agentic_session_lifecycle", False):
            payload["session_id"] = session_id
        started = time.monotonic()
        try:
            output = await self._send(session_id, request_id, payload)
        except EngineError as e:
            if e.details.get("status") == 400 and any(m in str(e) for m in CONTEXT_MARKERS):
                if self._context_length_error_type is not None:
                    raise self._context_length_error_type(str(e)) from e
            raise chat_error(e, self._chat_error_type) from e
        except LorapubError as e:
            raise chat_error(e, self._chat_error_type) from e
        return self._result(output, time.monotonic() - started)

    async def _send(self, session_id: str, request_id: str, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        """Send on the session's binding. Before the trainer's first version the request waits for it (up to
        ``first_version_wait`` s: nothing was sent, so asking again is safe); Relax's ``abort_request`` of a
        waiting request (a pause) answers it as an aborted one, which Relax requeues and resumes."""
        limit = self.lorapub._config.first_version_wait
        deadline: float | None = None
        try:
            while True:
                try:
                    return await self.lorapub.generate(session_id, payload)
                except NoPublishedVersion as e:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + limit
                        self.lorapub._counts["waited_first_version"] += 1
                    if now >= deadline:
                        raise NoPublishedVersion(
                            f"{e}: the request waited {limit:g}s (first_version_wait) for the trainer's first "
                            "version; nothing was sent — check that the trainer's first weight update ran"
                        ) from e
                    aborted = self._waiting.setdefault(request_id, asyncio.Event())
                    try:
                        await asyncio.wait_for(aborted.wait(), min(FIRST_VERSION_POLL, deadline - now))
                    except TimeoutError:
                        continue
                    return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
        finally:
            self._waiting.pop(request_id, None)

    async def abort_request(self, request_id: str) -> Any:
        """Relax's ``abort_request``; a request still waiting for the first version is answered aborted."""
        waiting = self._waiting.get(request_id)
        if waiting is not None:
            waiting.set()
        return await self.inner.abort_request(request_id)

    def _result(self, output: Mapping[str, Any], elapsed: float) -> Any:
        meta_info = dict(output.get("meta_info") or {})
        if "lorapub" in output:  # a request answered aborted while it waited for the first version has none
            meta_info["lorapub"] = dict(output["lorapub"])
        items = list(meta_info.get("output_token_logprobs") or ())
        if items and all(isinstance(item, (list, tuple)) for item in items):  # SGLang: [logprob, token_id, text]
            tokens = [int(item[1]) for item in items]
            logprobs = [float(item[0]) for item in items]
        else:
            tokens = [int(t) for t in output["output_ids"]]
            logprobs = [float(x) for x in items]
        if self._sanitize_tokens is not None:
            tokens = self._sanitize_tokens(tokens)
        return self._result_type(
            new_tokens=tokens,
            new_log_probs=logprobs,
            finish_type=str(meta_info["finish_reason"]["type"]),
            meta_info=meta_info,
            elapsed=elapsed,
        )

    async def shutdown(self) -> None:
        try:
            await self.lorapub.aclose()
        finally:
            await self.inner.shutdown()
