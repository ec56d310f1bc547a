"""TorchDistributed: the engine joins a process group with the publisher (gloo on CPUs, NCCL on
GPUs) and receives each bucket as one ordered broadcast."""


import asyncio
import concurrent.futures
import datetime
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any


from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken
from lorapub.core.manifest import BucketPlan
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown
from lorapub.ports import BucketPost
from lorapub.snapshot import Snapshot, tensor_bytes
from lorapub.wire.codec import json_bytes
from lorapub.wire.messages import TorchControl, TorchOptions
from lorapub.wire.collective import barrier, post_abort

from .http_bytes import HTTPBytes

if TYPE_CHECKING:  # torch is an optional extra, imported where it is used
    import torch
    from torch._C._distributed_c10d import Backend, PrefixStore, TCPStore

__all__ = ['TorchBucketSource', 'TorchDistributed']

logger = logging.getLogger("lorapub.adapters.sglang_wire")

# -- torch.distributed ----------------------------------------------------------------------------------
_maker: concurrent.futures.ThreadPoolExecutor | None = None
_maker_lock = threading.Lock()


def _store_maker() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that makes every transport's stores ahead of their attempts (one, made once)."""
    global _maker
    with _maker_lock:
        if _maker is None:
            _maker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorapub-torch-store")
        return _maker


class TorchDistributed(HTTPBytes):
    """Buckets as ordered broadcasts in a process group of the publisher (rank 0) and the attempt's
    engines (ranks 1.. in engine-name order): ``backend`` gloo (CPU) or nccl (GPU, ``device`` cuda).
    The publisher hosts the group's store at ``host`` (an address every engine can reach) on a free
    port per attempt; ``timeout`` bounds every join and broadcast on every party.

    It tracks the sources it made (each attempt's group): one instance serves a deployment, and
    equals only itself."""

    kind = "torch"

    def __init__(self, *, host: str = "127.0.0.1", backend: str = "gloo", device: str = "cpu",
                 timeout: float = 60.0, load: str = "dir") -> None:
        super().__init__(load=load)
        import torch.distributed  # noqa: F401 - imported here, never on the event loop of a publication

        if backend not in ("gloo", "nccl"):
            raise InvalidInput(f"backend must be gloo or nccl, got {backend!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise InvalidInput(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.host, self.backend, self.device, self.timeout = host, backend, device, float(timeout)
        self._sources: weakref.WeakValueDictionary[str, TorchBucketSource] = weakref.WeakValueDictionary()
        self._attempts: weakref.WeakValueDictionary[AttemptToken, TorchBucketSource] = weakref.WeakValueDictionary()
        self._spare: "concurrent.futures.Future[TCPStore] | None" = None
        self._make_spare()

    def _make_store(self) -> "TCPStore":
        import torch.distributed as dist

        # torch.distributed re-exports TCPStore without declaring it (no __all__ entry, no "as")
        return dist.TCPStore(  # type: ignore[attr-defined]
            self.host, 0, None, True, timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False)

    def _make_spare(self) -> None:
        """The next attempt's store, made on a thread now: a store's start (its server thread, and the
        first one's setup, 10 ms here) never runs on the caller's loop."""
        self._spare = _store_maker().submit(self._make_store)

    def take_store(self) -> "TCPStore":
        """A store for a new attempt: the one made ahead (waited for if it is still being made, which
        takes less than making one here), or, if that failed, one made here; the next one is started."""
        spare = self._spare
        store: "TCPStore | None" = None
        try:
            if spare is not None:
                store = spare.result(timeout=self.timeout)
        except Exception:  # noqa: BLE001 - made again here, where its error reaches the caller
            store = None
        if store is None:
            store = self._make_store()  # raises as the constructor of a store does (host not bindable)
        self._make_spare()
        return store

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def source(self, snapshot: Snapshot, plan: BucketPlan) -> "TorchBucketSource":
        source = TorchBucketSource(snapshot, plan, self)
        self._sources[plan.digest] = source
        return source

    def begin_options(self, request: SendBegin, engine: str) -> dict[str, Any]:
        source = self._sources.get(request.digest)
        if source is None:  # a caller that hands the buckets' bytes itself (no collective to join)
            return {"kind": "http"}
        self._attempts[request.token] = source
        return TorchOptions(self.host, source.port, self.backend, self.device, self.timeout).to_json()

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        if not isinstance(payload, (bytes, bytearray, memoryview)) or len(payload):
            return await super().bucket_request(token, index, payload, engine)
        # no bytes: the engine joins the broadcast of bucket ``index``
        source = self._attempts.get(token)
        if source is None:
            raise EngineError(f"no torch.distributed bucket source is publishing {token} in this process")
        try:
            rank, world = await source.rank_of(token, engine)
        except Exception as e:
            source.abort(token, f"{engine}: {e}")
            raise

        def settle(stored: bool, why: str | None) -> None:
            if not stored and why is not None:  # the others must not wait for a rank that will not come
                source.abort(token, why)

        return BucketPost("torch", json_bytes(TorchControl(rank, world, 0).to_json()), "application/json",
                          settle=settle)


class TorchBucketSource:
    """The publisher's half for :class:`TorchDistributed` (rank 0). The group forms at the first
    bucket, once the attempt's engines are known; bucket ``i`` is broadcast at most once, from a
    flat copy made while bucket ``i-1`` was on the wire (two reused bucket-sized buffers)."""

    collective = True

    def __init__(self, snapshot: Snapshot, plan: BucketPlan, transport: TorchDistributed) -> None:
        if not isinstance(snapshot, Snapshot) or not isinstance(plan, BucketPlan) or plan.digest != snapshot.digest:
            raise InvalidInput("a torch bucket source takes a Snapshot and the plan made for it")
        self.snapshot, self.plan, self.transport = snapshot, plan, transport
        store = transport.take_store()
        self.store: "TCPStore | None" = store  # None once the last bucket went (its server joined)
        self.port = store.port
        self._rosters: dict[AttemptToken, tuple[str, ...]] = {}
        self._roster_set: dict[AttemptToken, asyncio.Event] = {}
        self._groups: "dict[AttemptToken, Backend]" = {}
        self._sent: dict[tuple[AttemptToken, int], asyncio.Future[None]] = {}
        self.failed: str | None = None
        self.broadcasts = 0
        self._bufs: "list[torch.Tensor | None]" = [None, None]  # at most two buckets' bytes beside the snapshot
        # the next bucket, flattened on a thread of its own while this one is broadcast: its outcome and buffer
        self._ahead: "dict[int, tuple[concurrent.futures.Future[torch.Tensor], int]]" = {}

    def _event(self, token: AttemptToken) -> asyncio.Event:
        return self._roster_set.setdefault(token, asyncio.Event())

    async def rank_of(self, token: AttemptToken, engine: str) -> tuple[int, int]:
        """(rank, world size) of ``engine`` in the group of ``token`` (known once its first bucket starts)."""
        try:
            async with asyncio.timeout(self.transport.timeout):
                await self._event(token).wait()
        except TimeoutError:
            raise OutcomeUnknown(f"the publisher never started the collective of {token}") from None
        roster = self._rosters[token]
        if engine not in roster:
            raise EngineError(f"{engine} is not a target of {token} ({roster})")
        return 1 + roster.index(engine), 1 + len(roster)

    def _prefixed(self, token: AttemptToken) -> "PrefixStore":
        import torch.distributed as dist

        store = self.store
        if store is None:  # was a TypeError inside PrefixStore: the same failed broadcast, said plainly
            raise EngineError(f"the store of {token}'s collective is closed: its last bucket was broadcast")
        return dist.PrefixStore(f"lorapub/{token}", store)  # type: ignore[attr-defined]  # as TCPStore

    def abort(self, token: AttemptToken, reason: str) -> None:
        """Every party of ``token``'s collective stops waiting (an engine refused or did not answer)."""
        self.failed = self.failed or reason
        if self.store is not None:
            post_abort(self._prefixed(token), f"publisher: {reason}")

    def _join(self, token: AttemptToken, world: int) -> "Backend":
        import torch.distributed as dist

        span = datetime.timedelta(seconds=self.transport.timeout)
        store = self._prefixed(token)
        barrier(store, "join", world, self.transport.timeout)  # every party is there before the group forms
        if self.transport.backend == "gloo":
            return dist.ProcessGroupGloo(store, 0, world, span)
        opts = dist.ProcessGroupNCCL.Options()  # pragma: no cover - needs GPUs
        opts._timeout = span
        return dist.ProcessGroupNCCL(store, 0, world, opts)

    def _flatten(self, index: int, slot: int) -> "torch.Tensor":
        """Bucket ``index`` into buffer ``slot`` (two buffers of the largest bucket, reused)."""
        import numpy as np
        import torch

        buf = self._bufs[slot]
        if buf is None:
            buf = self._bufs[slot] = torch.empty(max(b.nbytes for b in self.plan.buckets), dtype=torch.uint8)
        bucket = self.plan.buckets[index]
        flat = buf[: bucket.nbytes]
        out, offset = flat.numpy(), 0
        for entry in bucket.entries:  # numpy copies without the GIL: the caller's loop keeps running
            view = tensor_bytes(self.snapshot.tensor(entry.name))
            np.copyto(out[offset : offset + len(view)], np.frombuffer(view, dtype=np.uint8))
            offset += len(view)
        return flat

    def _flatten_ahead(self, index: int, slot: int) -> "concurrent.futures.Future[torch.Tensor]":
        """:meth:`_flatten` on a thread of its own; its outcome (the bytes, or what failed) in the future."""
        done: "concurrent.futures.Future[torch.Tensor]" = concurrent.futures.Future()

        def flatten() -> None:
            try:
                done.set_result(self._flatten(index, slot))
            except BaseException as e:  # noqa: BLE001 - handed to the broadcast that waits for it
                done.set_exception(e)

        threading.Thread(target=flatten, daemon=True, name="lorapub-flatten").start()
        return done

    def _broadcast(self, token: AttemptToken, index: int, world: int) -> None:
        import torch.distributed as dist

        if token not in self._groups:
            self._groups[token] = self._join(token, world)
        ahead = self._ahead.pop(index, None)
        if ahead is not None:  # flattened while the previous bucket was broadcast
            slot = ahead[1]
            try:
                flat = ahead[0].result()
            except Exception as e:  # its thread failed: the broadcast says why, never sends a half-written buffer
                raise EngineError(f"bucket {index} of {token} could not be flattened: {type(e).__name__}: {e}") from e
        else:
            slot = index % 2
            flat = self._flatten(index, slot)
        if index + 1 < len(self.plan.buckets):  # the next bucket goes into the other buffer meanwhile
            self._ahead[index + 1] = (self._flatten_ahead(index + 1, 1 - slot), 1 - slot)
        if self.transport.device != "cpu":  # pragma: no cover - NCCL sends from the GPU
            flat = flat.to(self.transport.device)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.transport.timeout)
        barrier(self._prefixed(token), f"bucket-{index}", world, self.transport.timeout)
        # torch's stubs give Backend no broadcast; ProcessGroupGloo and ProcessGroupNCCL have it
        self._groups[token].broadcast([flat], opts).wait()  # type: ignore[attr-defined]
        if index == len(self.plan.buckets) - 1:  # the last bucket: leave the group here, off the loop
            self._groups.pop(token, None)
            self._bufs = [None, None]
            self.store = None  # the store's server thread is joined here too

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        roster = tuple(sorted(engines))
        if token not in self._rosters:
            self._rosters[token] = roster
            self._event(token).set()
        key = (token, index)
        if key in self._sent:  # a duplicate: the same outcome, never a second collective
            return await asyncio.shield(self._sent[key])
        if self.failed:
            raise EngineError(f"the collective of {token} failed before bucket {index}: {self.failed}")
        self._sent[key] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.to_thread(self._broadcast, token, index, 1 + len(roster))
        except Exception as e:  # noqa: BLE001 - a failed collective fails the attempt for every party
            self.failed = f"{type(e).__name__}: {e}"
            if self.store is not None:
                post_abort(self._prefixed(token), f"publisher: {self.failed}")
            self._groups.pop(token, None)  # its sockets close: ranks still waiting fail at once
            error = EngineError(f"broadcast of bucket {index} of {token} failed: {self.failed}")
            self._sent[key].set_exception(error)
            self._sent[key].exception()  # retrieved here; the caller gets it raised below
            raise error from None
        self.broadcasts += 1
        self._sent[key].set_result(None)

    def payload(self, token: AttemptToken, index: int) -> bytes:
        return b""
