"""The tensor dtypes lorapub publishes: one table, read by ``Snapshot`` and by engine-side staging.

A dtype is named as the manifest names it (the tensor's dtype without ``torch.``, a numpy array's
``dtype.name``) and maps to its safetensors code, which is how engine-side staging describes the bytes
it receives. A snapshot refuses every other dtype before anything is sent, so a publication never fails
late on one. Pure data: importable without torch or numpy.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = ["SAFETENSORS_DTYPES", "ACCEPTED"]

#: manifest dtype name -> safetensors dtype code, for every dtype a version may hold.
SAFETENSORS_DTYPES: Mapping[str, str] = MappingProxyType({
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
})

#: The accepted names, for messages.
ACCEPTED = ", ".join(SAFETENSORS_DTYPES)
