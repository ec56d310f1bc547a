"""Every tensor's SHA-256 against the manifest (lorapub.wire.safetensors.verify_spans): a large bucket's
tensors are hashed on a few threads, and the verdict is the same as one thread's."""

from __future__ import annotations

import hashlib
import os

import pytest

from lorapub.core.manifest import Bucket, TensorEntry
from lorapub.wire import safetensors as st
from lorapub.wire.refusal import Refused


def bucket_of(blobs: list[bytes]) -> tuple[memoryview, list[tuple[int, int]], Bucket]:
    entries, spans, offset = [], [], 0
    for i, b in enumerate(blobs):
        entries.append(TensorEntry(f"t{i}", "U8", (len(b),), len(b), hashlib.sha256(b).hexdigest()))
        spans.append((offset, offset + len(b)))
        offset += len(b)
    total = sum(len(b) for b in blobs)
    return memoryview(b"".join(blobs)), spans, Bucket(0, tuple(entries), total, "0" * 64)


@pytest.mark.parametrize("size", [1 << 10, 3 << 20])  # below and above PARALLEL_HASH_BYTES in all
@pytest.mark.parametrize("threads", [1, 4])
def test_the_verdict_names_the_tensor_that_does_not_match_whatever_the_threads(monkeypatch, size, threads):
    monkeypatch.setattr(st, "HASH_THREADS", threads)
    blobs = [os.urandom(size) for _ in range(6)]
    buf, spans, bucket = bucket_of(blobs)
    st.verify_spans(buf, spans, bucket)  # all match
    for bad in (0, 4, 5):
        damaged = bytearray(buf)
        damaged[spans[bad][0] + size // 2] ^= 0x01
        with pytest.raises(Refused) as e:
            st.verify_spans(memoryview(bytes(damaged)), spans, bucket)
        assert e.value.code == "STAGE_DIGEST" and f"'t{bad}'" in e.value.message
