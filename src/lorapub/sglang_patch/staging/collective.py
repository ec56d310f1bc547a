"""The collective receiver: a bucket broadcast by the publisher over torch.distributed (gloo or NCCL),
in a process group formed for the attempt at its first bucket. A failed collective fails the
attempt for good and tells every other party to stop waiting. torch is imported only here, and
only when a torch transport is used.
See docs/design.md, "Transports".
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable, Mapping

from lorapub.core.manifest import Bucket
from lorapub.sglang_patch.staging.buffers import Buffer
from lorapub.sglang_patch.staging.landing import Group, Stash
from lorapub.wire.collective import barrier, post_abort
from lorapub.wire.messages import TorchControl, TorchOptions
from lorapub.wire.refusal import Refused, bad, refuse
from lorapub.wire.safetensors import raw_spans

__all__ = ["drop_group", "ranks_of", "receive", "start_join", "transport_problem"]


def transport_problem(transport: Mapping[str, Any]) -> Refused | None:
    """What is wrong with a torch transport's parameters (None: nothing)."""
    try:
        TorchOptions.from_json(transport)
    except Refused as e:
        return e
    return None


def start_join(stash: Stash) -> None:
    """Connect to the attempt's group store in the background (its parameters were checked at begin)."""
    options = TorchOptions.from_json(stash.transport)
    host, port, timeout = options.host, options.port, options.timeout
    done = threading.Event()
    group: Group = {"done": done, "store": None, "pg": None, "error": None, "ranks": None}
    stash.group = group

    def connect() -> None:
        try:
            import torch.distributed as dist

            # torch.distributed re-exports TCPStore without declaring it (no __all__ entry, no "as")
            group["store"] = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - reported at the first bucket
            group["error"] = f"{type(e).__name__}: {e}"
        finally:
            done.set()

    threading.Thread(target=connect, name=f"lorapub-store-{stash.token}", daemon=True).start()


def ranks_of(stash: Stash, bucket: Bucket, control: Mapping[str, Any]) -> tuple[int, int, int]:
    """(rank, world, src) the bucket's control names, checked against the group (a refusal here does
    not fail the attempt)."""
    group = stash.group
    if group is None:
        raise refuse(f"attempt {stash.token} has no process group here (it failed or ended)", "STAGE_FAILED")
    sent = TorchControl.from_json(control)
    rank, world, src = sent.rank, sent.world_size, sent.src
    if group["ranks"] not in (None, (rank, world, src)):
        raise bad(f"bucket {bucket.index} names ranks {(rank, world, src)}; the group has {group['ranks']}")
    return rank, world, src


def receive(stash: Stash, group: Group, bucket: Bucket, ranks: tuple[int, int, int],
            land: Callable[[Stash, Bucket], Buffer]) -> tuple[Buffer, list[tuple[int, int]]]:
    """Join the broadcast of ``bucket`` (blocking: run off the event loop), into ``land``'s buffer."""
    import torch
    import torch.distributed as dist

    rank, world, src = ranks
    options = TorchOptions.from_json(stash.transport)
    timeout, device = options.timeout, options.device
    if not group["done"].wait(timeout):
        raise TimeoutError(f"the group store was not reached within {timeout:g}s")
    tcp_store = group["store"]
    if group["error"] or tcp_store is None:  # done is set once the store was reached or its error kept
        raise RuntimeError(f"reaching the group store failed: {group['error']}")
    span = datetime.timedelta(seconds=timeout)
    store = dist.PrefixStore(f"lorapub/{stash.token}", tcp_store)  # type: ignore[attr-defined]  # as TCPStore
    group["prefixed"] = store
    pg = group["pg"]
    if pg is None:  # the group forms once, at the first bucket, with every party there
        barrier(store, "join", world, timeout)
        if options.backend == "gloo":
            pg = group["pg"] = dist.ProcessGroupGloo(store, rank, world, span)
        else:  # pragma: no cover - needs GPUs
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = span
            pg = group["pg"] = dist.ProcessGroupNCCL(store, rank, world, nccl_opts)
        group["ranks"] = (rank, world, src)
    buf = land(stash, bucket)
    target = buf.tensor if buf.tensor is not None else torch.frombuffer(buf.view, dtype=torch.uint8)
    if device != "cpu":  # pragma: no cover - NCCL receives on the GPU
        target = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    opts.timeout = span
    barrier(store, f"bucket-{bucket.index}", world, timeout)
    # torch's stubs give Backend no broadcast; ProcessGroupGloo and ProcessGroupNCCL have it
    pg.broadcast([target], opts).wait()  # type: ignore[attr-defined]
    if device != "cpu":  # pragma: no cover
        buf.view[:] = target.cpu().numpy().data.cast("B")  # the array's memoryview
    return buf, raw_spans(bucket)


def drop_group(stash: Stash, reason: str | None = None) -> None:
    """Leave the attempt's group; with ``reason``, tell every party to stop waiting first."""
    group, stash.group = stash.group, None
    if group and reason and group.get("prefixed") is not None:
        post_abort(group["prefixed"], reason)
    if group:  # a process group's teardown joins its threads: never on the server's event loop
        held = group

        def teardown() -> None:  # the group's last references go on this thread
            held["pg"] = None
            held.pop("prefixed", None)
            held["store"] = None

        threading.Thread(target=teardown, name="lorapub-group-teardown", daemon=True).start()
