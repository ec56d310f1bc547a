"""Canonical manifest of a frozen adapter snapshot, its digest, and the bucket plan.

Pure: it hashes descriptions that the snapshot builder computed once from the
frozen tensors, so digest and transfer are two views of one snapshot.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Iterable, Mapping

import attrs

from lorapub.errors import InvalidInput

__all__ = [
    "MANIFEST_FORMAT", "TensorEntry", "canonical_json", "check_serving_config", "Manifest", "Bucket", "BucketPlan",
]

MANIFEST_FORMAT = "lorapub-manifest/1"


def _shape(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(dims)


def _entries(entries: Iterable[TensorEntry]) -> tuple[TensorEntry, ...]:
    return tuple(entries)


def _buckets(buckets: Iterable[Bucket]) -> tuple[Bucket, ...]:
    return tuple(buckets)


@attrs.frozen
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_shape)
    nbytes: int
    sha256: str

    def canonical(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "sha256": self.sha256,
        }


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


_MAX_CONFIG_DEPTH = 32


def _check_json(value: object, where: str, depth: int) -> None:
    if depth > _MAX_CONFIG_DEPTH:
        raise InvalidInput(f"{where} nests deeper than {_MAX_CONFIG_DEPTH} levels (or refers to itself)")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(f"{where} is {value!r}; JSON has no NaN or infinity")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(f"{where} has the key {key!r} ({type(key).__name__}); JSON keys are strings")
            _check_json(item, f"{where}[{key!r}]", depth + 1)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
        return
    raise InvalidInput(f"{where} is a {type(value).__name__} ({value!r:.60}), which is not JSON")


def check_serving_config(config: object) -> dict[str, Any]:
    """A plain-JSON copy of ``config`` (string keys; None, bools, ints, finite floats, strings,
    lists and mappings only), or :class:`InvalidInput` naming the offending key."""
    if not isinstance(config, Mapping):
        raise InvalidInput(f"serving_config must be a mapping (the adapter_config.json), got {type(config).__name__}")
    _check_json(config, "serving_config", 0)
    copy: dict[str, Any] = json.loads(canonical_json(dict(config)))
    return copy


@attrs.frozen
class Manifest:
    """Tensors sorted by name plus the serving config (PEFT adapter_config)."""

    tensors: tuple[TensorEntry, ...] = attrs.field(converter=_entries)
    serving_config_json: str
    # Computed once, at construction: a publication asks for it many times (~3 ms at 504 tensors).
    _digest: str = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not names:
            raise InvalidInput("a manifest needs at least one tensor")
        for name in names:
            if not isinstance(name, str) or not name:
                raise InvalidInput(f"tensor names must be non-empty strings, got {name!r}")
        if names != sorted(names) or len(set(names)) != len(names):
            raise InvalidInput("manifest tensors must be unique and sorted by name")
        object.__setattr__(self, "_digest", hashlib.sha256(self.canonical().encode()).hexdigest())

    @classmethod
    def build(cls, tensors: list[TensorEntry], serving_config: Mapping[str, Any]) -> "Manifest":
        config = check_serving_config(serving_config)
        for t in tensors:
            if not isinstance(t.name, str) or not t.name:
                raise InvalidInput(f"tensor names must be non-empty strings, got {t.name!r}")
        return cls(sorted(tensors, key=lambda t: t.name), canonical_json(config))

    def canonical(self) -> str:
        return canonical_json(
            {
                "format": MANIFEST_FORMAT,
                "tensors": [t.canonical() for t in self.tensors],
                "serving_config": json.loads(self.serving_config_json),
            }
        )

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@attrs.frozen
class Bucket:
    index: int
    entries: tuple[TensorEntry, ...] = attrs.field(converter=_entries)
    nbytes: int
    sha256: str  # over the member entries' digests, in order

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


@attrs.frozen
class BucketPlan:
    """Fixed transfer order: every engine receives bucket i before bucket i+1."""

    digest: str
    buckets: tuple[Bucket, ...] = attrs.field(converter=_buckets)
    serving_config_json: str = "{}"  # travels with begin: engines rebuild the adapter dir from it

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @classmethod
    def for_manifest(cls, manifest: Manifest, bucket_cap_bytes: int) -> "BucketPlan":
        if not isinstance(manifest, Manifest):
            raise InvalidInput(f"a bucket plan is made for a Manifest, got {type(manifest).__name__}")
        if not isinstance(bucket_cap_bytes, int) or isinstance(bucket_cap_bytes, bool) or bucket_cap_bytes <= 0:
            raise InvalidInput(f"bucket_cap_bytes must be a positive int, got {bucket_cap_bytes!r}")
        groups: list[list[TensorEntry]] = []
        size = 0
        for entry in manifest.tensors:
            # A tensor larger than the cap travels alone; it is never split.
            if groups and size + entry.nbytes <= bucket_cap_bytes:
                groups[-1].append(entry)
                size += entry.nbytes
            else:
                groups.append([entry])
                size = entry.nbytes
        buckets = tuple(
            Bucket(
                index=i,
                entries=tuple(group),
                nbytes=sum(e.nbytes for e in group),
                sha256=hashlib.sha256("".join(e.sha256 for e in group).encode()).hexdigest(),
            )
            for i, group in enumerate(groups)
        )
        return cls(digest=manifest.digest, buckets=buckets, serving_config_json=manifest.serving_config_json)
