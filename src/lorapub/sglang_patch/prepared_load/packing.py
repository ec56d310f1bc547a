"""The shipped buffer: how the helper lays out a prepared adapter's weights (each at an ``ALIGN``-ed
offset, :class:`Entry`) and, where the scheduler taught it a plan for their layout, the adapter's slot
image after them (:class:`ImageSpan`), in one flat ``uint8`` buffer on the scheduler's device."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from .image_plan import ImagePlan, replay
from .reading import weight_places

__all__ = ["ALIGN", "CHUNK_BYTES", "Entry", "ImageSpan", "pack"]

#: Every weight's place in the shipped buffer starts on a 256-byte boundary.
ALIGN = 256
#: Host-to-device copies in the helper go through two pinned chunks of this size (double-buffered).
CHUNK_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Entry:
    """One weight in the shipped buffer: ``where`` is its weight dict (a layer's index, or the adapter's
    ``embedding_layers`` / ``added_tokens_embeddings``), then its name, dtype, shape and byte span."""

    where: int | str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """One flat of the adapter's slot image in the shipped buffer: its dtype, byte offset and elements."""

    dtype: str
    offset: int
    numel: int

    def of(self, buf: Any) -> Any:
        """This flat, as a view of ``buf`` (the shipped buffer, or the scheduler's copy of it)."""
        import torch

        typed = getattr(torch, self.dtype)
        return buf[self.offset:self.offset + self.numel * typed.itemsize].view(typed)


def pack(adapter: Any, dtype: Any, device: Any, stream: Any = None, chunks: list[Any] | None = None,
         plans: dict[tuple[Entry, ...], ImagePlan] | None = None) -> tuple[Any, list[Entry], tuple[ImageSpan, ...]]:
    """Every weight of ``adapter`` (floating ones cast to ``dtype``) in one flat ``uint8`` buffer on
    ``device``, each at an ``ALIGN``-ed offset, with its :class:`Entry`: through the pinned ``chunks``
    on ``stream`` where there are chunks (CUDA), else in host shared memory. Where ``plans`` has a plan
    for these entries, the adapter's slot image follows the weights in the same buffer (its spans, one
    per dtype; else none)."""
    import torch

    slots, entries, total = [], [], 0
    for where, d in weight_places(adapter):
        for name, t in d.items():
            if isinstance(dtype, torch.dtype) and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)  # rounding to nearest even, as the device cast would
            t = t.contiguous()
            size = t.numel() * t.element_size()
            slots.append(t)
            entries.append(Entry(where, name, str(t.dtype).removeprefix("torch."), tuple(t.shape), total, size))
            total += -(-size // ALIGN) * ALIGN
    plan = (plans or {}).get(tuple(entries))
    spans: list[ImageSpan] = []
    end = total
    for image_dtype, n in plan.flats if plan is not None else ():
        spans.append(ImageSpan(image_dtype, end, n))
        end += -(-(n * getattr(torch, image_dtype).itemsize) // ALIGN) * ALIGN
    if not chunks:
        buf = torch.empty(max(end, 1), dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        for t, e in zip(slots, entries):
            buf[e.offset:e.offset + e.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    else:
        with torch.cuda.stream(stream):
            buf = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
        _copy_through_chunks(buf, slots, entries, total, chunks, stream)
    if plan is not None:
        context = torch.cuda.stream(stream) if chunks else contextlib.nullcontext()
        with context:  # the image, device to device from the weights just copied (image_plan.replay)
            buf[total:end].zero_()
            replay(plan, buf[:total], [span.of(buf) for span in spans])
    if stream is not None:
        stream.synchronize()
    return buf, entries, tuple(spans)


def _copy_through_chunks(buf: Any, slots: list[Any], entries: list[Entry], total: int, chunks: list[Any],
                         stream: Any) -> None:
    import torch

    pending: list[Any] = [None] * len(chunks)
    k, i = 0, 0
    chunk_bytes = chunks[0].numel()
    for base in range(0, total, chunk_bytes):
        end = min(base + chunk_bytes, total)
        if pending[k] is not None:
            pending[k].synchronize()  # the chunk's previous copy has left it
        chunk = chunks[k]
        while i < len(slots) and entries[i].offset < end:  # every weight's bytes overlapping [base, end)
            start, size = entries[i].offset, entries[i].nbytes
            lo, hi = max(start, base), min(start + size, end)
            if hi > lo:
                flat = slots[i].reshape(-1).view(torch.uint8)
                chunk[lo - base:hi - base].copy_(flat[lo - start:hi - start])
            if start + size > end:
                break  # the rest of this weight goes into the next chunk
            i += 1
        with torch.cuda.stream(stream):
            buf[base:end].copy_(chunk[:end - base], non_blocking=True)
            pending[k] = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stubs leave it unannotated
            pending[k].record(stream)
        k = (k + 1) % len(chunks)
