"""The deployment's engine adapters by name: one mapping every part shares (fleet view, publisher,
reclaimer, sessions, reconciler, their effect runners), changed in place when the fleet grows or
shrinks. See docs/elastic.md, "Growing and shrinking the fleet".
"""

from __future__ import annotations

from typing import Mapping

from lorapub.ports import EngineAdmin

__all__ = ["Engines", "shared"]


class Engines(dict[str, EngineAdmin]):
    """The live engine set of one deployment (``Deployment.add_engine``/``remove_engine`` change it)."""


def shared(engines: Mapping[str, EngineAdmin]) -> dict[str, EngineAdmin]:
    """The deployment's live set itself (never a copy), or a private copy of any other mapping."""
    return engines if isinstance(engines, Engines) else dict(engines)
