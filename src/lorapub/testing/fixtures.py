"""Fixture builders (no downloads): seeded PEFT LoRA tensors, snapshots, manifests and bucket plans."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Sequence, TypedDict, Unpack

from lorapub.core.manifest import BucketPlan, Manifest, TensorEntry
from lorapub.snapshot import Snapshot

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["peft_lora_state_dict", "peft_config", "lora_snapshot", "fake_manifest", "fake_plan"]


class _Shape(TypedDict, total=False):
    layers: int
    hidden: int
    rank: int
    modules: Sequence[str]


def peft_lora_state_dict(seed: int, *, layers: int = 2, hidden: int = 64, rank: int = 8,
                         modules: Sequence[str] = ("q_proj", "v_proj")) -> dict[str, NDArray[np.floating[Any]]]:
    """Seeded PEFT-named ``lora_A``/``lora_B`` float32 tensors (numpy), both non-zero."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tensors: dict[str, NDArray[np.floating[Any]]] = {}
    for layer in range(layers):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # B is non-zero on purpose: a fresh PEFT init (B = 0) would make A and B indistinguishable.
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, hidden)).astype("float32") * 0.05
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((hidden, rank)).astype("float32") * 0.05
    return tensors


def peft_config(rank: int = 8, modules: Sequence[str] = ("q_proj", "v_proj")) -> dict[str, Any]:
    """The ``adapter_config.json`` that goes with :func:`peft_lora_state_dict`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "base_model_name_or_path": "lorapub-tiny-qwen3",
    }


def lora_snapshot(seed: int, **shape: Unpack[_Shape]) -> Snapshot:
    """A :class:`~lorapub.Snapshot` of :func:`peft_lora_state_dict` (same seed, same digest)."""
    rank = shape.get("rank", 8)
    return Snapshot(peft_lora_state_dict(seed, **shape), peft_config(rank))


def fake_manifest(seed: str, tensors: int = 3, nbytes: int = 64) -> Manifest:
    """A manifest with made-up tensor hashes (for the registry alone: no bytes exist)."""
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
    """``(digest, plan)`` of :func:`fake_manifest`, split into buckets of at most ``cap`` bytes."""
    m = fake_manifest(seed, tensors)
    return m.digest, BucketPlan.for_manifest(m, cap)
