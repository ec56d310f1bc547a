"""Relax's side of the switch: lorapub's flags, its one configuration block, the names and
ids it hands Relax, and the transport the configuration picks."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import re
import socket
import time
from typing import Any, Callable, Mapping

from lorapub import InvalidInput
from lorapub.ports import Transport


__all__ = ['CONFIG_FLAG', 'DEFAULT_NAME_PREFIX', 'ENABLE_FLAG', 'LorapubConfig', 'MAX_STALENESS', 'OptionClash', 'RELAX_ADAPTER_NAME', 'RELAX_NAME_FAMILIES', 'RELAX_OPTIONS', 'TRANSPORTS', 'add_arguments', 'check_name_prefix', 'check_parser', 'config_from_args', 'engine_env', 'engine_name', 'is_enabled', 'sglang_overrides', 'topology_urls', 'validate_args', 'version_id_for']

# ---------------------------------------------------------------------------------------------
# Names: lorapub's options and engine-side names never collide with Relax's
# ---------------------------------------------------------------------------------------------

#: The switch, and the file holding the one configuration block (:class:`LorapubConfig`).
ENABLE_FLAG = "--enable-lorapub"
CONFIG_FLAG = "--lorapub-config"
_ENABLE_DEST, _CONFIG_DEST = "enable_lorapub", "lorapub_config"
#: Where :func:`validate_args` leaves the resolved configuration for every actor (``args`` travels).
RESOLVED_ATTR = "lorapub_resolved"

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
ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # lorapub's rule for session, group and version ids
TRANSPORTS = ("auto", "http", "ipc", "gloo", "nccl")
#: ``max_lag``'s default: Relax's own ``--max-staleness`` (``args.max_staleness``).
MAX_STALENESS = "max_staleness"
#: Relax's default ``--max-staleness`` (training takes data of the current or the previous version).
RELAX_DEFAULT_MAX_STALENESS = 1


class OptionClash(InvalidInput):
    """lorapub's option or engine-side name prefix would collide with one already defined."""


def check_name_prefix(prefix: object) -> str:
    """``prefix`` when lorapub may name its versions with it on Relax's engines; else :class:`OptionClash`
    (or ``InvalidInput`` for a malformed one; both are ``INVALID_INPUT``), naming the Relax name it collides with."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise InvalidInput(
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
    #: Managed versions held at once (None: ``max_lag + 2``, the fewest that serve it, and at least 2). A
    #: Relax run's SGLang needs ``capacity + 2`` of max_loras_per_batch and max_loaded_loras (:func:`sglang_overrides`).
    capacity: int | None = None
    #: A version more than this many commits behind the default is retiring (None: sessions keep theirs).
    #: ``"max_staleness"``: Relax's own ``--max-staleness`` (one publication per step: commits are steps).
    max_lag: int | str | None = MAX_STALENESS
    #: What a session whose version retired does at its next turn: ``rebind`` moves its whole group to the
    #: default at that turn boundary (counted as a cut trajectory); ``error`` ends it with BINDING_STALE.
    on_stale: str = "rebind"
    #: Seconds without a generation after which a session expires in a live shard (None: never; Relax
    #: ends every record through ``_finish_session_once``, and a group may wait long behind the train gate).
    idle_ttl: float | None = None
    #: Seconds a session's request waits for the trainer's first version before NO_PUBLISHED_VERSION.
    first_version_wait: float = 600.0
    #: Seconds between two looks at the router's workers from a shard (None: never; its first list stays).
    worker_refresh: float | None = 10.0
    #: Seconds a worker that left the router's list is drained before it is removed.
    drain_wait: float = 300.0
    #: Seconds a publication waits for a free slot; a newer one supersedes it meanwhile.
    publish_wait: float = 600.0
    #: The training step does not wait for its publication (it runs on rank 0's publication thread).
    background_publish: bool = True
    #: How adapter bytes reach the engines: auto (http: the transport every live run used), http, ipc (same
    #: host: shared memory), gloo, nccl (by name only: not run live on GPUs yet).
    transport: str = "auto"
    #: Address the engines reach rank 0 at for gloo/nccl (default: this host's address).
    transport_host: str | None = None
    #: Ray actor name of lorapub's registry shared by the trainer and every shard ("": in-process, for
    #: engines given to RelaxLorapub in one process; refused where lorapub builds them from Relax's workers).
    registry: str = "lorapub_relax_registry"
    #: A SQLite file for the registry's decisions (durable across a registry restart); None: in memory.
    registry_store: str | None = None
    #: The SGLang servers' ``--api-key`` (sent with generations) and ``--admin-api-key`` (loads, unloads,
    #: lorapub's routes); None: the servers take none.
    api_key: str | None = None
    admin_api_key: str | None = None
    #: "host:port" where the trainer's lorapub serves its read-only status (``GET /status``, ``GET /metrics``;
    #: ``lorapub status --url``): the registry's view, which every shard shares. None: not served.
    status: str | None = None
    #: The bearer token the status endpoint wants (needed beyond localhost).
    status_token: str | None = None

    def __post_init__(self) -> None:
        check_name_prefix(self.name_prefix)
        if self.epoch is not None and (not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 0):
            raise InvalidInput(f"epoch must be a non-negative int, got {self.epoch!r}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or isinstance(self.capacity, bool)
                                          or self.capacity < 2):
            # the default holds one slot and a new version needs another: 1 could never publish a second
            raise InvalidInput(f"capacity must be an int >= 2 (2 is the RFC's minimum) or null, got {self.capacity!r}")
        if self.max_lag is not None and self.max_lag != MAX_STALENESS:
            if not isinstance(self.max_lag, int) or isinstance(self.max_lag, bool) or self.max_lag < 0:
                raise InvalidInput(f"max_lag must be an int >= 0 (commits behind the default), {MAX_STALENESS!r} "
                                 f"(Relax's --max-staleness) or null, got {self.max_lag!r}")
            if self.capacity is not None and self.capacity < self.max_lag + 2:  # the core's check_room_for_lag
                raise InvalidInput(f"capacity {self.capacity} cannot serve max_lag={self.max_lag}: the default and the "
                                 f"{self.max_lag} version(s) behind it stay usable and the next version needs a slot "
                                 f"of its own — set capacity: {self.max_lag + 2} or more, or max_lag: "
                                 f"{self.capacity - 2} or less")
        for name in ("first_version_wait", "drain_wait", "worker_refresh"):
            value = getattr(self, name)
            if value is None and name == "worker_refresh":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise InvalidInput(f"{name} must be a number of seconds >= 0, got {value!r}")
        if self.on_stale not in ("error", "rebind"):
            raise InvalidInput(f"on_stale must be 'error' or 'rebind', got {self.on_stale!r}")
        if self.transport not in TRANSPORTS:
            raise InvalidInput(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not isinstance(self.publish_wait, (int, float)) or isinstance(self.publish_wait, bool) or self.publish_wait < 0:
            raise InvalidInput(f"publish_wait must be a number of seconds >= 0, got {self.publish_wait!r}")
        if self.status is not None:
            self.status_address()  # refused here, on the driver, not in the trainer's actor

    def resolved(self, args: Any = None) -> "LorapubConfig":
        """The settings a run uses: ``max_lag: max_staleness`` becomes Relax's ``--max-staleness`` (1, Relax's
        default, where ``args`` has none), and an unset capacity the fewest slots that serve ``max_lag``."""
        max_lag: int | None
        if isinstance(self.max_lag, str):  # MAX_STALENESS: __post_init__ refuses every other str
            staleness = getattr(args, "max_staleness", None)
            max_lag = RELAX_DEFAULT_MAX_STALENESS if staleness is None else int(staleness)
        else:
            max_lag = self.max_lag
        capacity = self.capacity if self.capacity is not None else max(2, (max_lag or 0) + 2)
        if (max_lag, capacity) == (self.max_lag, self.capacity):
            return self
        return dataclasses.replace(self, max_lag=max_lag, capacity=capacity)  # checked again

    def status_address(self) -> tuple[str, int] | None:
        """``status`` as ``(host, port)``; None when unset."""
        if self.status is None:
            return None
        host, _, port = str(self.status).rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise InvalidInput(f"status must be 'host:port' (port 0: any free one), got {self.status!r}")
        return host.strip("[]"), int(port)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "LorapubConfig":
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidInput(f"unknown lorapub setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str) -> "LorapubConfig":
        with open(path, encoding="utf-8") as f:
            text = f.read()
        values: object
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml  # Relax's own dependency; lorapub's only where a YAML file is given

            values = yaml.safe_load(text)
        if values is not None and not isinstance(values, Mapping):
            raise InvalidInput(f"{path}: lorapub's settings are a mapping, got {type(values).__name__}")
        return cls.from_mapping(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_enabled(args: Any) -> bool:
    """Relax's parsed arguments ask for lorapub (``--enable-lorapub``, as add_arguments() declares it)."""
    return bool(getattr(args, _ENABLE_DEST, False))


def config_from_args(args: Any) -> LorapubConfig | None:
    """lorapub's settings for this run; None with the switch off."""
    if not is_enabled(args):
        return None
    resolved = getattr(args, RESOLVED_ATTR, None)
    if resolved is not None:
        return LorapubConfig.from_mapping(resolved)
    path = getattr(args, _CONFIG_DEST, None)
    return (LorapubConfig.from_file(path) if path else LorapubConfig()).resolved(args)


def validate_args(args: Any) -> LorapubConfig | None:
    """On the driver, before any actor gets ``args`` (Relax's ``slime_validate_args``): check the run,
    fix the epoch once, and leave the resolved settings on ``args`` for every actor."""
    config = config_from_args(args)
    if config is None:
        return None
    if not getattr(args, "lora_rank", 0) or not getattr(args, "lora_adapter_mode", False):
        raise InvalidInput(f"{ENABLE_FLAG} publishes LoRA adapters: it needs --lora-rank > 0 and --lora-adapter-mode")
    if getattr(args, "lora_merge_mode", False):
        raise InvalidInput(f"{ENABLE_FLAG} cannot version merged weights: drop --lora-merge-mode")
    for dest, flag in (("enable_versioned_lora_publication", "--enable-versioned-lora-publication"),
                       ("lora_publication_config", "--lora-publication-config")):
        if getattr(args, dest, None):
            raise InvalidInput(
                f"{ENABLE_FLAG} and {flag} ({RELAX_OPTIONS[flag]}) both publish LoRA versions to the same engines; "
                "turn one of them off"
            )
    config = config.resolved(args)
    if config.epoch is None:
        config = dataclasses.replace(config, epoch=int(time.time()))
    setattr(args, RESOLVED_ATTR, config.to_dict())
    return config


def sglang_overrides(config: LorapubConfig) -> dict[str, int]:
    """SGLang server settings a Relax run needs (Relax launches with 1 and 2: put these in ``--sglang-config``):
    ``capacity + 1`` for lorapub (SGLang keeps one batch slot unpinned), and one for Relax's fixed adapter,
    which Relax's first sync loads and which stays loaded."""
    capacity = config.resolved().capacity
    if capacity is None:  # resolved() always sets it
        raise AssertionError("a resolved LorapubConfig has a capacity")
    slots = capacity + 2
    return {"max_loras_per_batch": slots, "max_loaded_loras": slots}


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
    if not ID_RE.fullmatch(version_id):
        raise InvalidInput(f"step {step!r} does not make a version id")
    return version_id


def safe_id(value: str, kind: str, limit: int = 128) -> str:
    if ID_RE.fullmatch(value) and len(value) <= limit:
        return value
    return f"{kind}-" + hashlib.sha256(value.encode("utf-8")).hexdigest()[:40]


def topology_urls(backend: Any) -> list[str]:
    """The rollout engines' URLs from ``DeviceDirectBackend.rollout_topology`` (rank -> {ip, port})."""
    topology = getattr(backend, "rollout_topology", None) or {}
    return [f"http://{info['ip']}:{info['port']}" for _, info in sorted(topology.items(), key=lambda kv: int(kv[0]))]


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False



def make_transport(config: LorapubConfig, args: Any) -> Transport:
    from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, TorchDistributed

    kind = config.transport
    if kind == "auto":
        # only a transport that has run live: HTTP (ipc, same-host shared memory, and gloo/nccl by name)
        kind = "http"
    if kind == "http":
        return HTTPBytes()
    if kind == "ipc":
        return SameHostIPC()
    host = config.transport_host or socket.gethostbyname(socket.gethostname())
    if kind == "nccl":
        return TorchDistributed(host=host, backend="nccl", device="cuda")
    return TorchDistributed(host=host, backend="gloo")
