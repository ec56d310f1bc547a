"""The frozen copies a publishing process keeps of the versions sessions may still need."""

from __future__ import annotations

from typing import Iterable

from lorapub.core.identity import VersionKey
from lorapub.runtime.snapshot import Snapshot

__all__ = ["FrozenCopies"]


class FrozenCopies:
    """The frozen snapshots of versions sessions may still need, kept by the publishing
    process so a restarted engine is re-provisioned from them (never from live trainer
    parameters). The reconciler drops every copy the registry no longer needs."""

    def __init__(self) -> None:
        self._copies: dict[VersionKey, Snapshot] = {}

    def keep(self, key: VersionKey, snapshot: Snapshot) -> None:
        self._copies[key] = snapshot

    def get(self, key: VersionKey) -> Snapshot | None:
        return self._copies.get(key)

    def retain(self, keys: Iterable[VersionKey]) -> None:
        keep = set(keys)
        for key in [k for k in self._copies if k not in keep]:
            del self._copies[key]

    def __contains__(self, key: VersionKey) -> bool:
        return key in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def keys(self) -> frozenset[VersionKey]:
        """The versions whose frozen snapshot is kept."""
        return frozenset(self._copies)
