"""What one ``publish`` call reports: the version, its phases and, where it waited, what it waited for."""

from __future__ import annotations

from typing import Mapping

import attrs

from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.registry import SlotHolder
from lorapub.core.version import CommitReceipt, VersionState

__all__ = ["PublicationReport", "WaitReport"]


@attrs.frozen
class WaitReport:
    """What a publication waited for before it got a slot (or gave up): the slot holders as last
    seen (their session refs) and, per engine, the requests still running on the versions
    being reclaimed (native refs), or the attempt that ran."""

    reason: str
    holders: tuple[SlotHolder, ...] = ()
    running_requests: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)  # version -> engine -> refs
    attempt: AttemptToken | None = None

    def describe(self) -> str:
        running = "; ".join(
            f"{v}: {', '.join(f'{n} on {e}' for e, n in sorted(engines.items()))} running request(s)"
            for v, engines in sorted(self.running_requests.items()) if any(engines.values())
        )
        return self.reason + (f" ({running})" if running else "")


@attrs.frozen
class PublicationReport:
    """What one ``publish`` did: the version, its engine-side name and the commit receipt;
    ``waited`` seconds for a slot (``waited_for`` says for what)."""

    version: VersionKey
    lora_name: str
    receipt: CommitReceipt | None
    state: VersionState
    seconds: float
    phases: Mapping[str, float]
    collectives: int
    reused: bool = False
    waited: float = 0.0
    waited_for: WaitReport | None = None
    engine_phases: Mapping[str, Mapping[str, float]] = attrs.field(factory=dict)  # engine -> phase -> seconds
