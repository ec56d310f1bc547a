"""Slot images: what SGLang's per-weight slot fill would write into a memory-pool slot, made while
preparing (by the helper process from a recorded plan, image_plan.py, once one was learned for the
adapter's layout) and copied into a slot with one ``_foreach_copy_``."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable, Iterator

from . import iterations
from .image_plan import ImagePlan, image_layout, learn, recorder
from .settings import MARK

__all__ = ["IMAGE_ATTR", "SLOT_BUFFERS", "SlotImage", "build_slot_image", "image_from_flats", "image_views",
           "install_slot_fill", "make_resident", "slot_buffers", "trace_slot_fills"]

logger = logging.getLogger("lorapub.sglang_patch.prepared_load")  # one logger for the whole patch


#: The memory pool's per-slot buffers (slot first), as both supported releases name them.
SLOT_BUFFERS = ("A_buffer", "B_buffer", "embedding_A_buffer", "embedding_B_buffer", "lm_head_A_buffer",
                "lm_head_B_buffer", "new_embeddings_buffer")
IMAGE_ATTR = "_lorapub_slot_image"


def slot_buffers(pool: Any) -> list[Any] | None:
    """Every tensor of ``pool`` that has one row per slot, in a fixed order; None for another layout."""
    import torch

    slots = getattr(pool, "max_loras_per_batch", None)
    found = []
    for attr in SLOT_BUFFERS:
        buffers = getattr(pool, attr, None)
        if not isinstance(buffers, dict):
            return None
        for value in buffers.values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != slots:
                    return None
                found.append(t)
    return found


def _slot_views(pool: Any, buffers: list[Any]) -> list[list[Any]]:
    """Each slot's view of every buffer, made once per pool (thousands of views: not per image)."""
    cached = getattr(pool, "__dict__", {}).get("_lorapub_slot_views")
    if cached is not None and len(cached[0]) == len(buffers) and all(a is b for a, b in zip(cached[0], buffers)):
        views: list[list[Any]] = cached[1]
        return views
    views = [[b[slot] for b in buffers] for slot in range(buffers[0].shape[0])]
    try:
        pool.__dict__["_lorapub_slot_views"] = (list(buffers), views)
    except AttributeError:  # a pool without a __dict__: made per image
        pass
    return views


def image_views(buffers: list[Any], flats: dict[Any, Any], step: Callable[[], None] | None = None) -> list[Any]:
    """One slot of each buffer, as a ``(1, *slot)`` view into the image's flat of its dtype: the buffers
    of a dtype lie one after another in ``buffers``' order (``flats``: dtype -> flat tensor). ``step`` is
    called every 32 views (the preparing thread's gate)."""
    offsets = dict.fromkeys(flats, 0)
    images = []
    for i, b in enumerate(buffers):
        if step is not None and i % 32 == 0:
            step()
        n, at = b[0].numel(), offsets[b.dtype]
        images.append(flats[b.dtype][at:at + n].view((1, *b.shape[1:])))
        offsets[b.dtype] = at + n
    return images


def image_from_flats(pool: Any, flats: list[Any], plan: ImagePlan,
                     step: Callable[[], None] | None = None) -> SlotImage | None:
    """The slot image for ``pool`` held in ``flats`` (made by replaying ``plan``: the helper's), or None
    where the pool's buffers are no longer the layout the plan was learned for (``step``: as
    :func:`image_views`)."""
    buffers = slot_buffers(pool) if pool is not None else None
    if not buffers or image_layout(buffers) != plan.layout or len(flats) != len(plan.flats):
        return None
    by_dtype = {f.dtype: f for f in flats}
    if len(by_dtype) != len(flats):
        return None
    return SlotImage(pool, buffers, flats, [im[0] for im in image_views(buffers, by_dtype, step)], plan)


class SlotImage:
    """What SGLang's first batch writes into a memory-pool slot for one adapter, on the device (zeros
    where that fill leaves the slot's earlier contents: past the rank, and modules a layer lacks).

    Built off the scheduler thread by running SGLang's own ``load_lora_weight_to_buffer`` against a copy
    of the pool whose buffers have a single slot; a fill is then one ``torch._foreach_copy_`` from the
    image into the slot (a few hundred microseconds on the scheduler thread instead of the tens of
    milliseconds SGLang's per-weight Python takes)."""

    def __init__(self, pool: Any, buffers: list[Any], flats: list[Any], sources: list[Any],
                 plan: ImagePlan | None = None) -> None:
        self.pool, self.flats, self.sources, self.buffers = pool, flats, sources, buffers
        self.views = _slot_views(pool, buffers)
        #: how the helper builds the next image of this layout (learned from this one's build), if it can
        self.plan = plan

    def fits(self, pool: Any, buffer_id: int) -> bool:
        """Still the pool, and every one of the very buffers, this image was made for."""
        if pool is not self.pool or not 0 <= buffer_id < len(self.views):
            return False
        current = slot_buffers(pool)  # one walk of a few hundred references, at an adapter's first batch
        return current is not None and len(current) == len(self.buffers) and all(
            a is b for a, b in zip(current, self.buffers))

    def fill(self, buffer_id: int) -> None:
        import torch

        torch._foreach_copy_(self.views[buffer_id], self.sources, non_blocking=True)
        if self.flats[0].device.type == "cuda":  # an unload must not hand the image's blocks out while this copy reads them
            stream = torch.cuda.current_stream(self.flats[0].device)
            for flat in self.flats:
                flat.record_stream(stream)


class _SteppedLayers(list[Any]):
    """An adapter's layers as SGLang's slot fill walks them: one gate step per layer it takes."""

    def __init__(self, layers: Any, step: Callable[[], None]) -> None:
        super().__init__(layers)
        self._step = step

    def __getitem__(self, index: Any) -> Any:
        self._step()
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[Any]:
        for layer in super().__iter__():
            self._step()
            yield layer


class _SteppedAdapter:
    """``adapter`` as SGLang's slot fill reads it, with :class:`_SteppedLayers`; all else is the adapter's."""

    def __init__(self, adapter: Any, step: Callable[[], None]) -> None:
        self._adapter = adapter
        self.layers = _SteppedLayers(adapter.layers, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)


def build_slot_image(manager: Any, adapter: Any, stream: Any = None, step: Callable[[], None] | None = None,
                     learn_from: tuple[Any, tuple[Any, ...]] | None = None) -> SlotImage | None:
    """``adapter``'s slot image for ``manager``'s memory pool, or None (the pool's layout is not known,
    or SGLang's own fill refused the adapter: its first batch then runs SGLang's fill, as stock).
    ``step`` is called before each layer SGLang's fill takes, on each of its walks over the layers
    (the preparing thread's gate). With ``learn_from`` (the adapter's shipped buffer, and its entries),
    the fill is recorded, and the image's ``plan`` says how to make the next one of this layout without
    it (image_plan.py), where the fill is a gather from that buffer."""
    import contextlib

    import torch

    pool: Any = getattr(manager, "memory_pool", None)  # SGLang's LoRAMemoryPool
    buffers = slot_buffers(pool) if pool is not None else None
    if not buffers:
        return None
    stock = type(pool).load_lora_weight_to_buffer
    while getattr(stock, MARK, False):  # SGLang's own fill, under lorapub's wrappers
        stock = stock.__wrapped__
    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    plan = None
    try:
        with context:
            by_dtype: dict[Any, list[Any]] = {}
            for b in buffers:
                by_dtype.setdefault(b.dtype, []).append(b)
            flats = {dtype: torch.zeros(sum(b[0].numel() for b in group), dtype=dtype, device=group[0].device)
                     for dtype, group in by_dtype.items()}
            images = image_views(buffers, flats)
            scratch = copy.copy(pool)  # SGLang's own fill, writing slot 0 of one-slot buffers
            it = iter(images)
            for attr in SLOT_BUFFERS:
                setattr(scratch, attr, {k: type(v)(next(it) for _ in v) if isinstance(v, (list, tuple)) else next(it)
                                        for k, v in getattr(pool, attr).items()})
            scratch.pin_memory_available = False  # pinning here would stall the scheduler's CUDA calls
            read = adapter if step is None else _SteppedAdapter(adapter, step)
            watch: Any = recorder(list(flats.values()), learn_from[0]) if learn_from is not None else None
            with watch if watch is not None else contextlib.nullcontext():
                stock(scratch, adapter.uid, 0, read, manager.lora_modules, getattr(manager, "embed_tokens_module", None),
                      getattr(manager, "lm_head_module", None))
            if learn_from is not None:
                try:
                    plan = learn(watch, learn_from[1], buffers, list(flats.values()), learn_from[0])
                except Exception as e:  # noqa: BLE001 - the image stands; only the plan is lost
                    watch.refused = f"checking the recorded fill failed: {e}"
                if plan is None:
                    logger.info("lorapub: slot images of %s's layout are built per load on the preparing thread (%s)",
                                getattr(adapter, "uid", "?"), watch.refused or "replaying the recorded fill "
                                "did not give the same image")
        if stream is not None:
            stream.synchronize()
    except Exception as e:  # noqa: BLE001 - SGLang's own fill at the first batch reports it, as stock
        logger.info("lorapub: no slot image for %s (%s); its first batch fills the slot the stock way",
                    getattr(adapter, "uid", "?"), e)
        return None
    return SlotImage(pool, buffers, list(flats.values()), [im[0] for im in images], plan)


def make_resident(manager: Any, uid: str) -> int | None:
    """Put the adapter ``uid`` into a free memory-pool slot now, from its slot image, so that the first
    batch that uses it finds it resident (SGLang's batch preparation skips a uid it already maps to a
    slot): the fill is one device-to-device ``_foreach_copy_`` on the scheduler thread's stream, queued
    before every batch it launches later. Only an empty slot is taken (never one a batch or another
    adapter holds), so nothing is evicted; the slot is the one SGLang would have given the adapter's
    first batch. Returns the slot, or None where the adapter keeps SGLang's own first-batch fill (no
    image, no empty slot, a pool of another layout)."""
    import sys

    pool = getattr(manager, "memory_pool", None)
    adapter = getattr(manager, "loras", {}).get(uid)
    image = adapter.__dict__.get(IMAGE_ATTR) if adapter is not None else None
    owners = getattr(pool, "buffer_id_to_uid", None)
    mapped = getattr(pool, "uid_to_buffer_id", None)
    empty = getattr(sys.modules.get(type(pool).__module__), "EMPTY_SLOT", None)
    if image is None or owners is None or mapped is None or empty is None or uid in mapped:
        return None
    free = next((i for i, owner in enumerate(owners) if owner is empty), None)
    if free is None or not image.fits(pool, free):
        return None
    t0 = time.perf_counter()
    image.fill(free)
    mapped[uid] = free
    owners[free] = uid
    policy = getattr(pool, "eviction_policy", None)
    if policy is not None:
        policy.mark_used(uid)
    notify = getattr(manager, "_notify_lora_slots_updated", None)  # what SGLang calls after a batch's fills
    if callable(notify):
        notify({free})
    iterations.note("fill", time.perf_counter() - t0)
    return free


def install_slot_fill(pool_cls: Any) -> None:
    stock = pool_cls.load_lora_weight_to_buffer

    def load_lora_weight_to_buffer(self: Any, uid: Any, buffer_id: Any, lora_adapter: Any, *args: Any,
                                   **kwargs: Any) -> Any:
        """SGLang's slot fill, served by the adapter's slot image when it has one for this pool."""
        image = getattr(lora_adapter, "__dict__", {}).get(IMAGE_ATTR) if lora_adapter is not None else None
        if image is not None and image.fits(self, buffer_id):
            return image.fill(buffer_id)
        return stock(self, uid, buffer_id, lora_adapter, *args, **kwargs)

    setattr(load_lora_weight_to_buffer, "__wrapped__", stock)
    setattr(load_lora_weight_to_buffer, MARK, True)
    pool_cls.load_lora_weight_to_buffer = load_lora_weight_to_buffer


def trace_slot_fills(pool_cls: Any) -> None:
    """Log how long the scheduler thread spends filling a memory-pool slot (an adapter's first batch)."""
    stock = pool_cls.load_lora_weight_to_buffer

    def load_lora_weight_to_buffer(self: Any, uid: Any, buffer_id: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return stock(self, uid, buffer_id, *args, **kwargs)
        finally:
            iterations.note("fill", time.perf_counter() - t0)
            logger.info("lorapub trace: slot %s filled with %s in %.1f ms at %.3f", buffer_id, uid,
                        1e3 * (time.perf_counter() - t0), time.time())

    setattr(load_lora_weight_to_buffer, "__wrapped__", stock)
    setattr(load_lora_weight_to_buffer, MARK, True)
    pool_cls.load_lora_weight_to_buffer = load_lora_weight_to_buffer

