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


@pytest.mark.parametrize("threads", [1, 4])
def test_with_a_destination_the_tensors_are_copied_back_to_back_and_the_copy_is_what_is_checked(monkeypatch, threads):
    monkeypatch.setattr(st, "HASH_THREADS", threads)
    monkeypatch.setattr(st, "PARALLEL_HASH_BYTES", 1 << 20)  # these 5 MiB go to the threads when there are several
    pooled = []
    pool = st._hash_pool
    monkeypatch.setattr(st, "_hash_pool", lambda: (pooled.append(1), pool())[1])
    blobs = [os.urandom(n) for n in (3 << 20, 100, 2 << 20, 1 << 16)]
    _, spans, bucket = bucket_of(blobs)
    # the source holds the tensors with gaps between them (a safetensors body: a header first)
    gap = b"\xee" * 24
    source = memoryview(gap + gap.join(blobs))
    spans = [(s + 24 * (i + 1), e + 24 * (i + 1)) for i, (s, e) in enumerate(spans)]
    into = memoryview(bytearray(bucket.nbytes))
    st.verify_spans(source, spans, bucket, into)
    assert bytes(into) == b"".join(blobs)
    # a damaged source: refused, naming the tensor
    damaged = bytearray(source)
    damaged[spans[2][0]] ^= 0x80
    with pytest.raises(Refused) as e:
        st.verify_spans(memoryview(bytes(damaged)), spans, bucket, memoryview(bytearray(bucket.nbytes)))
    assert e.value.code == "STAGE_DIGEST" and "'t2'" in e.value.message
    assert bool(pooled) == (threads > 1)
    # a destination of another length than the plan's tensors, or read-only, or a source shorter than
    # the tensors' places: refused before anything is copied
    for wrong, what in ((memoryview(bytearray(bucket.nbytes + 1)), "plan says"),
                        (memoryview(bytes(bucket.nbytes)), "read-only")):
        with pytest.raises(Refused) as e:
            st.verify_spans(source, spans, bucket, wrong)
        assert e.value.code == "STAGE_INVALID" and what in e.value.message
    with pytest.raises(Refused) as e:
        st.verify_spans(source[:-1], spans, bucket, memoryview(bytearray(bucket.nbytes)))
    assert e.value.code == "STAGE_INVALID" and "do not fit" in e.value.message


def test_a_copy_that_fails_is_a_typed_refusal_once_every_other_copy_ended(monkeypatch):
    monkeypatch.setattr(st, "HASH_THREADS", 4)
    monkeypatch.setattr(st, "PARALLEL_HASH_BYTES", 0)
    blobs = [os.urandom(1 << 16) for _ in range(8)]
    buf, spans, bucket = bucket_of(blobs)
    ended, real = [], st.copy_bytes

    def copy(dst, src):
        if bytes(src[:16]) == blobs[2][:16]:
            raise OSError("no space left on device")
        real(dst, src)
        ended.append(1)

    monkeypatch.setattr(st, "copy_bytes", copy)
    into = memoryview(bytearray(bucket.nbytes))
    with pytest.raises(Refused) as e:
        st.verify_spans(buf, spans, bucket, into)
    assert e.value.code == "STAGE_DISK" and "'t2'" in e.value.message and "no space left" in e.value.message
    assert len(ended) == 7  # every other tensor was copied before the refusal
    into.release()  # nothing still exports the destination


def test_a_large_copy_leaves_the_gil_to_other_threads():
    """The engine's event loop keeps running while a verifying thread copies a bucket into the
    adapter's file (a memoryview assignment would hold the GIL for the whole copy)."""
    pytest.importorskip("numpy")
    import threading
    import time

    src, dst = memoryview(bytearray(b"\x5a" * (96 << 20))), memoryview(bytearray(96 << 20))
    window: list[float] = []

    def copy() -> None:
        window.append(time.perf_counter())
        st.copy_bytes(dst, src)
        window.append(time.perf_counter())

    t = threading.Thread(target=copy)
    ticks = []
    t.start()
    while t.is_alive():
        ticks.append(time.perf_counter())
    t.join()
    start, end = window
    inside = [x for x in ticks if start < x < end]
    assert dst == src
    assert len(inside) >= 100, f"the main thread ran {len(inside)} times during a {1e3 * (end - start):.0f} ms copy"
