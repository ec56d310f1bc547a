"""Frozen copies of live versions that outlive the trainer process that published them: rank 0 keeps
each in a store beside the registry (a detached Ray actor in a Relax run: ``Deployment(copies=)``, a
:class:`lorapub.ports.CopyStore`), and a trainer started again takes them back, so it can still load
them on an engine that joins or restarts.
See docs/relax.md, "Engines that come and go".
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Iterable

from lorapub import Snapshot, VersionKey

__all__ = ["LocalCopies", "RayCopies"]

log = logging.getLogger("lorapub.integrations.relax")


class LocalCopies:
    """The store in one process (tests, or a trainer that is never restarted)."""

    def __init__(self) -> None:
        self.copies: dict[VersionKey, Snapshot] = {}

    def keep(self, key: VersionKey, snapshot: Snapshot) -> None:
        self.copies[key] = snapshot

    def retain(self, keys: Iterable[VersionKey]) -> None:
        wanted = set(keys)
        for key in [k for k in self.copies if k not in wanted]:
            del self.copies[key]

    def items(self) -> list[tuple[VersionKey, Snapshot]]:
        return list(self.copies.items())


class _CopiesActor:
    def __init__(self) -> None:
        self.copies: dict[tuple[int, str], Snapshot] = {}

    def keep(self, key: tuple[int, str], snapshot: Snapshot) -> None:
        self.copies[key] = snapshot

    def retain(self, keys: list[tuple[int, str]]) -> None:
        wanted = set(keys)
        for key in [k for k in self.copies if k not in wanted]:
            del self.copies[key]

    def items(self) -> list[tuple[tuple[int, str], Snapshot]]:
        return list(self.copies.items())


class RayCopies:
    """The store of a Relax run: a detached Ray actor beside the registry's (``<registry>-<epoch>-copies``).
    It holds up to ``capacity`` adapters in memory. ``keep`` and ``retain`` do not wait for it."""

    def __init__(self, name: str, namespace: str = "lorapub", timeout: float = 120.0) -> None:
        import ray  # Relax's own dependency: lazily

        self._ray = ray
        self.timeout = timeout
        # a Ray actor handle: ray's types give its methods no .remote (the calls below go through it)
        self.actor: Any = ray.remote(num_cpus=0)(_CopiesActor).options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote()
        # keep() and retain() are called on the publisher's event loop: submitting a call serializes its
        # snapshot (hundreds of MB) into Ray's object store, so it happens on one thread of its own, in order
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorapub-copies")

    def _send(self, call: Any, *args: Any) -> None:
        def send() -> None:
            try:
                call.remote(*args)
            except Exception as e:  # noqa: BLE001 - the trainer keeps its own copy; only its restart would miss it
                log.warning("lorapub: the copy store did not take %s: %s", call, e)

        self._sender.submit(send)

    def keep(self, key: VersionKey, snapshot: Snapshot) -> None:
        self._send(self.actor.keep, (key.deployment_epoch, key.version_id), snapshot)

    def retain(self, keys: Iterable[VersionKey]) -> None:
        self._send(self.actor.retain, [(k.deployment_epoch, k.version_id) for k in keys])

    def close(self) -> None:
        """What this process sent is in the actor (the actor itself, detached, stays); the sending thread ends."""
        self._sender.shutdown(wait=True)

    def items(self) -> list[tuple[VersionKey, Snapshot]]:
        self._sender.submit(lambda: None).result()  # what this process sent before is there first
        found = self._ray.get(self.actor.items.remote(), timeout=self.timeout)
        return [(VersionKey(epoch, version_id), snapshot) for (epoch, version_id), snapshot in found]


def __getattr__(name: str) -> Any:
    if name == "SharedFrozenCopies":  # ImportError: `from ... import` keeps its message (an AttributeError's is lost)
        raise ImportError("SharedFrozenCopies is gone: pass the store as Deployment(copies=...) (a "
                             "lorapub.ports.CopyStore, e.g. RayCopies or LocalCopies); the deployment keeps each "
                             "frozen copy there and takes them back at start")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
