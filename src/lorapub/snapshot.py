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
import sys
from typing import TYPE_CHECKING, Any, Mapping, TypeAlias, TypeGuard

from lorapub.wire.dtypes import ACCEPTED, SAFETENSORS_DTYPES
from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import BucketPlan, Manifest, TensorEntry, check_serving_config
from lorapub.errors import InvalidInput
from lorapub.probe import Probe

__all__ = ["DEFAULT_BUCKET_CAP", "tensor_bytes", "Snapshot", "load_safetensors", "InlineBucketSource"]

if TYPE_CHECKING:  # for the type checker only: a snapshot of numpy arrays needs no torch
    import numpy.typing as npt
    import torch

    #: What a snapshot holds: a dense torch tensor or a numpy array (of any dtype the wire table has).
    Tensor: TypeAlias = torch.Tensor | npt.NDArray[Any]

DEFAULT_BUCKET_CAP = 64 << 20


def _torch_tensor(t: object) -> TypeGuard[torch.Tensor]:
    torch = sys.modules.get("torch")  # a torch tensor cannot exist unless torch was imported
    return torch is not None and isinstance(t, torch.Tensor)


def _numpy_array(t: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(t, np.ndarray)


def _refuse_dtype(name: str, dtype: Any) -> InvalidInput:
    return InvalidInput(
        f"tensor {name!r} has dtype {dtype}, which lorapub does not publish: engine-side staging loads only "
        f"{ACCEPTED}; convert it (e.g. to float32 or bfloat16) before taking the snapshot"
    )


def _check_tensor(name: str, t: Any) -> str:
    """``"torch"`` or ``"numpy"``; :class:`InvalidInput` naming ``name`` for anything else, and for a
    dtype outside :data:`lorapub.wire.dtypes.SAFETENSORS_DTYPES` (what engine-side staging loads)."""
    if _torch_tensor(t):
        import torch

        if t.layout != torch.strided:
            raise InvalidInput(f"tensor {name!r} has layout {t.layout}; only dense (strided) tensors are published")
        if t.device.type == "meta":
            raise InvalidInput(f"tensor {name!r} is on the meta device and has no data")
        if _dtype(t) not in SAFETENSORS_DTYPES:
            raise _refuse_dtype(name, t.dtype)
        return "torch"
    if _numpy_array(t):
        # a numpy dtype by its name, whatever its byte order ('>f4' is float32); kinds b/i/u/f only, so an
        # extension type that borrows a name (a void-kind 'bfloat16') is not taken for the real one
        if t.dtype.kind not in "biuf" or t.dtype.name not in SAFETENSORS_DTYPES:
            raise _refuse_dtype(name, t.dtype)
        return "numpy"
    raise InvalidInput(f"tensor {name!r} is a {type(t).__name__} ({t!r:.60}), not a torch tensor or a numpy array")


# A snapshot's per-tensor work (copy, finiteness) runs in numpy, on the calling thread, never on torch's
# intra-op pool: that pool has one thread per core, and on a host whose cores the servers keep busy each of
# an adapter's ~500 tensors can wait for the slowest of them (the engine's helper did: 4.6-12.1 s per 264 MB
# adapter against 0.13 s with one thread, docs/sglang-patch.md). Here it is also faster on an idle host.
_CHUNK = 1 << 22  # elements checked at a time: bounds the scratch memory of a finiteness check


def _byte_array(t: Any) -> Any:
    """A CPU torch tensor's memory as a flat numpy uint8 array (no copy)."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _standard_strides(t: Any) -> bool:
    """Row-major strides, exactly (``is_contiguous`` also passes a size-1 dim of any stride, which a
    flat byte view refuses)."""
    expect, step = [], 1
    for n in reversed(t.shape):
        expect.append(step)
        step *= int(n)
    return tuple(reversed(expect)) == tuple(t.stride())


def _freeze(name: str, t: Any) -> Any:
    try:
        if _torch_tensor(t):
            import numpy as np
            import torch

            # one copy, in standard strides whatever the source's (a size-1 dim may keep any stride
            # through .contiguous(), which a byte view then refuses)
            out = torch.empty(tuple(t.shape), dtype=t.dtype)
            if t.device.type == "cpu" and _standard_strides(t) and not t.is_conj() and not t.is_neg():
                np.copyto(_byte_array(out), _byte_array(t))
                return out
            return out.copy_(t.detach())  # on a device, or strided: torch's own copy
        import numpy as np

        a = np.array(t, copy=True, order="C")
        if a.dtype.byteorder == ">":  # one byte order for every digest: little-endian, as safetensors stores
            a = a.astype(a.dtype.newbyteorder("<"))
        a.setflags(write=False)
        return a
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        raise InvalidInput(f"tensor {name!r} cannot be copied to CPU memory: {e}") from None


def _check_finite(name: str, t: Any) -> None:
    """A floating tensor holding NaN or an infinity (a diverged step, an uninitialised buffer) would
    serve garbage on every turn bound to the version: refused, naming it, before anything is sent."""
    if _is_torch(t):
        import torch

        if not t.is_floating_point() or _torch_finite(t):
            return
        nan, inf, count = int(torch.isnan(t).sum()), int(torch.isinf(t).sum()), t.numel()
    else:
        import numpy as np

        if t.dtype.kind != "f" or bool(np.isfinite(t).all()):
            return
        nan, inf, count = int(np.isnan(t).sum()), int(np.isinf(t).sum()), t.size
    found = " and ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)
    raise InvalidInput(f"tensor {name!r} holds values that are not finite ({found} of {count}): a diverged or "
                       "uninitialised adapter would serve garbage on every turn; publish a snapshot of finite weights")


#: Every floating format the dtype table admits (lorapub.wire.dtypes), as (unsigned integer of the same
#: width, exponent mask): a value is NaN or infinite exactly when every exponent bit is set
_EXPONENTS = {"bfloat16": ("uint16", 0x7F80), "float16": ("uint16", 0x7C00), "float32": ("uint32", 0x7F800000),
              "float64": ("uint64", 0x7FF0000000000000)}


def _torch_finite(t: Any) -> bool:
    """Whether a frozen (CPU, standard strides) floating torch tensor is all finite, checked on its bits in
    numpy a chunk at a time."""
    import numpy as np

    kind, mask = _EXPONENTS[_dtype(t)]
    bits = _byte_array(t).view(kind)
    scratch = np.empty(min(bits.size, _CHUNK), dtype=kind)
    for start in range(0, bits.size, _CHUNK):
        part = bits[start:start + _CHUNK]
        into = scratch[:part.size]
        np.bitwise_and(part, mask, out=into)
        if (into == mask).any():
            return False
    return True


def _is_torch(t: object) -> TypeGuard[torch.Tensor]:
    return _torch_tensor(t)


def tensor_bytes(t: Tensor) -> memoryview:
    """A read-only byte view of a frozen tensor's memory (no copy): what is hashed and what travels."""
    if _is_torch(t):
        view: memoryview = _byte_array(t).data  # the array's memoryview
        return view.cast("B").toreadonly()
    import numpy as np

    return np.ascontiguousarray(t).reshape(-1).view(np.uint8).data.cast("B").toreadonly()


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_probe(probe: object) -> Probe | None:
    if probe is not None and not isinstance(probe, Probe):
        raise InvalidInput(f"a snapshot's probe is a lorapub.probe.Probe, got {type(probe).__name__}")
    return probe


class Snapshot:
    """Immutable once built. ``manifest.digest`` is the version's content digest.

    Everything is checked here, before anything is sent to an engine: tensor names are
    non-empty strings, every tensor is a dense torch tensor or a numpy array (one kind per
    snapshot) of a dtype engine-side staging loads (:data:`lorapub.wire.dtypes.SAFETENSORS_DTYPES`:
    bool, uint8, int8/16/32/64, float16, bfloat16, float32, float64) whose values are finite (no
    NaN, no infinity), and the serving config is non-empty plain JSON (no NaN, string keys). A
    violation is :class:`~lorapub.errors.InvalidInput` naming the offending key.

    ``probe`` (optional): reference logprobs each engine must reproduce before its READY
    (docs/provenance.md, "Numeric READY gate"); it is not part of the digest.
    """

    def __init__(self, state_dict: Mapping[str, Tensor], serving_config: Mapping[str, object], *,
                 probe: Probe | None = None) -> None:
        if not isinstance(state_dict, Mapping) or not isinstance(serving_config, Mapping):
            raise InvalidInput("Snapshot(state_dict, serving_config) takes two mappings")
        if not state_dict:
            raise InvalidInput("an adapter snapshot needs at least one tensor")
        kinds: dict[str, str] = {}
        for name, t in state_dict.items():
            if not isinstance(name, str) or not name:
                raise InvalidInput(f"tensor names must be non-empty strings, got {name!r} ({type(name).__name__})")
            kinds[name] = _check_tensor(name, t)
        if len(set(kinds.values())) > 1:
            torch_name = next(n for n, k in kinds.items() if k == "torch")
            numpy_name = next(n for n, k in kinds.items() if k == "numpy")
            raise InvalidInput(
                f"state_dict mixes torch tensors ({torch_name!r}) and numpy arrays ({numpy_name!r}); pass one kind"
            )
        if not serving_config:
            raise InvalidInput("serving_config is empty: it is the adapter's adapter_config.json (PEFT's LoraConfig "
                               "as a dict: r, lora_alpha, target_modules…), which the engine loads the adapter with; "
                               "pass peft_model.peft_config['default'].to_dict() or the file's contents")
        self.serving_config = check_serving_config(serving_config)
        self._tensors = {name: _freeze(name, t) for name, t in sorted(state_dict.items())}
        for name, t in self._tensors.items():
            _check_finite(name, t)
        entries = [
            TensorEntry(
                name=name,
                dtype=_dtype(t),
                shape=tuple(int(x) for x in t.shape),
                nbytes=len(raw := tensor_bytes(t)),
                sha256=hashlib.sha256(raw).hexdigest(),
            )
            for name, t in self._tensors.items()
        ]
        self.manifest = Manifest.build(entries, self.serving_config)
        self._framework = next(iter(kinds.values()))
        self.probe = _check_probe(probe)

    def with_probe(self, probe: Probe | None) -> "Snapshot":
        """The same frozen tensors and digest, carrying ``probe`` (the probe is not part of the
        adapter's identity: it travels with the snapshot, outside the digest)."""
        copy = object.__new__(Snapshot)
        copy.__dict__.update(self.__dict__)
        copy.probe = _check_probe(probe)
        return copy

    def __repr__(self) -> str:
        size = self.manifest.total_bytes
        shown = f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"
        return f"<Snapshot {self.digest[:12]} {len(self._tensors)} tensors {shown} {self._framework}>"

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> Tensor:
        frozen: Tensor = self._tensors[name]
        return frozen

    def plan(self, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP) -> BucketPlan:
        return BucketPlan.for_manifest(self.manifest, bucket_cap_bytes)

    def bucket_bytes(self, plan: BucketPlan, index: int) -> bytes:
        """The bucket's tensors as one safetensors blob (what a byte transport carries)."""
        if not isinstance(plan, BucketPlan) or plan.digest != self.digest:
            raise InvalidInput("bucket_bytes needs a plan made for this snapshot (snapshot.plan())")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(plan.buckets):
            raise InvalidInput(f"bucket index must be an int in [0, {len(plan.buckets)}), got {index!r}")
        bucket = plan.buckets[index]
        chosen = {name: self._tensors[name] for name in bucket.tensor_names}
        metadata = {"lorapub_digest": plan.digest, "lorapub_bucket": str(index)}
        if self._framework == "torch":
            from safetensors.torch import save as save_torch

            return save_torch(chosen, metadata=metadata)
        from safetensors.numpy import save as save_numpy

        return save_numpy(chosen, metadata=metadata)

    def save_peft_dir(self, path: str) -> str:
        """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (what SGLang loads)."""
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidInput(f"save_peft_dir takes a directory path, got {path!r}")
        os.makedirs(path, exist_ok=True)
        file = os.path.join(path, "adapter_model.safetensors")
        if self._framework == "torch":
            from safetensors.torch import save_file as save_torch_file

            save_torch_file(dict(self._tensors), file)
        else:
            from safetensors.numpy import save_file as save_numpy_file

            save_numpy_file(dict(self._tensors), file)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(self.serving_config, f, sort_keys=True, indent=1)
        return path


def load_safetensors(path: str) -> dict[str, Any]:
    """Load with torch when present (bf16 has no numpy dtype), else with numpy."""
    try:
        from safetensors.torch import load_file as load_torch_file
    except ImportError:
        from safetensors.numpy import load_file as load_numpy_file

        return load_numpy_file(path)
    return load_torch_file(path)


class InlineBucketSource:
    """Byte transport: the source half is ready at once; engines store the bytes they get
    (safetensors bytes per bucket: what a deployment without a transport sends)."""

    collective = False

    def __init__(self, snapshot: Snapshot, plan: BucketPlan) -> None:
        if not isinstance(snapshot, Snapshot) or not isinstance(plan, BucketPlan):
            raise InvalidInput("InlineBucketSource(snapshot, plan) takes a Snapshot and its BucketPlan")
        if plan.digest != snapshot.digest:
            raise InvalidInput(f"plan is for digest {plan.digest[:12]}…, snapshot is {snapshot.digest[:12]}…")
        self.snapshot = snapshot
        self.plan = plan
        self._cache: dict[int, bytes] = {}

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        if index not in self._cache:  # serialize off the event loop: rollouts share it
            self._cache[index] = await asyncio.to_thread(self.snapshot.bucket_bytes, self.plan, index)

    def payload(self, token: AttemptToken, index: int) -> bytes:
        if index not in self._cache:
            self._cache[index] = self.snapshot.bucket_bytes(self.plan, index)
        return self._cache[index]
