"""Frozen CPU snapshot of an adapter: the one copy that feeds both digest and transfer.

Accepts a PEFT-style ``state_dict`` of torch tensors or numpy arrays. Each tensor
is copied to CPU memory it owns (never a view of live parameters), so training
can keep stepping while the snapshot is published.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any, Mapping

from lorapub.core.manifest import BucketPlan, Manifest, TensorEntry
from lorapub.errors import InvalidInput

DEFAULT_BUCKET_CAP = 64 << 20


def _freeze(t: Any) -> Any:
    if type(t).__module__.startswith("torch"):
        return t.detach().to("cpu", copy=True).contiguous()
    import numpy as np

    a = np.array(t, copy=True, order="C")
    a.setflags(write=False)
    return a


def _is_torch(t: Any) -> bool:
    return type(t).__module__.startswith("torch")


def _raw_bytes(t: Any) -> bytes:
    if _is_torch(t):
        import torch

        return t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return t.tobytes()


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class Snapshot:
    """Immutable once built. ``manifest.digest`` is the version's content digest."""

    def __init__(self, state_dict: Mapping[str, Any], serving_config: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or not isinstance(serving_config, Mapping):
            raise InvalidInput("Snapshot(state_dict, serving_config) takes two mappings")
        if not state_dict:
            raise InvalidInput("an adapter snapshot needs at least one tensor")
        self._tensors = {name: _freeze(t) for name, t in sorted(state_dict.items())}
        self.serving_config = json.loads(json.dumps(dict(serving_config), sort_keys=True))
        entries = [
            TensorEntry(
                name=name,
                dtype=_dtype(t),
                shape=tuple(int(x) for x in t.shape),
                nbytes=len(raw := _raw_bytes(t)),
                sha256=hashlib.sha256(raw).hexdigest(),
            )
            for name, t in self._tensors.items()
        ]
        self.manifest = Manifest.build(entries, self.serving_config)
        self._framework = "torch" if any(_is_torch(t) for t in self._tensors.values()) else "numpy"

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> Any:
        return self._tensors[name]

    def plan(self, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP) -> BucketPlan:
        return BucketPlan.for_manifest(self.manifest, bucket_cap_bytes)

    def bucket_bytes(self, plan: BucketPlan, index: int) -> bytes:
        """The bucket's tensors as one safetensors blob (what a byte transport carries)."""
        bucket = plan.buckets[index]
        chosen = {name: self._tensors[name] for name in bucket.tensor_names}
        metadata = {"lorapub_digest": plan.digest, "lorapub_bucket": str(index)}
        if self._framework == "torch":
            from safetensors.torch import save

            return save(chosen, metadata=metadata)
        from safetensors.numpy import save

        return save(chosen, metadata=metadata)

    def save_peft_dir(self, path: str) -> str:
        """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (what SGLang loads)."""
        os.makedirs(path, exist_ok=True)
        if self._framework == "torch":
            from safetensors.torch import save_file
        else:
            from safetensors.numpy import save_file
        save_file(dict(self._tensors), os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(self.serving_config, f, sort_keys=True, indent=1)
        return path


def load_safetensors(path: str) -> dict[str, Any]:
    """Load with torch when present (bf16 has no numpy dtype), else with numpy."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        from safetensors.numpy import load_file
    return load_file(path)


class InlineBucketSource:
    """Byte transport: the source half is ready at once; engines store the bytes they get."""

    carries_bytes = True

    def __init__(self, snapshot: Snapshot, plan: BucketPlan) -> None:
        if plan.digest != snapshot.digest:
            raise InvalidInput(f"plan is for digest {plan.digest[:12]}…, snapshot is {snapshot.digest[:12]}…")
        self.snapshot = snapshot
        self.plan = plan
        self._cache: dict[int, bytes] = {}

    async def send(self, token, index: int, engines) -> None:
        if index not in self._cache:  # serialize off the event loop: rollouts share it
            self._cache[index] = await asyncio.to_thread(self.snapshot.bucket_bytes, self.plan, index)

    def payload(self, token, index: int) -> bytes:
        if index not in self._cache:
            self._cache[index] = self.snapshot.bucket_bytes(self.plan, index)
        return self._cache[index]
