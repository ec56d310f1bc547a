"""HTTPBytes: each bucket's tensors streamed as the body of one POST, straight from the frozen
snapshot's memory (no serialisation, no copy); cross-host, the default."""


import asyncio
import logging
from typing import Any, AsyncIterator, Iterator


from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.errors import InvalidInput
from lorapub.ports import BucketPost, BucketSource
from lorapub.snapshot import Snapshot, tensor_bytes
from lorapub.wire.routes import LOAD_FORMS

__all__ = ['CHUNK', 'HTTPBytes', 'RawBucket', 'SENDERS', 'WireBucketSource']

logger = logging.getLogger("lorapub.adapters.sglang_wire")

SENDERS = ("auto", "thread", "loop")  # where HTTPBytes' bodies are posted from (see HTTPBytes)
CHUNK = 128 << 10  # a streamed body is written in slices of this size (views, never copies): small
# slices keep what the socket transport buffers (and moves) per write small, so the loop never stalls


class RawBucket:
    """Bucket ``index`` of a frozen snapshot as it travels: its tensors back to back in plan order,
    read straight from the snapshot (``len`` is the plan's size; ``chunks()`` yields views)."""

    def __init__(self, snapshot: Snapshot, bucket: Bucket) -> None:
        self.snapshot, self.bucket = snapshot, bucket

    def __len__(self) -> int:
        return self.bucket.nbytes

    def views(self) -> Iterator[memoryview]:
        for entry in self.bucket.entries:
            view = tensor_bytes(self.snapshot.tensor(entry.name))
            for start in range(0, len(view), CHUNK):
                yield view[start : start + CHUNK]

    async def chunks(self) -> AsyncIterator[memoryview]:
        for view in self.views():
            yield view
            # A socket that takes every write at once would let the whole bucket go out in one step
            # of the event loop; yield after each slice so the caller's loop keeps running.
            await asyncio.sleep(0)  # a scheduling point, no timer


class HTTPBytes:
    """Buckets as HTTP bodies (cross-host; the default). ``load``: ``"dir"`` (the engine writes a PEFT
    folder on its own disk and loads it) or ``"tensors"`` (SGLang's ``load_lora_adapter_from_tensors``).

    ``sender``: where the bodies are posted from. ``"thread"``: lorapub's sender thread, with a
    session of its own (:mod:`lorapub.adapters.body_sender`), so the socket sends of hundreds of
    megabytes never run on the caller's event loop. ``"loop"``: the caller's loop, through the
    engine's session. ``"auto"`` (default): the thread, unless the engine was given an aiohttp
    session of the caller's (whose settings, such as a TLS context or a proxy, every request to
    that engine then keeps).

    Instances made with the same options are one way of sending (equal); a subclass that keeps
    per-attempt state of its own (as :class:`TorchDistributed` does) equals only itself.
    """

    kind = "http"

    def __init__(self, *, load: str = "dir", sender: str = "auto") -> None:
        if load not in LOAD_FORMS:
            raise InvalidInput(f"load must be one of {LOAD_FORMS}, got {load!r}")
        if sender not in SENDERS:
            raise InvalidInput(f"sender must be one of {SENDERS}, got {sender!r}")
        self.load, self.sender = load, sender

    def __repr__(self) -> str:
        return f"{type(self).__name__}(load={self.load!r}, sender={self.sender!r})"

    def _value(self) -> tuple[object, ...]:
        return (type(self), self.load, self.sender)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HTTPBytes) and self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())

    def source(self, snapshot: Snapshot, plan: BucketPlan) -> BucketSource:
        return WireBucketSource(snapshot, plan)

    def begin_options(self, request: SendBegin, engine: str) -> dict[str, Any]:
        return {"kind": self.kind}

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        """A :class:`RawBucket` is streamed (``raw``); bytes are one safetensors blob (``safetensors``,
        e.g. :meth:`~lorapub.snapshot.Snapshot.bucket_bytes`)."""
        if isinstance(payload, RawBucket):
            return BucketPost("raw", payload.chunks(), length=len(payload), sender=self.sender)
        if isinstance(payload, (bytes, bytearray, memoryview)):
            return BucketPost("safetensors", payload)
        raise InvalidInput(f"{engine}: a bucket payload is bytes or a wire bucket, got {type(payload).__name__}")


class WireBucketSource:
    """The publisher's half for :class:`HTTPBytes`: nothing to prepare; each engine's receive streams
    the bucket from the frozen snapshot (no serialisation, no per-engine copy)."""

    collective = False

    def __init__(self, snapshot: Snapshot, plan: BucketPlan) -> None:
        if not isinstance(snapshot, Snapshot) or not isinstance(plan, BucketPlan) or plan.digest != snapshot.digest:
            raise InvalidInput("a wire bucket source takes a Snapshot and the plan made for it")
        self.snapshot, self.plan = snapshot, plan

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        return None

    def payload(self, token: AttemptToken, index: int) -> RawBucket:
        return RawBucket(self.snapshot, self.plan.buckets[index])
