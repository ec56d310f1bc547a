"""The thin receivers: a staging message, decoded by its one codec (:mod:`lorapub.wire.messages`),
checked against this engine as the machine's command takes it; a bucket's bytes off the wire into their
landing. What is wrong with a message is captured as a refusal value the machine answers in its turn
(after the tombstone, the life and a duplicate), so a message is refused for the same reason whichever
way it came.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import attrs

from lorapub.core.identity import lora_name_for
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.core.staging.messages import Refusal
from lorapub.sglang_patch.staging import collective
from lorapub.sglang_patch.staging.buffers import Buffer
from lorapub.sglang_patch.staging.landing import Stash, from_shm, landing
from lorapub.wire.codec import manifest_digest
from lorapub.wire.messages import BeginBody, BeginSent, BucketParams, BucketSent
from lorapub.wire.refusal import Refused, bad, refuse
from lorapub.wire.routes import MANAGED_PREFIX_ENV
from lorapub.wire.safetensors import raw_spans, safetensors_header, safetensors_layout

__all__ = ["BeginRequest", "begin_request", "bucket_request", "drain", "fill", "read_all", "read_control",
           "receive_bytes", "refusal_of"]


def refusal_of(e: Refused | None) -> Refusal | None:
    return None if e is None else e.value()


@attrs.frozen
class BeginRequest:
    """A begin as the machine's ``Begin`` takes it: the body as sent, the checked body (None: ``problem``
    says what is wrong with it), ``late_problem`` (what only a new attempt meets) and ``header``, a dir
    load's safetensors header."""

    sent: BeginSent
    body: BeginBody | None = None
    header: bytes = b""
    problem: Refusal | None = None
    late_problem: Refusal | None = None

    @property
    def plan(self) -> BucketPlan | None:
        return None if self.body is None else self.body.plan

    @property
    def load(self) -> str:
        return "dir" if self.body is None else self.body.load

    @property
    def kind(self) -> str:
        return "http" if self.body is None else self.body.kind  # one of http, shm, torch (checked)

    @property
    def sizes(self) -> tuple[int, ...]:
        return () if self.body is None else tuple(b.nbytes for b in self.body.plan.buckets)


def _checked(sent: BeginSent, prefix: str) -> BeginBody:
    """The body, checked against this engine: its managed name, its plan's digest, torch where needed."""
    body = sent.checked()
    expected_name = lora_name_for(body.token.version, body.digest, prefix)
    if body.lora_name != expected_name:
        raise bad(f"lora_name {body.lora_name!r} is not the managed name of {body.token.version} ({expected_name}): "
                  f"this engine protects names starting with {prefix!r} (launch it with {MANAGED_PREFIX_ENV} set to "
                  "the deployment's name_prefix)")
    if body.plan.digest != body.digest or manifest_digest(body.plan) != body.digest:
        raise Refused(400, "STAGE_DIGEST", f"the bucket plan does not describe digest {body.digest[:12]}")
    if body.load == "tensors" or body.kind == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise refuse(f"{body.kind} transport / {body.load} load needs torch in the engine process") from None
    return body


def begin_request(sent: BeginSent, prefix: str) -> BeginRequest:
    """A begin as sent; ``prefix``: the names the engine protects."""
    try:
        body = _checked(sent, prefix)
    except Refused as e:
        return BeginRequest(sent, problem=refusal_of(e))
    header, late = b"", None
    try:
        if body.load == "dir":  # refuses a dtype it cannot store
            header = safetensors_header([e for b in body.plan.buckets for e in b.entries])
        if body.kind == "torch":
            late = collective.transport_problem(body.transport)
    except Refused as e:
        late = e
    return BeginRequest(sent, body, header, None, refusal_of(late))


def bucket_request(sent: BucketSent) -> tuple[BucketParams | None, Refusal | None]:
    """A bucket's query parameters as sent: checked, or what is wrong with them."""
    try:
        return sent.checked(), None
    except Refused as e:
        return None, refusal_of(e)


# -- body streams -------------------------------------------------------------------------------------
async def fill(view: memoryview, chunks: AsyncIterator[bytes] | None, what: str) -> None:
    """Read the body into ``view``: exactly its size, no more, no less."""
    got = 0
    if chunks is not None:
        stream = chunks.__aiter__()
        while True:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                break
            except Exception as e:  # noqa: BLE001 - the body broke off: its sender went away (a cancelled publish)
                raise bad(f"{what} broke off after {got} of {len(view)} bytes: its sender went away "
                          f"({type(e).__name__})") from None
            n = len(chunk)
            if got + n > len(view):
                raise bad(f"{what} is longer than its {len(view)} bytes")
            view[got : got + n] = chunk
            got += n
    if got != len(view):
        raise bad(f"{what} ended after {got} of {len(view)} bytes")


async def read_all(chunks: AsyncIterator[bytes] | None, limit: int) -> bytes:
    out = bytearray()
    if chunks is not None:
        async for chunk in chunks:
            out += chunk
            if len(out) > limit:
                raise bad(f"a control body longer than {limit} bytes")
    return bytes(out)


async def read_control(chunks: AsyncIterator[bytes] | None) -> Any:
    """The small JSON object a shared-memory or torch bucket's body is (:class:`~lorapub.wire.messages.ShmControl`,
    :class:`~lorapub.wire.messages.TorchControl`, decoded where it is used)."""
    text = await read_all(chunks, 1 << 16)
    try:
        return json.loads(text or b"{}")
    except ValueError:
        raise bad(f"a bucket's control body that is not JSON: {text[:80]!r}") from None


async def drain(chunks: AsyncIterator[bytes]) -> None:
    try:
        async for _ in chunks:
            pass
    except Exception:  # noqa: BLE001 - already consumed, or the client went away
        pass


async def receive_bytes(stash: Stash, bucket: Bucket, fmt: str, chunks: AsyncIterator[bytes] | None,
                        length: int | None, shm_dir: str) -> tuple[Buffer, list[tuple[int, int]]]:
    """A bucket's bytes in their landing: ``raw`` (the tensors back to back in plan order, straight
    into the landing), ``safetensors`` (a blob in a buffer of its own size, entries found by its
    header) or ``shm`` (the publisher's shared-memory file)."""
    if fmt == "shm":
        control = await read_control(chunks)
        return await asyncio.to_thread(from_shm, stash, bucket, control, shm_dir)
    if fmt == "raw":
        buf = await asyncio.to_thread(landing, stash, bucket)
    else:
        if length is None:  # the machine admits a safetensors bucket only with its Content-Length
            raise bad("a safetensors bucket needs a Content-Length within its plan's size")
        buf = await asyncio.to_thread(Buffer, length, stash.load == "tensors", populate=True)
    try:
        await fill(buf.view, chunks, f"bucket {bucket.index}")
        return buf, raw_spans(bucket) if fmt == "raw" else safetensors_layout(buf.view, bucket)
    except BaseException:
        buf.close()
        raise
