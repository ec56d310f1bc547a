"""A deterministic stand-in for a model under a LoRA adapter, for the numeric READY gate's tests: the
logprobs depend on the adapter's loaded tensor values and on ``lora_alpha / r``, so a scaled tensor or
another ``lora_alpha`` changes them. :func:`reference_probe` is the "reference engine in a test".
See docs/provenance.md, "Numeric READY gate".
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Mapping, Sequence

from lorapub.core.manifest import Bucket
from lorapub.probe import Probe
from lorapub.snapshot import Snapshot, tensor_bytes
from lorapub.wire.safetensors import safetensors_layout

__all__ = ["VOCAB", "SCALE_ENV", "decode", "adapter_stat", "model_logprobs", "blob_tensors", "snapshot_stat",
           "reference_probe", "scale_setting", "apply_scale"]

VOCAB = 64
#: Test-only switch: ``"<substring>=<factor>"`` scales the first tensor (sorted by name) whose name
#: contains ``substring`` by ``factor`` when an engine loads an adapter. Never set it in production.
SCALE_ENV = "LORAPUB_TEST_SCALE_TENSOR"


def decode(raw: bytes | memoryview, dtype: str) -> Any:
    """A tensor's little-endian bytes as float64 numpy values (bfloat16 included)."""
    import numpy as np

    if dtype == "bfloat16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.float64)


def _weight(name: str) -> float:
    return 1.0 + hashlib.sha256(name.encode()).digest()[0] % 8 / 8.0


def adapter_stat(tensors: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """One number per adapter: ``lora_alpha / r`` times a weighted sum of each tensor's RMS."""
    r = float(config.get("r") or 1)
    scale = float(config.get("lora_alpha", r)) / r
    total = 0.0
    for name in sorted(tensors):
        t = tensors[name]
        total += _weight(name) * (math.sqrt(float((t * t).mean())) if t.size else 0.0)
    return scale * total


def model_logprobs(stat: float, ids: Sequence[int]) -> list[float]:
    """log p(ids[k] | ids[:k]) for k >= 1 under the stand-in model of ``stat``."""
    out = []
    for k in range(1, len(ids)):
        prev = ids[k - 1] % VOCAB
        logits = [stat * math.sin(0.7 * (v + 1) * (prev + 1) + 0.3 * k) for v in range(VOCAB)]
        top = max(logits)
        lse = top + math.log(sum(math.exp(x - top) for x in logits))
        out.append(logits[ids[k] % VOCAB] - lse)
    return out


def blob_tensors(blob: bytes | memoryview, bucket: Bucket) -> dict[str, Any]:
    """Every tensor of one bucket's safetensors blob, decoded."""
    view = memoryview(blob)
    spans = safetensors_layout(view, bucket)
    return {e.name: decode(view[a:b], e.dtype) for e, (a, b) in zip(bucket.entries, spans)}


def snapshot_stat(snapshot: Snapshot) -> float:
    tensors = {e.name: decode(tensor_bytes(snapshot.tensor(e.name)), e.dtype) for e in snapshot.manifest.tensors}
    return adapter_stat(tensors, snapshot.serving_config)


def reference_probe(snapshot: Snapshot, sequences: Sequence[Sequence[int]] = ((1, 5, 9, 2, 7, 3, 11, 4),),
                    *, serving_config: Mapping[str, Any] | None = None, **tolerances: float) -> Probe:
    """The trainer's side: the probe of ``snapshot`` (``serving_config``: what the trainer computes
    with, if it differs from what the snapshot tells the engines — a config mismatch)."""
    stat = snapshot_stat(snapshot)
    if serving_config is not None:
        tensors = {e.name: decode(tensor_bytes(snapshot.tensor(e.name)), e.dtype) for e in snapshot.manifest.tensors}
        stat = adapter_stat(tensors, serving_config)
    return Probe(tuple(tuple(s) for s in sequences), tuple(tuple(model_logprobs(stat, s)) for s in sequences),
                 **tolerances)


def scale_setting(value: str | None = None) -> tuple[str, float] | None:
    """The test-only scale switch (``SCALE_ENV`` unless ``value``): (substring, factor) or None."""
    value = os.environ.get(SCALE_ENV) if value is None else value
    if not value or "=" not in value:
        return None
    substring, factor = value.rsplit("=", 1)
    return substring, float(factor)


def apply_scale(tensors: dict[str, Any], setting: tuple[str, float] | None) -> dict[str, Any]:
    """``tensors`` with the switch's one tensor scaled (a copy; unchanged when the switch is off)."""
    if setting is None:
        return tensors
    substring, factor = setting
    for name in sorted(tensors):
        if substring in name:
            return {**tensors, name: tensors[name] * factor}
    return tensors
