"""Entering a collective only when every party is there: the barrier on the group's store, and its abort.

Also the running kernel, which names whose ``flock`` locks a process can read (the engine's stash
claims and the publisher's shared-memory owner files)."""

from __future__ import annotations

import socket
import time
from typing import Protocol

__all__ = ["Store", "barrier", "post_abort", "running_kernel"]


class Store(Protocol):
    """What the barrier uses of a collective group's key-value store (``torch.distributed.Store``)."""

    def add(self, key: str, amount: int, /) -> int: ...

    def check(self, keys: list[str], /) -> bool: ...

    def get(self, key: str, /) -> bytes: ...

    def set(self, key: str, value: str, /) -> None: ...


def barrier(store: Store, key: str, world: int, timeout: float, abort_key: str = "abort") -> None:
    """Every party of a collective announces itself on the group's store and waits for all
    ``world`` of them (or an abort any party posts, or ``timeout``): a collective is entered only when
    every rank is there, so no rank is left waiting in one that a party will never join."""
    store.add(key, 1)
    deadline, pause = time.monotonic() + timeout, 0.001
    while True:
        if store.check([abort_key]):
            raise RuntimeError(f"the collective was aborted: {store.get(abort_key).decode(errors='replace')}")
        if store.add(key, 0) >= world:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add(key, 0)} of {world} parties reached {key!r} within {timeout:g}s")
        time.sleep(pause)
        pause = min(pause * 2, 0.002)


def post_abort(store: Store, reason: str) -> None:
    """Tell every party of a collective to stop waiting (best effort)."""
    try:
        store.set("abort", reason[:500])
    except Exception:  # noqa: BLE001 - the store may already be gone
        pass


def running_kernel() -> str:
    """The running kernel, whose ``flock`` locks this process can read (containers of one machine
    included; another machine sharing a folder, or this one before a reboot, never)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"boot {f.read().strip()}"
    except OSError:  # not Linux: the host name, and a folder shared between machines is not swept safely
        return f"host {socket.gethostname()}"
