"""The thin receivers: a staging message's body as the machine's command, and a bucket's bytes off
the wire into their landing.

Parsing only: what is wrong with a message is captured as a refusal value the machine answers in
its turn (after the tombstone, the life and a duplicate), so a message is refused for the same
reason whichever way it came.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Mapping

import attrs

from lorapub.core.identity import AttemptToken, lora_name_for
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.sglang_patch.staging import collective
from lorapub.sglang_patch.staging.buffers import Buffer
from lorapub.sglang_patch.staging.landing import Stash, from_shm, landing
from lorapub.core.staging.messages import Refusal
from lorapub.wire.codec import manifest_digest, plan_from_json
from lorapub.wire.refusal import Refused, bad, refuse
from lorapub.wire.routes import FORMATS, LOAD_FORMS, MANAGED_PREFIX_ENV
from lorapub.wire.safetensors import raw_spans, safetensors_header, safetensors_layout

__all__ = ["BeginRequest", "begin_request", "bucket_request", "drain", "fill", "read_all", "read_control",
           "receive_bytes", "refusal_of"]


def refusal_of(e: Refused | None) -> Refusal | None:
    return None if e is None else Refusal(e.status, e.code, e.message)


@attrs.frozen
class BeginRequest:
    """A begin's body, parsed: ``problem`` / ``late_problem`` as the machine's ``Begin`` takes them;
    ``header``: a dir load's safetensors header."""

    lora_name: Any  # as the body gave them (checked unless there is a problem)
    digest: Any
    plan: BucketPlan | None = None
    transport: dict[str, Any] = attrs.field(factory=dict)
    load: Any = "dir"
    header: bytes = b""
    problem: Refusal | None = None
    late_problem: Refusal | None = None

    @property
    def kind(self) -> str:
        return str(self.transport.get("kind", "http"))  # one of http, shm, torch (checked)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(b.nbytes for b in self.plan.buckets) if self.plan is not None else ()


def _checked(body: Mapping[str, Any], token: AttemptToken, prefix: str) -> tuple[BucketPlan, dict[str, Any], str]:
    digest: Any = body.get("digest")  # a JSON value: the checks below say what it is
    lora_name = body.get("lora_name")
    plan = plan_from_json(body.get("plan"))
    try:
        expected_name = lora_name_for(token.version, digest, prefix)
    except Exception:  # noqa: BLE001
        raise bad(f"digest {digest!r:.80} is not a SHA-256 hex digest") from None
    if lora_name != expected_name:
        raise bad(f"lora_name {lora_name!r} is not the managed name of {token.version} ({expected_name}): this "
                  f"engine protects names starting with {prefix!r} (launch it with {MANAGED_PREFIX_ENV} set to the "
                  "deployment's name_prefix)")
    if plan.digest != digest or manifest_digest(plan) != digest:
        raise Refused(400, "STAGE_DIGEST", f"the bucket plan does not describe digest {str(digest)[:12]}")
    transport = dict(body.get("transport") or {"kind": "http"})
    kind = transport.get("kind", "http")
    if kind not in ("http", "shm", "torch"):
        raise bad(f"unknown transport {kind!r}")
    load = body.get("load", "dir")
    if load not in LOAD_FORMS:
        raise bad(f"unknown load form {load!r}; one of {LOAD_FORMS}")
    if load == "tensors" or kind == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise refuse(f"{kind} transport / {load} load needs torch in the engine process") from None
    return plan, transport, load


def begin_request(body: Mapping[str, Any], token: AttemptToken, prefix: str) -> BeginRequest:
    """A begin's body (a JSON object) for ``token``; ``prefix``: the names the engine protects."""
    digest, lora_name = body.get("digest"), body.get("lora_name")
    try:
        plan, transport, load = _checked(body, token, prefix)
    except Refused as e:
        return BeginRequest(lora_name, digest, problem=refusal_of(e))
    header, late = b"", None
    try:
        if load == "dir":  # refuses a dtype it cannot store
            header = safetensors_header([e for b in plan.buckets for e in b.entries])
        if transport.get("kind") == "torch":
            late = collective.transport_problem(transport)
    except Refused as e:
        late = e
    return BeginRequest(lora_name, digest, plan, transport, load, header, None, refusal_of(late))


def bucket_request(params: Mapping[str, str]) -> tuple[int, str, Refusal | None]:
    """(index, format, what is wrong with them) of a bucket's query parameters."""
    problem, index = None, -1
    try:
        index = int(params.get("index", ""))
    except ValueError:
        problem = bad(f"bucket index {params.get('index')!r} is not an int")
    fmt = params.get("format", "raw")
    if problem is None and fmt not in FORMATS:
        problem = bad(f"unknown bucket format {fmt!r}")
    return index, fmt, refusal_of(problem)


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
    """The small JSON object a shared-memory or torch bucket's body is."""
    return json.loads(await read_all(chunks, 1 << 16) or b"{}")


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
