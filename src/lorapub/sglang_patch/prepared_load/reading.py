"""Reading an adapter folder for a preparation (in the helper process): the safetensors file mapped (no
read, no copy: its pages come from the page cache where the engine's staging just wrote them, touched
once by SGLang's processing or the copy to the device)."""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable

from lorapub.wire.dtypes import SAFETENSORS_DTYPES

__all__ = ["SAFETENSORS_CODES", "read_peft_folder", "weight_places"]


#: safetensors code -> torch dtype name, for the dtypes lorapub publishes (another folder's dtype: SGLang's reader)
SAFETENSORS_CODES = {code: name for name, code in SAFETENSORS_DTYPES.items()}


def read_peft_folder(path: Any, step: Callable[[], None] | None = None) -> dict[str, Any] | None:
    """The tensors of a local PEFT folder holding one ``adapter_model.safetensors`` (and no other
    weight file), as views of the file mapped copy-on-write: nothing is read here, the tensors' pages
    are touched once, by whoever copies them next (SGLang's processing, the copy to the device).
    A private mapping: writing a tensor never changes the file, and the file's later removal leaves
    the mapping readable. (Reading the whole file into a host buffer first cost one more full pass
    over the bytes: 170-230 ms for 264 MB live, the largest part of a preparation.)
    None for any other layout, which SGLang's own reader then handles."""
    import json

    import torch

    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if "adapter_model.safetensors" not in names or any(
            n != "adapter_model.safetensors" and (n.endswith((".safetensors", ".bin", ".pt")) or n.endswith(".index.json"))
            for n in names):
        return None
    with open(os.path.join(path, "adapter_model.safetensors"), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            return None
        header = json.loads(f.read(n))
        if size - 8 - n == 0:
            data = torch.empty(0, dtype=torch.uint8)
        else:  # the mapping outlives the descriptor, and the file's removal
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            data = torch.frombuffer(mapped, dtype=torch.uint8, offset=8 + n)
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if step is not None:
            step()
        dtype = getattr(torch, SAFETENSORS_CODES.get(meta.get("dtype"), ""), None)
        if not isinstance(dtype, torch.dtype):
            return None
        start, end = meta["data_offsets"]
        shape = meta["shape"]
        count = 1
        for d in shape:
            count *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - start != count * itemsize or end > len(data):
            return None
        # a view where both its place in the data and in memory suit the dtype (safetensors pads its
        # header to 8 bytes), a copy otherwise
        aligned = start % itemsize == 0 and (8 + n) % itemsize == 0
        raw = data[start:end] if aligned else data[start:end].clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors



def weight_places(adapter: Any) -> list[tuple[int | str, dict[str, Any]]]:
    """An adapter's weight dicts, each with its place (``helper.Entry.where``): each layer's by its index,
    then its ``embedding_layers`` and ``added_tokens_embeddings`` where it has them. The helper ships
    weights in this order; the scheduler's process fills a new adapter's dicts by these places."""
    found: list[tuple[int | str, dict[str, Any]]] = [(i, layer.weights) for i, layer in enumerate(adapter.layers)]
    for attr in ("embedding_layers", "added_tokens_embeddings"):
        d = getattr(adapter, attr, None)
        if d is not None:
            found.append((attr, d))
    return found