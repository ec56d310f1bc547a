"""Safetensors without a framework: a header for tensors back to back, the layout of a received
blob checked against the plan, and every tensor's SHA-256."""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import threading
from typing import Any

from lorapub.core.manifest import Bucket, TensorEntry
from lorapub.wire.dtypes import SAFETENSORS_DTYPES
from lorapub.wire.refusal import Refused, bad, refuse

__all__ = ["copy_bytes", "safetensors_header", "safetensors_layout", "verify_spans", "raw_spans"]


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


#: Threads hashing one bucket's tensors at once: the last bucket's check is on the path to READY (about
#: 45 ms for a 64 MiB bucket on one thread), and hashlib releases the GIL while it hashes.
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
#: Below this, one thread hashes the whole bucket (handing work to threads costs more than it saves).
PARALLEL_HASH_BYTES = 8 << 20
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="lorapub-sha256")
        return _pool


#: Below this a copy stays in Python (numpy's call costs more than the GIL it releases).
_NUMPY_COPY_BYTES = 1 << 16


@functools.cache
def _numpy() -> Any:
    """numpy, imported on first use (lorapub does not need it; the engines' Python has it); None without."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch and SGLang
        return None
    return numpy


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` with the GIL released while the bytes move, where numpy is installed (it comes
    with torch and SGLang): a memoryview assignment holds the GIL for the whole copy, about 15 ms per
    64 MiB, and the engine's event loop (its routes, the tokenizer) waits that long."""
    np = _numpy()
    if np is not None and len(src) >= _NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


def verify_spans(buf: memoryview, spans: list[tuple[int, int]], bucket: Bucket,
                 into: memoryview | None = None) -> None:
    """Every tensor's bytes against its manifest SHA-256 (one pass; run it off the event loop), the
    tensors of a large bucket on a few threads at once. With ``into`` (writable, as long as the
    tensors), each tensor is first copied there, back to back in plan order, and the copy is what is
    hashed: the bytes kept are the bytes checked, whatever happens to ``buf`` afterwards. Every copy
    and hash has ended when this returns or raises (the caller frees the buffers then)."""
    checked = spans[:len(bucket.entries)]
    if len(checked) != len(bucket.entries) or any(not 0 <= start <= end <= len(buf) for start, end in checked):
        raise bad(f"bucket {bucket.index}: its tensors' places do not fit its {len(buf)} bytes")
    places, offset = [], 0
    for start, end in checked:
        places.append((offset, offset + end - start))
        offset += end - start
    if into is not None and len(into) != offset:
        raise bad(f"bucket {bucket.index} has {offset} bytes of tensors, but the plan says {len(into)}")
    if into is not None and into.readonly:
        raise bad(f"bucket {bucket.index}: its destination is read-only")

    def digest(i: int) -> str | _Failed:
        start, end = checked[i]
        try:
            if into is None:
                return hashlib.sha256(buf[start:end]).hexdigest()
            lo, hi = places[i]
            copy_bytes(into[lo:hi], buf[start:end])
            return hashlib.sha256(into[lo:hi]).hexdigest()
        except Exception as e:  # noqa: BLE001 - kept as text: no traceback keeps the buffers exported
            return _Failed(f"{type(e).__name__}: {e}")

    large = HASH_THREADS > 1 and len(checked) > 1 and offset >= PARALLEL_HASH_BYTES
    found = list((_hash_pool().map if large else map)(digest, range(len(checked))))  # digest never raises
    for e, got in zip(bucket.entries, found):
        if isinstance(got, _Failed):
            raise refuse(f"keeping tensor {e.name!r} of bucket {bucket.index} failed: {got.why}", "STAGE_DISK")
        if got != e.sha256:
            raise Refused(400, "STAGE_DIGEST", f"tensor {e.name!r} of bucket {bucket.index} does not match its SHA-256")


class _Failed:
    """A tensor whose copy or hash raised (what it raised, as text)."""

    def __init__(self, why: str) -> None:
        self.why = why


def raw_spans(bucket: Bucket) -> list[tuple[int, int]]:
    spans, offset = [], 0
    for e in bucket.entries:
        spans.append((offset, offset + e.nbytes))
        offset += e.nbytes
    return spans
