"""The transports: how bucket bytes reach the engines' own staging. Each is also the
publisher's bucket source and says what an engine posts for each bucket (docs/design.md, "Transports")."""

from __future__ import annotations

from .http_bytes import HTTPBytes, RawBucket, WireBucketSource
from .same_host import SameHostIPC, SharedDir, ShmBucket, ShmBucketSource, sweep_shm
from .torch_dist import TorchBucketSource, TorchDistributed

__all__ = ["HTTPBytes", "RawBucket", "SameHostIPC", "SharedDir", "ShmBucket", "ShmBucketSource", "TorchBucketSource",
           "TorchDistributed", "WireBucketSource", "sweep_shm"]
