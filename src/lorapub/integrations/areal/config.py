"""The ``lorapub`` block of AReaL's rollout config, and the names lorapub gives AReaL's versions."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from lorapub import InvalidInput

__all__ = ["DEFAULT_NAME_PREFIX", "LorapubAReaLConfig", "areal_version", "config_of", "version_id"]

DEFAULT_NAME_PREFIX = "lorapub@"
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}@")
_VERSION_RE = re.compile(r"v(\d+)")
ON_STALE = ("rebind", "error")
#: More LoRA slots than any server is launched with (each loaded version holds its weights on the GPU):
#: a max_head_offpolicyness that needs more means "no limit", which lorapub does not serve
MAX_SLOTS = 1024


@dataclasses.dataclass
class LorapubAReaLConfig:
    """``rollout.lorapub`` in an AReaL experiment's YAML (every key optional; these are the defaults).

    ``max_lag`` is not here: it is AReaL's ``rollout.max_head_offpolicyness``, so the window AReaL
    admits rollouts by and the one lorapub binds them by are one number."""

    enabled: bool = False               # off: AReaL's own SGLang path, unchanged
    epoch: int | None = None            # the deployment epoch (None: from the clock at start)
    capacity: int | None = None         # versions held at once (None: max_head_offpolicyness + 2)
    on_stale: str = "rebind"            # a trajectory past max_lag moves at its next turn (rebind) or ends (error)
    name_prefix: str = DEFAULT_NAME_PREFIX  # engine-side names of lorapub's versions (the servers protect it)
    publish_wait: float = 600.0         # seconds a publication waits for a free slot
    idle_ttl: float | None = None       # seconds without a generation before a trajectory's session expires
    api_key: str | None = None          # the servers' --api-key
    admin_api_key: str | None = None    # the servers' --admin-api-key

    def check(self, *, lora_name: str, use_lora: bool, max_head_offpolicyness: int) -> "LorapubAReaLConfig":
        """Refuse, naming the key, what cannot run; returns self."""
        if not use_lora:
            raise InvalidInput("rollout.lorapub.enabled needs rollout.use_lora: true (lorapub publishes LoRA adapters only)")
        if not lora_name:
            raise InvalidInput("rollout.lorapub.enabled needs rollout.lora_name (or gconfig.lora_name)")
        if not isinstance(self.name_prefix, str) or not _PREFIX_RE.fullmatch(self.name_prefix):
            raise InvalidInput(
                f"rollout.lorapub.name_prefix must be 1-64 characters of [A-Za-z0-9_.:-] followed by '@', "
                f"got {self.name_prefix!r}")
        if lora_name.startswith(self.name_prefix) or self.name_prefix.startswith(f"{lora_name}-v"):
            raise InvalidInput(
                f"rollout.lorapub.name_prefix {self.name_prefix!r} overlaps AReaL's adapter names "
                f"{lora_name!r}-v<N>: choose a prefix outside them (the default is {DEFAULT_NAME_PREFIX!r})")
        if self.on_stale not in ON_STALE:
            raise InvalidInput(f"rollout.lorapub.on_stale must be one of {ON_STALE}, got {self.on_stale!r}")
        if max_head_offpolicyness < 0:
            raise InvalidInput(f"rollout.max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        if max_head_offpolicyness + 2 > MAX_SLOTS:
            # RLTrainer's evaluation engine sets 10**12, meaning "no limit": lorapub keeps loaded every version
            # a trajectory may still use, so "no limit" would be slots no server has (its refusal at
            # initialize named --max-loaded-loras 1000000000003)
            raise InvalidInput(
                f"rollout.max_head_offpolicyness {max_head_offpolicyness} would keep {max_head_offpolicyness + 2} "
                f"versions loaded on every server (lorapub unloads none a trajectory may still use); set it to the "
                f"staleness the trainer accepts, at most {MAX_SLOTS - 2}, with --max-loaded-loras above it. An "
                "engine meant to have no staleness limit (RLTrainer's evaluation engine) runs AReaL's own path: "
                "rollout.lorapub.enabled false (docs/areal.md, 'Not covered')")
        capacity = self.capacity_for(max_head_offpolicyness)
        if capacity < max_head_offpolicyness + 2:
            raise InvalidInput(
                f"rollout.lorapub.capacity {capacity} is below max_head_offpolicyness + 2 = "
                f"{max_head_offpolicyness + 2}: a trajectory max_head_offpolicyness versions behind must stay "
                "loaded beside the newest and the one being published; raise capacity (or leave it unset)")
        return self

    def capacity_for(self, max_head_offpolicyness: int) -> int:
        return self.capacity if self.capacity is not None else max_head_offpolicyness + 2


def config_of(value: Any) -> LorapubAReaLConfig | None:
    """The block from what AReaL's config loader left (a dataclass, an OmegaConf node, a dict) or None."""
    if value is None or isinstance(value, LorapubAReaLConfig):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif not isinstance(value, dict):
        try:  # an OmegaConf DictConfig
            from omegaconf import OmegaConf

            value = OmegaConf.to_container(value, resolve=True)
        except (ImportError, ValueError) as e:
            raise InvalidInput(f"rollout.lorapub must be a mapping, got {type(value).__name__}") from e
    known = {f.name for f in dataclasses.fields(LorapubAReaLConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidInput(f"rollout.lorapub: unknown keys {unknown}; known: {sorted(known)}")
    return LorapubAReaLConfig(**value)


def version_id(version: int) -> str:
    """lorapub's version id for AReaL's weight version ``version`` (its ``global_step + 1``)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InvalidInput(f"AReaL's weight version must be an int >= 0, got {version!r}")
    return f"v{version}"


def areal_version(lorapub_version_id: str) -> int:
    """AReaL's weight version back from a version id this integration published."""
    m = _VERSION_RE.fullmatch(lorapub_version_id)
    if m is None:
        raise InvalidInput(f"{lorapub_version_id!r} is not a version this AReaL integration published (v<N>)")
    return int(m.group(1))
