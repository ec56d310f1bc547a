"""Reading an adapter folder for a preparation: one ``readinto`` with the GIL released, then
SGLang's own processing a tensor a step."""

from __future__ import annotations

import os
from typing import Any, Callable

from lorapub.wire.dtypes import SAFETENSORS_DTYPES

__all__ = ["SAFETENSORS_CODES", "Stepped", "read_peft_folder", "weight_dicts"]


class Stepped(dict):
    """The tensors handed to SGLang's ``initialize_weights_from_tensors``, which walks ``items()``:
    each tensor is handed over after one step of the gate."""

    def __init__(self, tensors: dict, step: Callable[[], None]) -> None:
        super().__init__(tensors)
        self._step = step

    def items(self):  # type: ignore[override]
        for item in super().items():
            self._step()
            yield item




#: safetensors code -> torch dtype name, for the dtypes lorapub publishes (another folder's dtype: SGLang's reader)
SAFETENSORS_CODES = {code: name for name, code in SAFETENSORS_DTYPES.items()}


def read_peft_folder(path: Any, step: Callable[[], None] | None = None) -> dict[str, Any] | None:
    """The tensors of a local PEFT folder holding one ``adapter_model.safetensors`` (and no other
    weight file), read into one host buffer with a single ``readinto`` (the GIL is released for the
    whole read; SGLang's reader copies tensor by tensor holding it), as views of that buffer.
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
        data = torch.empty(size - 8 - n, dtype=torch.uint8)
        view, got = memoryview(data.numpy()), 0
        while got < len(view):
            r = f.readinto(view[got:])
            if not r:
                return None
            got += r
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
        raw = data[start:end] if start % itemsize == 0 else data[start:end].clone()
        tensors[name] = raw.view(dtype).view(shape)
    return tensors



def weight_dicts(adapter: Any) -> list[dict]:
    return [layer.weights for layer in adapter.layers] + [
        d for d in (getattr(adapter, "embedding_layers", None), getattr(adapter, "added_tokens_embeddings", None))
        if d]

