"""Ordered bucket transfer over torch.distributed (NCCL on GPU, gloo on CPU).

The source flattens bucket ``i`` of the frozen snapshot into one byte tensor
and broadcasts it; each engine-side receiver joins the same broadcast,
splits the bytes by the manifest entries and verifies every tensor's SHA-256
before it enters the attempt's stash. A (token, index) pair is broadcast at
most once: a duplicate request would otherwise start a collective nobody joins.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import Bucket, BucketPlan
from lorapub.errors import EngineError
from lorapub.runtime.snapshot import Snapshot

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}


def _as_torch(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else torch.from_numpy(t.copy())


def flatten_bucket(snapshot: Snapshot, bucket: Bucket, device: str = "cpu") -> torch.Tensor:
    parts = [_as_torch(snapshot.tensor(e.name)).reshape(-1).view(torch.uint8) for e in bucket.entries]
    return torch.cat(parts).to(device)


def split_bucket(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """Bytes -> named tensors, each checked against its manifest digest."""
    flat = flat.cpu()
    if flat.numel() != bucket.nbytes:
        raise EngineError(f"bucket {bucket.index}: got {flat.numel()} bytes, plan says {bucket.nbytes}")
    out, offset = {}, 0
    for e in bucket.entries:
        raw = flat[offset : offset + e.nbytes]
        offset += e.nbytes
        if hashlib.sha256(raw.numpy().tobytes()).hexdigest() != e.sha256:
            raise EngineError(f"bucket {bucket.index}: tensor {e.name} does not match its digest")
        out[e.name] = raw.clone().view(_DTYPES[e.dtype]).reshape(e.shape)
    return out


class TorchDistributedBucketSource:
    """BucketSource for the publisher process (rank ``src`` of ``group``)."""

    carries_bytes = False

    def __init__(self, snapshot: Snapshot, plan: BucketPlan, *, src: int, group: Any = None, device: str = "cpu") -> None:
        self.snapshot, self.plan, self.src, self.group, self.device = snapshot, plan, src, group, device
        self.sent: set[tuple[AttemptToken, int]] = set()

    async def send(self, token: AttemptToken, index: int, engines) -> None:
        if (token, index) in self.sent:
            return
        self.sent.add((token, index))
        flat = flatten_bucket(self.snapshot, self.plan.buckets[index], self.device)
        work = dist.broadcast(flat, src=self.src, group=self.group, async_op=True)
        import asyncio

        await asyncio.to_thread(work.wait)

    def payload(self, token: AttemptToken, index: int) -> bytes:
        return b""


class TorchDistributedBucketReceiver:
    """Engine side: joins the broadcast of each bucket once, in plan order."""

    def __init__(self, *, src: int, group: Any = None, device: str = "cpu") -> None:
        self.src, self.group, self.device = src, group, device
        self.received: dict[tuple[AttemptToken, int], dict[str, torch.Tensor]] = {}

    def receive(self, token: AttemptToken, plan: BucketPlan, index: int) -> dict[str, torch.Tensor]:
        key = (token, index)
        if key in self.received:  # duplicate receive: the stored bucket, no second collective
            return self.received[key]
        bucket = plan.buckets[index]
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, src=self.src, group=self.group)
        self.received[key] = split_bucket(flat, bucket)
        return self.received[key]
