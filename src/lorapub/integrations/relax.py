"""Relax integration: versioned LoRA publication behind one Relax argument.

Relax (``redai-infra/Relax``) sends agentic generations from its session shards
(``relax/agentic/session/service.py``: ``AgenticSessionShard``) and pushes the trained
adapter from its weight-update backends (``relax/distributed/checkpoint_service/
backends/device_direct.py``: ``DeviceDirectBackend``, helped by ``relax/backends/
megatron/weight_update/lora_adapter_sync.py``: ``LoraAdapterSync``). The hooks here
are what those places call; ``docs/relax.md`` shows each site, before and after.

Shard side (one :class:`RelaxLoraPublication` per ``AgenticSessionShard``)::

    record.lora = await pub.open_session(session_id)          # _register_session: record created
    output = await pub.generate(record.lora, payload)          # every backend request of the record
    pub.begin_release(removed.lora)                            # _discard_session_locked: record removed
    await pub.release(removed.lora)                            # _finish_discarded_session (finally)

Trainer side (rank 0 of ``DeviceDirectBackend``, a synchronous caller)::

    pub = BlockingRelaxLoraPublication(args, worker_urls=urls)
    pub.publish(merged, lora_sync.config_dict(), weight_version=self.weight_version)

The switch is ``--enable-versioned-lora-publication`` (:func:`add_arguments`). Off (the
default), :func:`lorapub.deploy` gives the old overwrite path (pause, flush, overwrite the
one fixed adapter name, resume) and the session hooks stay out of the way: Relax's own
request path runs as before. On, a session binds one immutable version on its first
generation and every later request of that record (tool turns, retries, resumes)
carries the same ``lora_path``; the record's close releases it exactly once.

Typed lorapub errors (:class:`lorapub.LorapubError`, with a stable ``code``) propagate
unchanged; nothing here falls back to the base model or to the latest version.
Importing this module needs neither Relax, Megatron, Ray, torch nor aiohttp.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import inspect
import os
import re
import threading
import time
from typing import Any, Awaitable, Callable, Mapping, Sequence, Union

from lorapub import LorapubError, SessionClosed, Snapshot, deploy

__all__ = [
    "ARGUMENT", "BindingChanged", "BlockingRelaxLoraPublication", "RelaxLoraPublication", "RelaxLoraSession",
    "add_arguments", "engine_name", "error_result", "is_enabled", "resolve_epoch", "snapshot_from_export",
    "validate_args", "version_id_for",
]

#: The one switch, as Relax spells its command-line arguments.
ARGUMENT = "--enable-versioned-lora-publication"
_DEST = "enable_versioned_lora_publication"
_DEFAULT_REGISTRY = "relax_lora_publication"
TRANSPORTS = ("http", "shared-dir")
_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")  # lorapub's rule for session and version ids

WorkerUrls = Union[Sequence[str], Callable[[], Union[Sequence[str], Awaitable[Sequence[str]]]]]


class BindingChanged(LorapubError):
    """A Relax session record was about to send a ``lora_path`` other than the one it is bound to.

    lorapub never does this; the integration checks it on the wire anyway and refuses to send.
    """

    code = "BINDING_CHANGED"


# ---------------------------------------------------------------------------------------------
# Arguments (relax/utils/arguments.py declares nested ``add_*_arguments(parser) -> parser``
# functions chained inside ``add_slime_arguments``; ``parse_args(add_custom_arguments=...)``
# runs a custom one first).
# ---------------------------------------------------------------------------------------------


def add_arguments(parser):
    """Declare the switch and its three settings; returns ``parser`` (Relax's convention)."""
    parser.add_argument(
        ARGUMENT,
        action="store_true",
        default=False,
        help=(
            "Publish every LoRA adapter update as an immutable version beside the old one (lorapub) "
            "instead of pausing generation, flushing the KV cache and overwriting the one fixed adapter. "
            "A session binds one version on its first generation and keeps it for every tool turn, retry "
            "and resume; an old version is unloaded once no session and no in-flight request uses it. "
            "Needs --lora-adapter-mode and SGLang servers running lorapub's patch. Off by default."
        ),
    )
    parser.add_argument(
        "--lora-publication-epoch",
        type=int,
        default=None,
        help=(
            "Deployment epoch of versioned LoRA publication (part of every version and session key). "
            "Unset: fixed once at argument validation from the clock, then carried to every actor."
        ),
    )
    parser.add_argument(
        "--lora-publication-registry",
        type=str,
        default=_DEFAULT_REGISTRY,
        help=(
            "Name of the Ray actor holding lorapub's registry, shared by the trainer and every session shard "
            "(the epoch is appended). Empty: an in-process registry (single-process runs and tests only)."
        ),
    )
    parser.add_argument(
        "--lora-publication-transport",
        type=str,
        choices=TRANSPORTS,
        default="http",
        help=(
            "How adapter bytes reach the rollout engines. http (default): each version's buckets are sent over "
            "HTTP into every engine, which stages, verifies and loads them itself (no shared storage). "
            "shared-dir: versions are written to --lora-publication-stash-dir, which every engine must be able "
            "to read."
        ),
    )
    parser.add_argument(
        "--lora-publication-stash-dir",
        type=str,
        default=None,
        help=(
            "With --lora-publication-transport shared-dir: the directory where adapter versions are staged for "
            "the rollout engines to load (shared storage). Default: <--save>/lorapub, or /tmp/lorapub."
        ),
    )
    return parser


def is_enabled(args: Any) -> bool:
    return bool(getattr(args, _DEST, False))


def resolve_epoch(args: Any) -> int:
    """The run's deployment epoch, fixed once on ``args`` (which Relax hands to every actor)."""
    epoch = getattr(args, "lora_publication_epoch", None)
    if epoch is None:
        epoch = int(time.time())
        args.lora_publication_epoch = epoch
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"--lora-publication-epoch must be a non-negative integer, got {epoch!r}")
    return epoch


def validate_args(args: Any) -> None:
    """Call from Relax's ``slime_validate_args`` (on the driver, before actors start)."""
    if not is_enabled(args):
        return
    if not getattr(args, "lora_rank", 0) or not getattr(args, "lora_adapter_mode", False):
        raise ValueError(f"{ARGUMENT} publishes LoRA adapters: it needs --lora-rank > 0 and --lora-adapter-mode.")
    if getattr(args, "lora_merge_mode", False):
        raise ValueError(f"{ARGUMENT} cannot version merged weights: drop --lora-merge-mode.")
    resolve_epoch(args)


def _transport(args: Any) -> str:
    return getattr(args, "lora_publication_transport", None) or "http"


def _stash_dir(args: Any) -> str:
    configured = getattr(args, "lora_publication_stash_dir", None)
    if configured:
        return configured
    return os.path.join(getattr(args, "save", None) or "/tmp", "lorapub")


# ---------------------------------------------------------------------------------------------
# Identities
# ---------------------------------------------------------------------------------------------


def engine_name(url: str) -> str:
    """A stable engine name from a worker URL (``http://10.0.0.7:30000`` -> ``10.0.0.7_30000``)."""
    bare = url.split("://", 1)[-1].rstrip("/")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", bare)


def version_id_for(weight_version: int | str) -> str:
    """The version id of one weight update (``DeviceDirectBackend.weight_version``)."""
    version_id = f"step{weight_version}"
    if not _ID_RE.match(version_id):
        raise ValueError(f"weight version {weight_version!r} does not make a version id")
    return version_id


def _lorapub_session_id(session_id: str) -> str:
    if _ID_RE.match(session_id):
        return session_id
    return "relax-" + hashlib.sha256(session_id.encode("utf-8")).hexdigest()[:40]


def snapshot_from_export(merged: Mapping[str, Any], config_dict: Mapping[str, Any]) -> Snapshot:
    """``LoraAdapterSync.gather_full_adapter`` output + ``LoraAdapterSync.config_dict()`` -> a frozen snapshot.

    The tensors are copied to CPU memory the snapshot owns, so training can step on while the
    version is published; the same copy feeds the digest and the transfer.
    """
    return Snapshot(dict(merged), dict(config_dict))


def error_result(exc: LorapubError) -> dict[str, Any]:
    """A typed lorapub error in the shape of Relax's ``_openai_error_result`` (code kept as is)."""
    status = {
        "NO_PUBLISHED_VERSION": 503, "VERSION_MISSING": 503, "VERSION_RECLAIMING": 503, "ENGINE_UNAVAILABLE": 503,
        "SESSION_CLOSED": 404, "SESSION_EXPIRED": 404, "OUTCOME_UNKNOWN": 504, "ENGINE_CLOSED": 503,
    }.get(exc.code, 500)
    return {
        "_http_status": status,
        "error": {"message": str(exc), "type": "lorapub_error", "param": None, "code": exc.code},
    }


# ---------------------------------------------------------------------------------------------
# Shard side
# ---------------------------------------------------------------------------------------------

_DISPATCHING: contextvars.ContextVar["RelaxLoraSession | None"] = contextvars.ContextVar(
    "lorapub_relax_dispatching", default=None
)


async def _cancel_leftover_tasks() -> None:
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def _failed(task: asyncio.Task | None) -> bool:
    return task is not None and task.done() and (task.cancelled() or task.exception() is not None)


class RelaxLoraSession:
    """What a Relax ``_SessionRecord`` holds (as ``record.lora``) while versioned publication is on.

    ``lora_path`` is ``None`` until the record's first generation reaches an engine, then the
    exact engine-side name of the bound version for the rest of the record's life.
    """

    def __init__(self, session_id: str, session: Any) -> None:
        self.session_id = session_id
        self.lora_path: str | None = None
        self.requests = 0  # backend requests that left for an engine
        self._session = session
        self._release: asyncio.Task | None = None

    @property
    def releasing(self) -> bool:
        """True once the record's close began: no request of it is sent again."""
        return self._release is not None

    @property
    def released(self) -> bool:
        """True once the session ref was released (the close finished)."""
        return self._release is not None and self._release.done() and not _failed(self._release)

    def _observe(self, lora_path: Any) -> None:
        if not lora_path:
            raise BindingChanged(f"Relax session {self.session_id!r}: a request without lora_path was refused")
        if self.lora_path is None:
            self.lora_path = lora_path
        elif lora_path != self.lora_path:
            raise BindingChanged(
                f"Relax session {self.session_id!r} is bound to {self.lora_path}, refused to send {lora_path}"
            )
        self.requests += 1

    def __repr__(self) -> str:
        return f"RelaxLoraSession({self.session_id!r}, lora_path={self.lora_path!r}, requests={self.requests})"


class _WireGuard:
    """One engine, as the deployment sees it: notes what ``lora_path`` each record's requests carry."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        record = _DISPATCHING.get()
        if record is not None:
            record._observe(payload.get("lora_path"))
        return await self._engine.generate(payload)


class RelaxLoraPublication:
    """The hooks of one Relax process (an ``AgenticSessionShard``, or the trainer's rank 0).

    It starts lazily on first use: the engines are built from ``worker_urls`` (a list, or a
    callable, sync or async, such as ``lambda: _sglang_worker_urls(args)``) unless ``engines``
    are given, and :func:`lorapub.deploy` is called with ``enabled`` from the Relax argument.
    """

    def __init__(
        self,
        args: Any,
        *,
        worker_urls: WorkerUrls | None = None,
        engines: Mapping[str, Any] | None = None,
        registry: Any = None,
        **deploy_options: Any,
    ) -> None:
        self.args = args
        self.enabled = is_enabled(args)
        if self.enabled and getattr(args, "lora_publication_epoch", None) is None:
            # Each actor picking its own epoch would split one run into several deployments.
            raise ValueError(f"{ARGUMENT}: the epoch is unset; call validate_args(args) on the driver first")
        self.epoch = resolve_epoch(args) if self.enabled else int(getattr(args, "lora_publication_epoch", None) or 0)
        self.deployment: Any = None
        self._worker_urls = worker_urls
        self._given_engines = dict(engines) if engines is not None else None
        self._built_engines: list[Any] = []
        self._registry = registry
        self._deploy_options = deploy_options
        self._start: asyncio.Task | None = None
        self._open: set[RelaxLoraSession] = set()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> "RelaxLoraPublication":
        """Idempotent; concurrent first callers share one start (a failed start is retried)."""
        if self._start is None or _failed(self._start):
            self._start = asyncio.get_running_loop().create_task(self._start_once())
        await asyncio.shield(self._start)
        return self

    async def _start_once(self) -> None:
        engines = self._given_engines if self._given_engines is not None else await self._build_engines()
        if not engines:
            raise RuntimeError("versioned LoRA publication needs at least one SGLang worker")
        stash = _stash_dir(self.args)
        if not self.enabled:
            self.deployment = await deploy(engines, epoch=self.epoch, enabled=False, stash_dir=stash)
            return
        guarded = {name: _WireGuard(engine) for name, engine in engines.items()}
        options = dict(self._deploy_options)
        registry = self._registry
        if registry is None:
            registry = await self._shared_registry(guarded)
        if registry is not None:
            options["registry"] = registry
        self.deployment = await deploy(guarded, epoch=self.epoch, enabled=True, stash_dir=stash, **options)

    async def _build_engines(self) -> dict[str, Any]:
        urls = self._worker_urls
        if callable(urls):
            urls = urls()
            if inspect.isawaitable(urls):
                urls = await urls
        from lorapub.adapters.sglang_http import SGLangEngine, SGLangOverwriteAdmin  # aiohttp: lazily
        from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine

        transport = HTTPBytes()  # one deployment sends every engine's buckets one way
        engines: dict[str, Any] = {}
        for url in sorted(set(urls or ())):
            name = engine_name(url)
            if not self.enabled:
                engines[name] = SGLangOverwriteAdmin(name, url)
            elif _transport(self.args) == "http":  # the engines stage the bytes themselves
                engines[name] = SGLangWireEngine(name, url, transport=transport)
            else:
                engines[name] = SGLangEngine(name, url, _stash_dir(self.args))
        self._built_engines = list(engines.values())
        return engines

    async def _shared_registry(self, engines: Mapping[str, Any]) -> Any:
        name = getattr(self.args, "lora_publication_registry", _DEFAULT_REGISTRY)
        if not name:
            return None  # in-process registry: one process publishes and serves sessions
        from lorapub.adapters.ray_registry import RayRegistry  # ray: lazily

        incarnations = {engine_name: await engine.incarnation() for engine_name, engine in engines.items()}
        # get-if-exists: the first process to get here creates it, every other one joins it
        return RayRegistry.create(f"{name}-{self.epoch}", self.epoch, incarnations)

    async def aclose(self) -> None:
        """Shard shutdown: release every record not yet released, close the deployment (it waits
        for reclaims and stops its background tasks), close engines."""
        if self._open:
            await asyncio.gather(*(self.release(record) for record in list(self._open)), return_exceptions=True)
        if self.deployment is not None:
            await self.deployment.close()
        for engine in self._built_engines:
            await engine.close()
        self._built_engines = []

    @property
    def open_records(self) -> tuple[RelaxLoraSession, ...]:
        """Records opened and not yet released (what :meth:`aclose` would release)."""
        return tuple(self._open)

    # -- hooks of AgenticSessionShard ----------------------------------------------------------
    async def open_session(self, session_id: str) -> RelaxLoraSession | None:
        """``_register_session``, where the record is created: OPEN, nothing bound yet.

        ``None`` with the switch off (the record keeps Relax's old request path).
        """
        if not self.enabled:
            return None
        await self.start()
        record = RelaxLoraSession(session_id, self.deployment.session(_lorapub_session_id(session_id)))
        self._open.add(record)
        return record

    async def generate(self, record: RelaxLoraSession | None, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One backend request of the record (first turn, tool turn, retry, resume), sent once.

        The first one binds the current default version; every later one carries the same
        ``lora_path``. Returns SGLang's ``/generate`` reply. Typed errors propagate as they are:
        ``NO_PUBLISHED_VERSION`` before the first publication, ``SESSION_CLOSED`` once the
        record's close began, ``OUTCOME_UNKNOWN`` when the engine did not answer (never resent).
        """
        if not self.enabled:
            raise RuntimeError(f"{ARGUMENT} is off: send with Relax's own request path")
        if record is None:
            raise SessionClosed("this Relax session record holds no lorapub session; nothing was sent")
        if record.releasing:
            raise SessionClosed(f"Relax session {record.session_id!r} is closing; nothing was sent")
        token = _DISPATCHING.set(record)
        try:
            return await record._session.generate(payload)
        finally:
            _DISPATCHING.reset(token)

    def begin_release(self, record: RelaxLoraSession | None) -> asyncio.Task | None:
        """``_discard_session_locked`` (synchronous, under the session lock): start the close now.

        From here no request of the record is sent again. The close runs in its own task, so a
        close path that later crashes or is cancelled still releases the session ref.
        """
        if record is None:
            return None
        if record._release is None or _failed(record._release):
            record._release = asyncio.get_running_loop().create_task(self._close(record))
        return record._release

    async def release(self, record: RelaxLoraSession | None) -> None:
        """``_finish_discarded_session``: wait for the record's close. Exactly once, however often called.

        The close cancels the record's requests still in flight (SGLang releases their native
        refs), then releases the session ref; the version it held is reclaimed once no session
        and no request uses it. A failed close is retried by the next call.
        """
        task = self.begin_release(record)
        if task is not None:
            await asyncio.shield(task)

    async def _close(self, record: RelaxLoraSession) -> None:
        await record._session.close()
        self._open.discard(record)

    # -- hooks of DeviceDirectBackend (async face; see BlockingRelaxLoraPublication) ------------
    async def publish(self, merged: Mapping[str, Any], config_dict: Mapping[str, Any], *, weight_version: int) -> Any:
        """Publish one adapter export. On: a :class:`lorapub.PublicationReport` (no pause, no flush).
        Off: the old overwrite of the fixed name; returns the seconds generation stood paused."""
        await self.start()
        return await self.deployment.publish(snapshot_from_export(merged, config_dict), version_id_for(weight_version))

    async def settle(self) -> None:
        """Wait for background reclaims (started by closes and commits)."""
        if self.deployment is not None:
            await self.deployment.settle()


class BlockingRelaxLoraPublication:
    """:class:`RelaxLoraPublication` for a synchronous caller (``DeviceDirectBackend`` on rank 0).

    It runs the publication on an event loop of its own, in a daemon thread, so the HTTP
    clients and the deployment live across weight updates.
    """

    def __init__(self, args: Any, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lorapub-relax", daemon=True)
        self._thread.start()
        self.publication = RelaxLoraPublication(args, **options)
        self.enabled = self.publication.enabled

    def _run(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        if self._loop.is_closed():
            raise RuntimeError("this publication was closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def publish(self, merged: Mapping[str, Any], config_dict: Mapping[str, Any], *, weight_version: int) -> Any:
        return self._run(self.publication.publish(merged, config_dict, weight_version=weight_version))

    def settle(self) -> None:
        self._run(self.publication.settle())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.publication.aclose())
        finally:
            try:  # nothing may outlive the loop as a destroyed pending task, even when aclose() failed
                self._run(_cancel_leftover_tasks())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()
