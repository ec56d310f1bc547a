"""The torch.distributed bucket path for real: one source and two engine ranks over gloo."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from lorapub.core.identity import AttemptToken, VersionKey  # noqa: E402
from lorapub.testing.fixtures import lora_snapshot  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    from lorapub.adapters.torch_bucket import TorchDistributedBucketReceiver, TorchDistributedBucketSource
    from lorapub.runtime.snapshot import Snapshot

    snapshot = lora_snapshot(7, layers=3, hidden=32, rank=4)
    plan = snapshot.plan(1024)
    token = AttemptToken(VersionKey(1, "A"), 1)
    try:
        if rank == 0:
            source = TorchDistributedBucketSource(snapshot, plan, src=0)

            async def send_all():
                for i in range(len(plan)):
                    await source.send(token, i, ("e0", "e1"))
                    await source.send(token, i, ("e0", "e1"))  # duplicate: no second collective

            asyncio.run(send_all())
            results[rank] = (len(plan), snapshot.digest)
        else:
            receiver = TorchDistributedBucketReceiver(src=0)
            tensors = {}
            for i in range(len(plan)):
                tensors.update(receiver.receive(token, plan, i))
                receiver.receive(token, plan, i)  # duplicate: served from the stash
            results[rank] = (len(plan), Snapshot(tensors, snapshot.serving_config).digest)
    finally:
        dist.destroy_process_group()


def test_gloo_broadcast_of_ordered_buckets_rebuilds_the_same_digest():
    port = _free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, results), nprocs=3, join=True)
        got = dict(results)
    buckets, digest = got[0]
    assert buckets > 2
    assert got[1] == got[2] == (buckets, digest)


def test_split_rejects_corrupted_bytes():
    from lorapub.adapters.torch_bucket import flatten_bucket, split_bucket
    from lorapub.errors import EngineError

    snapshot = lora_snapshot(3, layers=1, hidden=16, rank=2)
    plan = snapshot.plan(1 << 20)
    flat = flatten_bucket(snapshot, plan.buckets[0])
    assert set(split_bucket(flat, plan.buckets[0])) == set(plan.buckets[0].tensor_names)
    flat[5] ^= 1
    with pytest.raises(EngineError):
        split_bucket(flat, plan.buckets[0])
