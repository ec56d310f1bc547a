"""Image plans: how SGLang's slot fill turns an adapter's shipped weights into its slot image, recorded
once per layout on the preparing thread and replayed by the helper process for each later load of that
layout (an RL run's every version). The fill only copies views of the weights and zeroes what they
lack, chosen by names and shapes, never by values; a plan is kept only where replaying it gives the
very image the fill made. See docs/sglang-patch.md, "Slot images".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

__all__ = ["ImagePlan", "image_layout", "learn", "recorder", "replay"]


@dataclasses.dataclass(frozen=True)
class ImagePlan:
    """A recorded slot fill (picklable: it goes to the helper process).

    ``key``: the shipped weights' entries it was learned from (names, dtypes, shapes, offsets); a load
    whose entries differ gets no image from the helper. ``layout``: each slot buffer's dtype and one slot's
    shape, the pool the image is for. ``flats``: the image's flat tensors, one per dtype (``(dtype,
    elements)``). ``ops``, in the fill's order: ``("copy", flat, shape, stride, offset, src_dtype,
    src_shape, src_stride, src_offset)`` or ``("zero", flat, shape, stride, offset)``; offsets in
    elements, from the start of the flat and of the shipped weights."""

    key: tuple[Any, ...]
    layout: tuple[tuple[str, tuple[int, ...]], ...]
    flats: tuple[tuple[str, int], ...]
    ops: tuple[tuple[Any, ...], ...]


def image_layout(buffers: list[Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What an image for these slot buffers must hold: each one's dtype and one slot's shape."""
    return tuple((_dtype_name(b), tuple(b.shape[1:])) for b in buffers)


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


#: Python's in-place operators on a tensor (torch's other in-place functions end in one underscore).
_WRITING_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})


@functools.lru_cache(maxsize=1)
def _recorder_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    class FillRecorder(TorchFunctionMode):
        """Records, on this thread only (torch's function modes are thread-local), each write SGLang's fill
        makes into the image's ``flats``: a ``copy_`` from a view of ``source`` (the adapter's shipped
        weights) or a ``zero_``. Any other write into them, or a copy from anything else (a tensor the
        fill computed), refuses the plan: such a fill is no replayable gather, and keeps running per load."""

        def __init__(self, flats: list[Any], source: Any) -> None:
            super().__init__()
            self.flat_at = {f.untyped_storage().data_ptr(): i for i, f in enumerate(flats)}
            self.source_at = source.untyped_storage().data_ptr()
            self.source_start = source.storage_offset() * source.element_size()  # bytes
            self.ops: list[tuple[Any, ...]] = []
            self.refused: str | None = None

        def _flat(self, t: Any) -> int | None:
            return self.flat_at.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if self.refused is None:
                try:
                    self._note(func, args, kwargs)
                except Exception as e:  # noqa: BLE001 - recording never breaks the fill it watches
                    self.refused = f"recording {getattr(func, '__name__', func)} failed: {e}"
            return func(*args, **kwargs)

        def _note(self, func: Any, args: Any, kwargs: Any) -> None:
            name = getattr(func, "__name__", "")
            if self._flat(kwargs.get("out")) is not None:
                self.refused = f"SGLang's fill writes into the image through {name}(out=)"
                return
            k = self._flat(args[0]) if args else None
            if k is None:
                return
            dst = args[0]
            where = (k, tuple(dst.shape), tuple(dst.stride()), dst.storage_offset())
            if name == "copy_":
                src = args[1] if len(args) > 1 else kwargs.get("src")
                if not isinstance(src, torch.Tensor) or src.untyped_storage().data_ptr() != self.source_at:
                    self.refused = "SGLang's fill copies into the image from a tensor other than the shipped weights"
                    return
                size = src.element_size()
                offset = src.storage_offset() * size - self.source_start
                if offset % size:
                    self.refused = "SGLang's fill reads a weight view not aligned to its element size"
                    return
                self.ops.append(("copy", *where, _dtype_name(src), tuple(src.shape), tuple(src.stride()),
                                 offset // size))
            elif name == "zero_":
                self.ops.append(("zero", *where))
            elif (name.endswith("_") and not name.endswith("__")) or name in _WRITING_DUNDERS:
                self.refused = f"SGLang's fill writes into the image with {name}"

    return FillRecorder


def recorder(flats: list[Any], source: Any) -> Any:
    """A torch function mode that records SGLang's fill into ``flats`` from ``source`` (enter it with
    ``with``); :func:`learn` turns what it saw into a plan."""
    return _recorder_class()(flats, source)


def replay(plan: ImagePlan, source: Any, flats: list[Any]) -> None:
    """Write ``plan``'s image into ``flats`` (zeroed, one per ``plan.flats``) from ``source``, the shipped
    weights (a flat ``uint8`` tensor laid out as ``plan.key`` says), on the current stream."""
    import torch

    typed: dict[str, Any] = {}
    for op in plan.ops:
        flat = flats[op[1]]
        dst = flat.as_strided(op[2], op[3], flat.storage_offset() + op[4])
        if op[0] == "zero":
            dst.zero_()
            continue
        src_dtype = op[5]
        view = typed.get(src_dtype)
        if view is None:
            view = typed[src_dtype] = source.view(getattr(torch, src_dtype))
        dst.copy_(view.as_strided(op[6], op[7], view.storage_offset() + op[8]), non_blocking=True)


def learn(recorder: Any, key: tuple[Any, ...], buffers: list[Any], flats: list[Any], source: Any) -> ImagePlan | None:
    """The plan ``recorder`` saw while SGLang's fill wrote ``flats`` (the image, for these slot
    ``buffers``), if replaying it from ``source`` writes the very same bytes; else None."""
    import torch

    if recorder.refused is not None or not recorder.ops:
        return None
    plan = ImagePlan(key, image_layout(buffers), tuple((_dtype_name(f), int(f.numel())) for f in flats),
                     tuple(recorder.ops))
    check = [torch.zeros_like(f) for f in flats]
    replay(plan, source, check)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(check, flats))
    return plan if same else None
