"""The frozen copies a publishing process keeps of the versions sessions may still need."""

from __future__ import annotations

import logging
from typing import Iterable

from lorapub.core.identity import VersionKey
from lorapub.ports import CopyStore
from lorapub.snapshot import Snapshot

log = logging.getLogger(__name__)

__all__ = ["FrozenCopies"]


class FrozenCopies:
    """The frozen snapshots of versions sessions may still need, kept by the publishing
    process so a restarted engine is re-provisioned from them (never from live trainer
    parameters). The reconciler drops every copy the registry no longer needs. With a ``store``
    (:class:`~lorapub.ports.CopyStore`) each copy is kept there too, and dropped there with it."""

    def __init__(self, store: CopyStore | None = None) -> None:
        self._copies: dict[VersionKey, Snapshot] = {}
        self.store = store

    def keep(self, key: VersionKey, snapshot: Snapshot) -> None:
        self._copies[key] = snapshot
        if self.store is not None:
            try:
                self.store.keep(key, snapshot)
            except Exception as e:  # noqa: BLE001 - this process still has it; only its restart would miss it
                log.warning("keeping the copy of %s in the copy store failed: %s", key, e)

    def take_back(self, copies: Iterable[tuple[VersionKey, Snapshot]]) -> list[VersionKey]:
        """The copies a process before this one kept in the store (a restart): kept here again, the store
        untouched. Returns the versions taken back."""
        taken = []
        for key, snapshot in copies:
            if key not in self._copies:
                self._copies[key] = snapshot
                taken.append(key)
        return taken

    def get(self, key: VersionKey) -> Snapshot | None:
        return self._copies.get(key)

    def retain(self, keys: Iterable[VersionKey]) -> None:
        keep = set(keys)
        for key in [k for k in self._copies if k not in keep]:
            del self._copies[key]
        if self.store is not None:
            try:
                self.store.retain(keep)
            except Exception as e:  # noqa: BLE001 - trimmed again at the reconciler's next pass
                log.warning("trimming the copy store failed: %s", e)

    def __contains__(self, key: VersionKey) -> bool:
        return key in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def keys(self) -> frozenset[VersionKey]:
        """The versions whose frozen snapshot is kept."""
        return frozenset(self._copies)
