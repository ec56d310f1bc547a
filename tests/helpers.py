"""Small builders shared by the tests (no engine, no I/O)."""

from __future__ import annotations

import hashlib

from lorapub.core.manifest import BucketPlan, Manifest, TensorEntry


def fake_manifest(seed: str, tensors: int = 3, nbytes: int = 64) -> Manifest:
    entries = [
        TensorEntry(
            name=f"layers.{i}.lora_A.weight",
            dtype="float32",
            shape=(nbytes // 4,),
            nbytes=nbytes,
            sha256=hashlib.sha256(f"{seed}/{i}".encode()).hexdigest(),
        )
        for i in range(tensors)
    ]
    return Manifest.build(entries, {"r": 4, "lora_alpha": 8, "seed": seed})


def fake_plan(seed: str, tensors: int = 3, cap: int = 128) -> tuple[str, BucketPlan]:
    m = fake_manifest(seed, tensors)
    return m.digest, BucketPlan.for_manifest(m, cap)
