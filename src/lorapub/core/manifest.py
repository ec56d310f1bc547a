"""Canonical manifest of a frozen adapter snapshot, its digest, and the bucket plan.

Pure: it hashes descriptions that the snapshot builder computed once from the
frozen tensors, so digest and transfer are two views of one snapshot.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import attrs

from lorapub.errors import InvalidInput

MANIFEST_FORMAT = "lorapub-manifest/1"


@attrs.frozen
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=tuple)
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


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@attrs.frozen
class Manifest:
    """Tensors sorted by name plus the serving config (PEFT adapter_config)."""

    tensors: tuple[TensorEntry, ...] = attrs.field(converter=tuple)
    serving_config_json: str

    def __attrs_post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not names:
            raise InvalidInput("a manifest needs at least one tensor")
        if names != sorted(names) or len(set(names)) != len(names):
            raise InvalidInput("manifest tensors must be unique and sorted by name")

    @classmethod
    def build(cls, tensors: list[TensorEntry], serving_config: Mapping[str, Any]) -> "Manifest":
        return cls(sorted(tensors, key=lambda t: t.name), canonical_json(dict(serving_config)))

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
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def entry(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


@attrs.frozen
class Bucket:
    index: int
    entries: tuple[TensorEntry, ...] = attrs.field(converter=tuple)
    nbytes: int
    sha256: str  # over the member entries' digests, in order

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)


@attrs.frozen
class BucketPlan:
    """Fixed transfer order: every engine receives bucket i before bucket i+1."""

    digest: str
    buckets: tuple[Bucket, ...] = attrs.field(converter=tuple)
    serving_config_json: str = "{}"  # travels with begin: engines rebuild the adapter dir from it

    def __len__(self) -> int:
        return len(self.buckets)

    @classmethod
    def for_manifest(cls, manifest: Manifest, bucket_cap_bytes: int) -> "BucketPlan":
        if bucket_cap_bytes <= 0:
            raise InvalidInput(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}")
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
