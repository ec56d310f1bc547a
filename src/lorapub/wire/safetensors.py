"""Safetensors without a framework: a header for tensors back to back, the layout of a received
blob checked against the plan, and every tensor's SHA-256."""

from __future__ import annotations

import hashlib
import json

from lorapub.core.manifest import Bucket, TensorEntry
from lorapub.wire.dtypes import SAFETENSORS_DTYPES
from lorapub.wire.refusal import Refused, bad

__all__ = ["safetensors_header", "safetensors_layout", "verify_spans", "raw_spans"]


def safetensors_header(entries: list[TensorEntry]) -> bytes:
    """The header of a safetensors file holding ``entries`` back to back (8-byte length + JSON, padded)."""
    header, offset = {}, 0
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {e.name!r} has dtype {e.dtype}, which safetensors cannot store")
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def safetensors_layout(blob: memoryview, bucket: Bucket) -> list[tuple[int, int]]:
    """(start, end) of each entry's bytes inside a safetensors ``blob``, checked against the plan."""
    if len(blob) < 8:
        raise bad("a safetensors body shorter than its length prefix")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8 or size > 100 << 20:
        raise bad("a safetensors header longer than the body")
    try:
        header = json.loads(bytes(blob[8 : 8 + size]))
    except ValueError:
        raise bad("a safetensors header that is not JSON") from None
    header.pop("__metadata__", None)
    if sorted(header) != sorted(bucket.tensor_names):
        raise bad(f"bucket {bucket.index} holds {sorted(header)[:4]}…, the plan says {list(bucket.tensor_names)[:4]}…")
    base, spans = 8 + size, []
    for e in bucket.entries:
        h = header[e.name]
        start, end = (int(x) for x in h["data_offsets"])
        if h.get("dtype") != SAFETENSORS_DTYPES.get(e.dtype) or list(h.get("shape", ())) != list(e.shape):
            raise bad(f"tensor {e.name!r} is {h.get('dtype')} {h.get('shape')}, the plan says {e.dtype} {list(e.shape)}")
        if end - start != e.nbytes or base + end > len(blob) or start < 0:
            raise bad(f"tensor {e.name!r} has {end - start} bytes, the plan says {e.nbytes}")
        spans.append((base + start, base + end))
    return spans


def verify_spans(buf: memoryview, spans: list[tuple[int, int]], bucket: Bucket) -> None:
    """Every tensor's bytes against its manifest SHA-256 (one pass; run it off the event loop)."""
    for (start, end), e in zip(spans, bucket.entries):
        if hashlib.sha256(buf[start:end]).hexdigest() != e.sha256:
            raise Refused(400, "STAGE_DIGEST", f"tensor {e.name!r} of bucket {bucket.index} does not match its SHA-256")


def raw_spans(bucket: Bucket) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for e in bucket.entries:
        spans.append((offset, offset + e.nbytes))
        offset += e.nbytes
    return spans
