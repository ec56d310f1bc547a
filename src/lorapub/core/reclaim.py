"""Reclaim: RETIRED with zero session refs -> RECLAIMING (stable reclaim_id) ->
one UNLOADED receipt per engine -> RECLAIMED, slot freed."""

from __future__ import annotations

import attrs

from lorapub.core.effects import Effect, Ignored, SendReclaim
from lorapub.core.version import Version, VersionState, advance
from lorapub.errors import NotReclaimable

__all__ = ["reclaim_id_for", "claim", "sends", "confirm"]


def reclaim_id_for(version: Version, seq: int) -> str:
    return f"reclaim-{version.key}-{seq}"


def claim(version: Version, reclaim_id: str) -> tuple[Version, list[Effect]]:
    """Start reclaim. A repeated claim returns the same id and sends nothing new."""
    if version.state in (VersionState.RECLAIMING, VersionState.RECLAIMED):
        return version, [Ignored(f"{version.key} is already {version.state.value} ({version.reclaim_id})")]
    if version.state is not VersionState.RETIRED:
        raise NotReclaimable(f"version {version.key} is {version.state.value}; only RETIRED versions are reclaimed")
    if not version.reclaimable:
        raise NotReclaimable(
            f"version {version.key} still has {version.session_refs} session ref(s); it is reclaimed once they "
            "close or expire (or, with max_lag, once it falls more than max_lag commits behind the default)",
            session_refs=version.session_refs,
        )
    version = advance(
        version, VersionState.RECLAIMING, reclaim_id=reclaim_id, reclaim_pending=frozenset(version.engines)
    )
    return version, sends(version)


def sends(version: Version) -> list[Effect]:
    return [
        SendReclaim(engine, version.key, version.lora_name, version.reclaim_id or "")
        for engine in sorted(version.reclaim_pending)
    ]


def confirm(version: Version, reclaim_id: str, engine: str) -> tuple[Version, list[Effect]]:
    """An UNLOADED receipt. Late, duplicate or foreign receipts change nothing."""
    if version.state is not VersionState.RECLAIMING or reclaim_id != version.reclaim_id:
        return version, [Ignored(f"UNLOADED {reclaim_id} from {engine} for {version.key} in {version.state.value}")]
    if engine not in version.reclaim_pending:
        return version, [Ignored(f"duplicate UNLOADED from {engine} for {version.key}")]
    pending = version.reclaim_pending - {engine}
    if pending:
        return attrs.evolve(version, reclaim_pending=pending), []
    return advance(version, VersionState.RECLAIMED, reclaim_pending=pending), []
