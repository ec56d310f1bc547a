"""Relax integration: immutable LoRA versions for Relax's agentic rollouts, behind one flag.

Relax (``redai-studio/Relax``) runs agentic sessions in ``AgenticSessionShard`` actors and pushes
the trained adapter from ``DeviceDirectBackend``. The hooks below are what those places call;
``docs/relax.md`` is the guide (the hook table, the switch, what lorapub needs upstream).
Written against these Relax files (:data:`RELAX_COMMITS`):

=====================================================  ===========================================
Relax site                                             lorapub hook
=====================================================  ===========================================
``AgenticSessionShard.__init__``                        ``self._lorapub = RelaxLorapub(args)``;
  (``self._generation_backend = ...``)                  ``self._generation_backend =
                                                        self._lorapub.wrap_backend(...)``
``AgenticSessionShard.start_group``                     ``await self._lorapub.open_group(group_id,
                                                        session_ids)``: one lorapub group per
                                                        Relax group, every member opened
``AgenticSessionShard._run_ir``                         unchanged: its ``self._generation_backend
  (``self._generation_backend.generate(...)``)          .generate(...)`` is the wrapper's; the
                                                        group binds at its first request
``AgenticSessionShard._apply_generate_result``          ``ir.pending_export_metadata_patch.update(
                                                        export_metadata(result.meta_info))``
``AgenticSessionShard._chat``                           unchanged: a lorapub refusal arrives as an
                                                        ``AgenticChatRequestError`` keeping its code
``AgenticSessionShard._finish_session_once``            ``await self._lorapub.release(session_id)``
``AgenticSessionShard._drop_group``                     ``await self._lorapub.release_group(group_id)``
``AgenticSessionShard._shutdown``                       unchanged: ``self._generation_backend
                                                        .shutdown()`` closes lorapub first
``DeviceDirectBackend.__init__``                        ``install_weight_path(self)``: an opt-in
                                                        ``update_weights_for_rollout`` that
                                                        publishes each adapter as a version
``relax/utils/arguments.py``                            :func:`add_arguments` (last in the chain),
                                                        :func:`validate_args` on the driver
=====================================================  ===========================================

Off (the default) nothing changes: :meth:`RelaxLorapub.wrap_backend` returns Relax's own backend,
:func:`install_weight_path` leaves ``update_weights_for_rollout`` alone and every other hook
returns at once. Importing this module needs neither Relax, Megatron, Ray, torch nor aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import inspect
import json
import logging
import re
import socket
import threading
import time
import uuid
from typing import Any, Awaitable, Callable, Mapping, Sequence, Union

from lorapub import (
    CapacityError,
    Deployment,
    EngineError,
    LorapubError,
    PublicationBlocked,
    PublicationSuperseded,
    SessionClosed,
    Snapshot,
)

log = logging.getLogger(__name__)

__all__ = [
    "CONFIG_FLAG", "ENABLE_FLAG", "DEFAULT_NAME_PREFIX", "RELAX_ADAPTER_NAME", "RELAX_COMMITS", "RELAX_NAME_FAMILIES",
    "RELAX_OPTIONS", "GenerateResult", "LorapubConfig", "LorapubGenerationBackend", "LorapubPublisher",
    "LorapubWeightPath", "OptionClash", "PublishOutcome", "RelaxChatError", "RelaxLorapub", "WeightPublicationFailed",
    "add_arguments", "chat_error", "check_name_prefix", "check_parser", "config_from_args", "engine_env",
    "engine_name", "error_result", "export_metadata", "install_weight_path", "is_enabled", "max_over", "sglang_overrides",
    "topology_urls", "validate_args", "version_id_for",
]

#: The Relax files (and the commits of them) these hooks were written against.
RELAX_COMMITS: dict[str, str] = {
    "relax/agentic/session/service.py": "29f596af1fdcb6f045577f0b1d3eb28ed932da6d",
    "relax/agentic/session/state.py": "29f596af1fdcb6f045577f0b1d3eb28ed932da6d",
    "relax/agentic/pipeline/runtime.py": "b71db72d4370f8cb0e26fafbc5864fe46539a4e1",
    "relax/distributed/checkpoint_service/backends/device_direct.py": "0a91dd1db44022920f61f05948e89a5cb83f8b38",
    "relax/backends/megatron/weight_update/lora_adapter_sync.py": "b71db72d4370f8cb0e26fafbc5864fe46539a4e1",
    "relax/utils/megatron_peft_utils.py": "0a91dd1db44022920f61f05948e89a5cb83f8b38",
    "relax/utils/arguments.py": "02bf712a9e601780904cede4ed5ec3b662eeb929",
}

# ---------------------------------------------------------------------------------------------
# Names: lorapub's options and engine-side names never collide with Relax's
# ---------------------------------------------------------------------------------------------

#: The switch, and the file holding the one configuration block (:class:`LorapubConfig`).
ENABLE_FLAG = "--enable-lorapub"
CONFIG_FLAG = "--lorapub-config"
_ENABLE_DEST, _CONFIG_DEST = "enable_lorapub", "lorapub_config"
#: Where :func:`validate_args` leaves the resolved configuration for every actor (``args`` travels).
_RESOLVED = "lorapub_resolved"

#: Relax's fixed adapter name in adapter mode (``relax/utils/megatron_peft_utils.py``, ``LORA_ADAPTER_NAME``).
RELAX_ADAPTER_NAME = "relax_policy_lora"
#: Engine-side names of the Relax family; lorapub's prefix may neither start one nor fall inside one.
RELAX_NAME_FAMILIES: dict[str, str] = {
    RELAX_ADAPTER_NAME: "Relax's fixed adapter name in adapter mode (LORA_ADAPTER_NAME, relax/utils/megatron_peft_utils.py)",
    "relax_policy_lora@": "the versioned names of Relax PR #377's first design (relax_policy_lora@{epoch}-{id}-{digest})",
    "relax_policy@": "the binding names of Relax PR #377's redesign (relax_policy@<version_id>)",
}
#: Options of the same family in Relax designs (PR #377): lorapub's must not clash with them either.
RELAX_OPTIONS: dict[str, str] = {
    "--enable-versioned-lora-publication": "Relax PR #377's first design (its switch)",
    "--lora-publication-bucket-size": "Relax PR #377's first design",
    "--lora-publication-config": "Relax PR #377's redesign (its publication YAML)",
}
#: lorapub's engine-side prefix for Relax runs: owned by lorapub, outside every Relax name family.
DEFAULT_NAME_PREFIX = "lorapub@"
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}@")
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # lorapub's rule for session, group and version ids
TRANSPORTS = ("auto", "http", "ipc", "gloo", "nccl")


class OptionClash(ValueError):
    """lorapub's option or engine-side name prefix would collide with one already defined."""


def check_name_prefix(prefix: object) -> str:
    """``prefix`` when lorapub may name its versions with it on Relax's engines; else :class:`OptionClash`
    (or ``ValueError`` for a malformed one), naming the Relax name it collides with."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(
            f"name_prefix must be 1-64 characters of [A-Za-z0-9_.:-] followed by '@' (ids never hold '@', so a "
            f"version's name starts with exactly one managed prefix), got {prefix!r}"
        )
    for family, what in RELAX_NAME_FAMILIES.items():
        if family.startswith(prefix):
            raise OptionClash(
                f"name_prefix {prefix!r} clashes with {family!r}, {what}: every name starting with {prefix!r} is "
                f"managed by lorapub (its SGLang patch refuses their unload and overwrite), and {family!r} would be "
                f"one. Keep the default {DEFAULT_NAME_PREFIX!r} or choose a prefix outside Relax's names"
            )
        if prefix.startswith(family):
            raise OptionClash(
                f"name_prefix {prefix!r} clashes with {family!r}, {what}: lorapub's versions would be named inside "
                f"Relax's family and taken for Relax's own adapters. Keep the default {DEFAULT_NAME_PREFIX!r} or "
                "choose a prefix outside Relax's names"
            )
    return prefix


def _clashes(ours: str, existing: str) -> bool:
    return ours == existing or ours.startswith(existing) or existing.startswith(ours)


def check_parser(parser: argparse.ArgumentParser) -> None:
    """Refuse (:class:`OptionClash`) when ``parser`` already defines one of lorapub's options, an option
    whose name is a prefix of one of them (or has one of them as its prefix: with abbreviations on,
    argparse would take one for the other), or an option writing to the same ``args`` attribute."""
    ours = {ENABLE_FLAG: _ENABLE_DEST, CONFIG_FLAG: _CONFIG_DEST}
    for flag, dest in ours.items():
        for existing, action in parser._option_string_actions.items():
            if not existing.startswith("--"):
                continue
            if _clashes(flag, existing):
                what = RELAX_OPTIONS.get(existing, "already defined on this parser")
                kind = "is already defined" if flag == existing else "is prefix-conflicting"
                raise OptionClash(
                    f"lorapub's option {flag} clashes with {existing} ({what}): {existing} {kind}; an argument "
                    f"parser must never take one for the other. lorapub registers nothing on this parser"
                )
            if action.dest == dest:
                raise OptionClash(
                    f"lorapub's option {flag} writes args.{dest}, which {existing} already writes; lorapub "
                    "registers nothing on this parser"
                )


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``--enable-lorapub`` and ``--lorapub-config``; returns ``parser`` (Relax chains
    ``parser = add_x_arguments(parser)``). Chain it last, so the clash check sees every option."""
    check_parser(parser)
    group = parser.add_argument_group(title="lorapub (versioned LoRA publication)")
    group.add_argument(
        ENABLE_FLAG, dest=_ENABLE_DEST, action="store_true", default=False,
        help=(
            "Publish every LoRA adapter update as an immutable version beside the old one (lorapub) instead of "
            "pausing generation, flushing the KV cache and overwriting the one fixed adapter. A rollout group binds "
            "one version at its first request and keeps it for every turn, abort and resume. Needs "
            "--lora-adapter-mode and SGLang servers running lorapub's patch. Off by default."
        ),
    )
    group.add_argument(
        CONFIG_FLAG, dest=_CONFIG_DEST, type=str, default=None,
        help="YAML or JSON file with lorapub's settings (docs/relax.md lists them); every key has a default.",
    )
    return parser


# ---------------------------------------------------------------------------------------------
# The configuration block
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LorapubConfig:
    """lorapub's settings for a Relax run (the ``--lorapub-config`` file; every key optional)."""

    #: Engine-side name prefix of lorapub's versions (see :func:`check_name_prefix`).
    name_prefix: str = DEFAULT_NAME_PREFIX
    #: Deployment epoch; unset: fixed once by :func:`validate_args` from the clock.
    epoch: int | None = None
    #: Managed versions held at once; SGLang needs ``capacity + 1`` of max_loras_per_batch and max_loaded_loras.
    capacity: int = 2
    #: A version more than this many commits behind the default is retiring (None: sessions keep theirs).
    max_lag: int | None = None
    on_stale: str = "error"
    #: Seconds without a generation after which a session expires in a live shard (None: never; Relax
    #: ends every record through ``_finish_session_once``, and a group may wait long behind the train gate).
    idle_ttl: float | None = None
    #: Seconds a publication waits for a free slot; a newer one supersedes it meanwhile.
    publish_wait: float = 600.0
    #: The training step does not wait for its publication (it runs on rank 0's publication thread).
    background_publish: bool = True
    #: How adapter bytes reach the engines: auto (nccl when the trainer ranks have GPUs of their own, else
    #: http), http, ipc (same host), gloo, nccl.
    transport: str = "auto"
    #: Address the engines reach rank 0 at for gloo/nccl (default: this host's address).
    transport_host: str | None = None
    #: Ray actor name of lorapub's registry shared by the trainer and every shard ("": in-process).
    registry: str = "lorapub_relax_registry"
    #: A SQLite file for the registry's decisions (durable across a registry restart); None: in memory.
    registry_store: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None

    def __post_init__(self) -> None:
        check_name_prefix(self.name_prefix)
        if self.epoch is not None and (not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 0):
            raise ValueError(f"epoch must be a non-negative int, got {self.epoch!r}")
        if not isinstance(self.capacity, int) or isinstance(self.capacity, bool) or self.capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {self.capacity!r}")
        if self.on_stale not in ("error", "rebind"):
            raise ValueError(f"on_stale must be 'error' or 'rebind', got {self.on_stale!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not isinstance(self.publish_wait, (int, float)) or isinstance(self.publish_wait, bool) or self.publish_wait < 0:
            raise ValueError(f"publish_wait must be a number of seconds >= 0, got {self.publish_wait!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "LorapubConfig":
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown lorapub setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str) -> "LorapubConfig":
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml  # Relax's own dependency; lorapub's only where a YAML file is given

            values = yaml.safe_load(text)
        if values is not None and not isinstance(values, Mapping):
            raise ValueError(f"{path}: lorapub's settings are a mapping, got {type(values).__name__}")
        return cls.from_mapping(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_enabled(args: Any) -> bool:
    return bool(getattr(args, _ENABLE_DEST, False))


def config_from_args(args: Any) -> LorapubConfig | None:
    """lorapub's settings for this run; None with the switch off."""
    if not is_enabled(args):
        return None
    resolved = getattr(args, _RESOLVED, None)
    if resolved is not None:
        return LorapubConfig.from_mapping(resolved)
    path = getattr(args, _CONFIG_DEST, None)
    return LorapubConfig.from_file(path) if path else LorapubConfig()


def validate_args(args: Any) -> LorapubConfig | None:
    """On the driver, before any actor gets ``args`` (Relax's ``slime_validate_args``): check the run,
    fix the epoch once, and leave the resolved settings on ``args`` for every actor."""
    config = config_from_args(args)
    if config is None:
        return None
    if not getattr(args, "lora_rank", 0) or not getattr(args, "lora_adapter_mode", False):
        raise ValueError(f"{ENABLE_FLAG} publishes LoRA adapters: it needs --lora-rank > 0 and --lora-adapter-mode")
    if getattr(args, "lora_merge_mode", False):
        raise ValueError(f"{ENABLE_FLAG} cannot version merged weights: drop --lora-merge-mode")
    for dest, flag in (("enable_versioned_lora_publication", "--enable-versioned-lora-publication"),
                       ("lora_publication_config", "--lora-publication-config")):
        if getattr(args, dest, None):
            raise ValueError(
                f"{ENABLE_FLAG} and {flag} ({RELAX_OPTIONS[flag]}) both publish LoRA versions to the same engines; "
                "turn one of them off"
            )
    if config.epoch is None:
        config = dataclasses.replace(config, epoch=int(time.time()))
    setattr(args, _RESOLVED, config.to_dict())
    return config


def sglang_overrides(config: LorapubConfig) -> dict[str, int]:
    """SGLang server settings lorapub needs (Relax launches with 1 and 2: put these in ``--sglang-config``)."""
    return {"max_loras_per_batch": config.capacity + 1, "max_loaded_loras": config.capacity + 1}


def engine_env(config: LorapubConfig) -> dict[str, str]:
    """Environment of each SGLang server: its lorapub patch protects exactly lorapub's prefix."""
    return {"SGLANG_LORAPUB_MANAGED_PREFIX": config.name_prefix}


# ---------------------------------------------------------------------------------------------
# Identities
# ---------------------------------------------------------------------------------------------


def engine_name(url: str) -> str:
    """A stable engine name from a worker URL (``http://10.0.0.7:30000`` -> ``10.0.0.7_30000``)."""
    bare = url.split("://", 1)[-1].rstrip("/")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", bare)


def version_id_for(step: int | str) -> str:
    """The version id of one weight update: ``step<rollout_id>``."""
    version_id = f"step{step}"
    if not _ID_RE.fullmatch(version_id):
        raise ValueError(f"step {step!r} does not make a version id")
    return version_id


def _safe_id(value: str, kind: str, limit: int = 128) -> str:
    if _ID_RE.fullmatch(value) and len(value) <= limit:
        return value
    return f"{kind}-" + hashlib.sha256(value.encode("utf-8")).hexdigest()[:40]


def topology_urls(backend: Any) -> list[str]:
    """The rollout engines' URLs from ``DeviceDirectBackend.rollout_topology`` (rank -> {ip, port})."""
    topology = getattr(backend, "rollout_topology", None) or {}
    return [f"http://{info['ip']}:{info['port']}" for _, info in sorted(topology.items(), key=lambda kv: int(kv[0]))]


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# Errors in Relax's shape
# ---------------------------------------------------------------------------------------------

_CHAT_STATUS = {
    "NO_PUBLISHED_VERSION": 503, "VERSION_MISSING": 503, "VERSION_RECLAIMING": 503, "ENGINE_UNAVAILABLE": 503,
    "ENGINE_CLOSED": 503, "BINDING_STALE": 410, "SESSION_EXPIRED": 410, "GROUP_CLOSED": 410, "SESSION_CLOSED": 404,
    "OUTCOME_UNKNOWN": 504, "ENGINE_ERROR": 502, "INVALID_INPUT": 400,
}
_CONTEXT_MARKERS = ("maximum context length", "Requested token count exceeds")


class RelaxChatError(Exception):
    """Shaped like Relax's ``AgenticChatRequestError`` (same constructor and attributes), for where
    that class is not at hand; the shard passes Relax's own to :meth:`RelaxLorapub.wrap_backend`."""

    def __init__(
        self,
        message,
        *,
        code="invalid_request_error",
        param=None,
        status_code=400,
        error_type="invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = message
        self.code = code
        self.param = param
        self.status_code = status_code
        self.error_type = error_type


def chat_error(exc: LorapubError, error_type: type | None = None) -> Exception:
    """A lorapub error as Relax's chat error: ``_chat`` answers it with its status and code kept (never
    a 500, never a group drop). The lorapub error is its ``__cause__`` and ``lorapub_error``."""
    cls = error_type or RelaxChatError
    error = cls(
        str(exc), code=exc.code, param=None, status_code=_CHAT_STATUS.get(exc.code, 500), error_type="lorapub_error"
    )
    error.__cause__ = exc
    try:
        error.lorapub_error = exc
    except AttributeError:  # a class with __slots__
        pass
    return error


def error_result(exc: LorapubError) -> dict[str, Any]:
    """What Relax's ``_error_from_exception`` makes of :func:`chat_error` (its error-result dict)."""
    error = chat_error(exc)
    return {
        "_http_status": error.status_code,
        "error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.code},
    }


def export_metadata(meta_info: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance of one generation, for the exported sample's metadata (``{"lorapub": {...}}``:
    version, version_id, lag, lora_name, rebinds); empty when lorapub did not serve it."""
    provenance = meta_info.get("lorapub") if isinstance(meta_info, Mapping) else None
    return {"lorapub": dict(provenance)} if provenance else {}


# ---------------------------------------------------------------------------------------------
# The shard side
# ---------------------------------------------------------------------------------------------

WorkerUrls = Union[Sequence[str], Callable[[], Union[Sequence[str], Awaitable[Sequence[str]]]]]


def _failed(task: asyncio.Task | None) -> bool:
    return task is not None and task.done() and (task.cancelled() or task.exception() is not None)


@dataclasses.dataclass
class _Group:
    key: str  # the lorapub group: one per start_group, so a reused Relax group id starts afresh
    members: dict[str, Any]


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
        engines: Mapping[str, Any] | None = None,
        registry: Any = None,
        role: str = "shard",
        **deployment_options: Any,
    ) -> None:
        self.args = args
        self.config = config if config is not None else config_from_args(args)
        self.enabled = self.config is not None
        if self.enabled and self.config.epoch is None:
            # Each actor picking its own epoch would split one run into several deployments.
            raise ValueError(f"{ENABLE_FLAG}: the epoch is unset; call validate_args(args) on the driver first")
        if role not in ("shard", "trainer"):
            raise ValueError(f"role must be 'shard' or 'trainer', got {role!r}")
        self.role = role
        self.deployment: Any = None
        #: Whether the deployment names versions with ``config.name_prefix`` (None until started).
        self.name_prefix_applied: bool | None = None
        self._worker_urls = worker_urls
        self._given_engines = dict(engines) if engines is not None else None
        self._built_engines: list[Any] = []
        self._registry = registry
        self._deployment_options = deployment_options
        self._start: asyncio.Task | None = None
        self._groups: dict[str, _Group] = {}
        self._members: dict[str, Any] = {}
        self._closed = False

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
        engines = self._given_engines if self._given_engines is not None else await self._build_engines()
        if not engines:
            raise RuntimeError("lorapub needs at least one SGLang worker")
        config = self.config
        options: dict[str, Any] = {"capacity": config.capacity, "max_lag": config.max_lag,
                                   "on_stale": config.on_stale, "idle_ttl": config.idle_ttl}
        options.update(self._deployment_options)
        # the engines' SGLang must protect the same prefix (engine_env(): SGLANG_LORAPUB_MANAGED_PREFIX);
        # Deployment.start() refuses an engine that protects another
        self.name_prefix_applied = _takes(Deployment, "name_prefix")
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
        self.deployment = await Deployment(engines, epoch=config.epoch, **options).start()

    async def _build_engines(self) -> dict[str, Any]:
        urls = self._worker_urls
        if callable(urls):
            urls = urls()
            if inspect.isawaitable(urls):
                urls = await urls
        from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine  # aiohttp: lazily

        transport = _make_transport(self.config, self.args) if self.role == "trainer" else HTTPBytes()
        engines = {
            engine_name(url): SGLangWireEngine(
                engine_name(url), url, transport=transport,
                api_key=self.config.api_key, admin_api_key=self.config.admin_api_key,
            )
            for url in sorted(set(urls or ()))
        }
        self._built_engines = list(engines.values())
        return engines

    async def _shared_registry(self, engines: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        if not self.config.registry:
            return None  # in-process: one process publishes and serves sessions
        from lorapub.adapters.ray_registry import RayRegistry  # ray: lazily

        incarnations = {name: await engine.incarnation() for name, engine in engines.items()}
        extra = {"name_prefix": self.config.name_prefix} if _takes(RayRegistry.create, "name_prefix") else {}
        # get-if-exists: the first process to get here creates it (with these settings), every other joins it
        return RayRegistry.create(
            f"{self.config.registry}-{self.config.epoch}", self.config.epoch, incarnations,
            capacity=options["capacity"], store_path=self.config.registry_store, max_lag=options["max_lag"],
            on_stale=options["on_stale"], **extra,
        )

    async def aclose(self) -> None:
        """``_shutdown``: release every member still open, stop the deployment, close the engines."""
        self._closed = True
        if self._members:
            await asyncio.gather(*(self._close(sid) for sid in list(self._members)), return_exceptions=True)
        self._groups.clear()
        if self.deployment is not None:
            await self.deployment.close()
        for engine in self._built_engines:
            await engine.close()
        self._built_engines = []

    # -- hooks of AgenticSessionShard ----------------------------------------------------------
    async def open_group(self, group_id: str, session_ids: Sequence[str]) -> None:
        """``start_group``: one lorapub group for the Relax group, every member opened now, so the
        group keeps the version it binds at its first request while any member is open."""
        if not self.enabled:
            return
        await self.start()
        if group_id in self._groups:
            raise ValueError(f"Relax group {group_id!r} is already open in lorapub")
        key = f"{_safe_id(group_id, 'group', 100)}.{uuid.uuid4().hex[:8]}"
        members = {sid: self.deployment.session(_safe_id(sid, "session"), group=key) for sid in session_ids}
        self._groups[group_id] = _Group(key, members)
        self._members.update(members)
        await asyncio.gather(*(member.open() for member in members.values()))

    def member(self, session_id: str) -> Any:
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
        return await member.generate(payload)

    async def release(self, session_id: str) -> None:
        """``_finish_session_once``, once the session's requests are aborted and joined: release its
        ref exactly once. A failure is logged: its lease expires and the version is reclaimed anyway."""
        if self.enabled:
            await self._close(session_id)

    async def release_group(self, group_id: str) -> None:
        """``_drop_group``: release every member of the group not released yet, forget the group."""
        if not self.enabled:
            return
        group = self._groups.pop(group_id, None)
        if group is not None:
            await asyncio.gather(*(self._close(sid) for sid in group.members))

    async def _close(self, session_id: str) -> None:
        member = self._members.pop(session_id, None)
        if member is None:
            return
        try:
            await member.close()
        except LorapubError as e:
            log.warning("lorapub: releasing Relax session %s failed (its lease will expire): %s", session_id, e)

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

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

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
            output = await self.lorapub.generate(session_id, payload)
        except EngineError as e:
            if e.details.get("status") == 400 and any(m in str(e) for m in _CONTEXT_MARKERS):
                if self._context_length_error_type is not None:
                    raise self._context_length_error_type(str(e)) from e
            raise chat_error(e, self._chat_error_type) from e
        except LorapubError as e:
            raise chat_error(e, self._chat_error_type) from e
        return self._result(output, time.monotonic() - started)

    def _result(self, output: Mapping[str, Any], elapsed: float) -> Any:
        meta_info = dict(output.get("meta_info") or {})
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


# ---------------------------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------------------------


def _make_transport(config: LorapubConfig, args: Any) -> Any:
    from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, TorchDistributed

    kind = config.transport
    if kind == "auto":
        kind = "http"
        if not getattr(args, "colocate", False):  # the trainer ranks have GPUs of their own
            try:
                import torch

                if torch.cuda.is_available():
                    kind = "nccl"
            except ImportError:
                pass
    if kind == "http":
        return HTTPBytes()
    if kind == "ipc":
        return SameHostIPC()
    host = config.transport_host or socket.gethostbyname(socket.gethostname())
    if kind == "nccl":
        return TorchDistributed(host=host, backend="nccl", device="cuda")
    return TorchDistributed(host=host, backend="gloo")


async def _cancel_leftover_tasks() -> None:
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


class LorapubPublisher:
    """Rank 0's publication: :class:`RelaxLorapub` (``role="trainer"``) on an event loop of its own, in a
    daemon thread, so the engines' clients and the deployment live across weight updates and a
    publication runs beside training."""

    def __init__(self, args: Any, **options: Any) -> None:
        self.lorapub = RelaxLorapub(args, role="trainer", **options)
        self.enabled = self.lorapub.enabled
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lorapub-relax-publisher", daemon=True)
        self._thread.start()

    @property
    def deployment(self) -> Any:
        return self.lorapub.deployment

    def _run(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return self._submit(coro).result(timeout)

    def _submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this publisher was closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _publish(self, snapshot: Snapshot, version_id: str) -> Any:
        await self.lorapub.start()
        return await self.lorapub.deployment.publish(snapshot, version_id, wait=self.lorapub.config.publish_wait)

    def submit(self, snapshot: Snapshot, version_id: str) -> concurrent.futures.Future:
        """Start publishing; the future gives the :class:`lorapub.PublicationReport` or the typed error."""
        return self._submit(self._publish(snapshot, version_id))

    def publish(self, snapshot: Snapshot, version_id: str, timeout: float | None = None) -> Any:
        return self.submit(snapshot, version_id).result(timeout)

    def settle(self) -> None:
        """Wait for background reclaims."""
        if self.deployment is not None:
            self._run(self.deployment.settle())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.lorapub.aclose())
        finally:
            try:  # nothing may outlive the loop as a destroyed pending task
                self._run(_cancel_leftover_tasks())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()


@dataclasses.dataclass
class PublishOutcome:
    """One weight update's publication, as rank 0 saw it."""

    version_id: str
    digest: str
    status: str = "pending"  # pending, published, superseded, deferred, failed
    report: Any = None
    error: BaseException | None = None


class WeightPublicationFailed(RuntimeError):
    """A publication failed (not superseded, not waiting for a slot): raised on every rank, like
    Relax's own failed adapter push."""


def _default_rank() -> int:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def max_over(group: Any = None) -> Callable[[int], int]:
    """``share_verdict`` for a multi-rank trainer: a MAX all-reduce of the failure flag over ``group``
    (Relax's gloo group, ``get_gloo_group()``), as Relax shares its own adapter-push verdict."""

    def share(flag: int) -> int:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return int(tensor.item())

    return share


def _default_params(backend: Any) -> dict[str, Any]:
    # DeviceDirectBackend._push_lora_adapter_distributed reads the parameters this way
    return dict(backend._megatron.named_params_and_buffers(backend.args, backend.model, convert_to_global_name=False))


class LorapubWeightPath:
    """The opt-in ``DeviceDirectBackend.update_weights_for_rollout`` with lorapub on (every rank runs it:
    the adapter export and gather are collective; rank 0 publishes).

    * The first update is Relax's own: it syncs the base under pause (once); then its adapter becomes the
      first version.
    * Every later update publishes the adapter as ``step<rollout_id>`` (``step<weight_version>`` when the
      caller gives no rollout id): the tensors ``export_local_adapter``/``gather_full_adapter`` give and
      ``config_dict()``, frozen in one :class:`lorapub.Snapshot` — the bytes Relax would have pushed —
      sent over lorapub's wire, with no pause and no flush. Relax's actor_fwd/reference sync still runs
      (Relax's own path with ``actor_fwd_only=True``, which pauses nothing).
    * A superseded publication (a newer step took its place while it waited for a slot) is logged; so is
      one still waiting for a slot when the wait ends. Neither fails the step. Any other failure raises
      :class:`WeightPublicationFailed` on every rank (``share_verdict``: a MAX over the ranks), at this
      update with ``background_publish`` off, at the next one with it on.
    """

    def __init__(
        self,
        backend: Any,
        publisher: LorapubPublisher | Callable[[], LorapubPublisher] | None,
        *,
        original: Callable[..., None],
        rank: Callable[[], int] | None = None,
        share_verdict: Callable[[int], int] | None = None,
        params: Callable[[Any], dict[str, Any]] | None = None,
        background: bool | None = None,
    ) -> None:
        self.backend = backend
        self._publisher = publisher
        self._original = original
        self._rank = rank or _default_rank
        self._share_verdict = share_verdict
        self._params = params or _default_params
        config = config_from_args(backend.args)
        self.background = config.background_publish if background is None else background
        self.outcomes: list[PublishOutcome] = []
        self._published_once = False
        self._unreported: list[PublishOutcome] = []
        self._lock = threading.Lock()

    @property
    def publisher(self) -> LorapubPublisher:
        """Rank 0's publisher, made at its first publication (from ``rollout_topology`` by default)."""
        if not isinstance(self._publisher, LorapubPublisher):
            if self._publisher is not None:
                self._publisher = self._publisher()
            else:
                self._publisher = LorapubPublisher(self.backend.args, worker_urls=lambda: topology_urls(self.backend))
        return self._publisher

    def update_weights_for_rollout(self, rollout_only=False, actor_fwd_only=False, *, rollout_id=None) -> None:
        backend = self.backend
        if actor_fwd_only or not backend._lora_sync.base_sync_done:
            self._original(rollout_only, actor_fwd_only)  # actor_fwd only, or the first (base) sync: Relax's own
            if actor_fwd_only:
                return
        elif not rollout_only:
            self._original(False, True)  # actor_fwd/reference: Relax's path; actor_fwd_only pauses nothing
        else:
            backend.weight_version += 1  # what Relax's path counts for every update
        self._publish(rollout_id)

    def _publish(self, rollout_id: Any) -> None:
        backend = self.backend
        sync = backend._lora_sync
        all_params = self._params(backend)
        unchanged, new_state = sync.should_skip(all_params)  # collective
        failed = 0
        if unchanged and self._published_once:
            log.debug("lorapub: adapter unchanged on every rank; nothing to publish")
        else:
            local_adapter = sync.export_local_adapter(all_params)  # collective
            merged = sync.gather_full_adapter(local_adapter, all_gather=False)  # collective; None off rank 0
            if self._rank() == 0:
                snapshot = Snapshot(merged, sync.config_dict())  # a frozen CPU copy: training may step on
                step = rollout_id if rollout_id is not None else backend.weight_version
                failed = self._submit(snapshot, version_id_for(step))
            self._published_once = True
            sync.adapter_loaded = True
        sync.prev_state = new_state
        if self._rank() == 0:
            failed = max(failed, self._take_background_failures())
        if self._share_verdict is not None:
            failed = int(self._share_verdict(int(failed)))
        if failed:
            errors = [o for o in self.outcomes if o.status == "failed"]
            cause = errors[-1].error if errors else None
            raise WeightPublicationFailed(
                "lorapub: publishing the LoRA adapter failed; the previous version stays the default and sessions "
                f"keep theirs ({cause or 'failed on rank 0'})"
            ) from cause

    def _submit(self, snapshot: Snapshot, version_id: str) -> int:
        outcome = PublishOutcome(version_id, snapshot.digest)
        with self._lock:
            self.outcomes.append(outcome)
        future = self.publisher.submit(snapshot, version_id)
        if self.background:
            future.add_done_callback(lambda f: self._settled(outcome, f, background=True))
            return 0
        try:
            future.result()
        except BaseException:  # classified below
            pass
        self._settled(outcome, future, background=False)
        return int(outcome.status == "failed")

    def _settled(self, outcome: PublishOutcome, future: concurrent.futures.Future, *, background: bool) -> None:
        try:
            outcome.report = future.result()
            outcome.status = "published"
            log.info("lorapub: published %s as %s", outcome.version_id, outcome.report.lora_name)
            return
        except PublicationSuperseded as e:
            outcome.status, outcome.error = "superseded", e
            log.info("lorapub: %s was superseded by a newer step before it got a slot: %s", outcome.version_id, e)
        except (CapacityError, PublicationBlocked) as e:
            outcome.status, outcome.error = "deferred", e
            log.warning("lorapub: %s found no slot within the wait (sessions hold the versions); a later step "
                        "publishes: %s", outcome.version_id, e)
        except BaseException as e:  # noqa: BLE001 - reported on every rank by the next update
            outcome.status, outcome.error = "failed", e
            log.error("lorapub: publishing %s failed: %r", outcome.version_id, e)
            if background:
                with self._lock:
                    self._unreported.append(outcome)

    def _take_background_failures(self) -> int:
        with self._lock:
            failed, self._unreported = bool(self._unreported), []
        return int(failed)

    def wait(self, timeout: float | None = None) -> list[PublishOutcome]:
        """Wait until every publication submitted so far has settled (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(o.status == "pending" for o in self.outcomes):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("lorapub publications still pending")
            time.sleep(0.01)
        return list(self.outcomes)

    def close(self) -> None:
        if isinstance(self._publisher, LorapubPublisher):
            self._publisher.close()


def install_weight_path(
    backend: Any,
    publisher: LorapubPublisher | Callable[[], LorapubPublisher] | None = None,
    *,
    rank: Callable[[], int] | None = None,
    share_verdict: Callable[[int], int] | None = None,
    params: Callable[[Any], dict[str, Any]] | None = None,
    background: bool | None = None,
) -> LorapubWeightPath | None:
    """Opt in, on every rank: with lorapub on, ``backend.update_weights_for_rollout`` becomes
    :meth:`LorapubWeightPath.update_weights_for_rollout` (rank 0 builds its publisher lazily, from
    ``backend.rollout_topology`` unless one is given). Off: ``None``, and the backend is untouched."""
    if not is_enabled(backend.args):
        return None
    path = LorapubWeightPath(
        backend, publisher, original=backend.update_weights_for_rollout, rank=rank,
        share_verdict=share_verdict, params=params, background=background,
    )
    backend.update_weights_for_rollout = path.update_weights_for_rollout
    return path
