"""What a reconciliation pass reports: :class:`Health`, its :class:`Blocker` values. Values beside the
ports: the runtime's reconciler makes them, and an adapter (the router's heal) reads them.
See docs/recovery.md.
"""

from __future__ import annotations

import attrs

from lorapub.core.registry import Fleet

__all__ = ["Blocker", "Health"]


@attrs.frozen
class Blocker:
    """One thing that keeps the deployment from being healthy, and why."""

    # engine_unreachable | reprovisioning | cleanup_pending | reclaim_pending | publication_waiting |
    # orphan_pending | attempt_running | reconcile_failed | version_suspect | starting (no pass has finished)
    kind: str
    subject: str
    detail: str


@attrs.frozen
class Health:
    """The typed status of the last reconciliation pass."""

    healthy: bool
    blockers: tuple[Blocker, ...]
    fleet: Fleet | None
    passes: int
    failed_passes: int
    #: what is worth knowing but blocks nothing, e.g. an engine whose turns are unattested (it does
    #: not stamp its responses: docs/provenance.md, "Stamp")
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.healthy:
            return "healthy" + "".join(f"; note: {n}" for n in self.notes)
        return "; ".join(f"{b.kind} {b.subject}: {b.detail}" for b in self.blockers)
