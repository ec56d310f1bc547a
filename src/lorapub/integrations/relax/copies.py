"""Frozen copies of live versions that outlive the trainer process that published them: rank 0 keeps
each in a store beside the registry (a detached Ray actor in a Relax run), and a trainer started again
takes them back, so it can still load them on an engine that joins or restarts.
See docs/relax.md, "Engines that come and go".
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from lorapub import Snapshot, VersionKey

__all__ = ["LocalCopies", "RayCopies", "SharedFrozenCopies"]

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
        self.copies: dict[tuple[int, str], Any] = {}

    def keep(self, key: tuple[int, str], snapshot: Any) -> None:
        self.copies[key] = snapshot

    def retain(self, keys: list[tuple[int, str]]) -> None:
        wanted = set(keys)
        for key in [k for k in self.copies if k not in wanted]:
            del self.copies[key]

    def items(self) -> list[tuple[tuple[int, str], Any]]:
        return list(self.copies.items())


class RayCopies:
    """The store of a Relax run: a detached Ray actor beside the registry's (``<registry>-<epoch>-copies``).
    It holds up to ``capacity`` adapters in memory. ``keep`` and ``retain`` do not wait for it."""

    def __init__(self, name: str, namespace: str = "lorapub", timeout: float = 120.0) -> None:
        import ray  # Relax's own dependency: lazily

        self._ray = ray
        self.timeout = timeout
        self.actor = ray.remote(num_cpus=0)(_CopiesActor).options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote()

    def keep(self, key: VersionKey, snapshot: Snapshot) -> None:
        self.actor.keep.remote((key.deployment_epoch, key.version_id), snapshot)

    def retain(self, keys: Iterable[VersionKey]) -> None:
        self.actor.retain.remote([(k.deployment_epoch, k.version_id) for k in keys])

    def items(self) -> list[tuple[VersionKey, Snapshot]]:
        found = self._ray.get(self.actor.items.remote(), timeout=self.timeout)
        return [(VersionKey(epoch, version_id), snapshot) for (epoch, version_id), snapshot in found]


class SharedFrozenCopies:
    """The trainer deployment's frozen copies (what its reconciler loads joining and restarted engines
    from), each also kept in ``shared``; what the registry no longer needs leaves both."""

    def __init__(self, local: Any, shared: Any) -> None:
        self.local = local
        self.shared = shared

    def keep(self, key: VersionKey, snapshot: Snapshot) -> None:
        self.local.keep(key, snapshot)
        try:
            self.shared.keep(key, snapshot)
        except Exception as e:  # noqa: BLE001 - this process still has it; only a restart would miss it
            log.warning("lorapub: keeping the copy of %s beyond this process failed: %s", key, e)

    def get(self, key: VersionKey) -> Snapshot | None:
        return self.local.get(key)

    def retain(self, keys: Iterable[VersionKey]) -> None:
        keys = set(keys)
        self.local.retain(keys)
        try:
            self.shared.retain(keys)
        except Exception as e:  # noqa: BLE001 - retried at the reconciler's next pass
            log.warning("lorapub: trimming the shared copies failed: %s", e)

    def __contains__(self, key: VersionKey) -> bool:
        return key in self.local

    def __len__(self) -> int:
        return len(self.local)

    def keys(self) -> frozenset[VersionKey]:
        return self.local.keys()
