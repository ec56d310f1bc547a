"""lorapub: immutable LoRA versions, published online, bound once per session, reclaimed safely.

The public face::

    from lorapub import Deployment, Snapshot, PublicationReport

plus :func:`deploy` (the one switch between versioned publication and the old
overwrite path), the keys and the typed errors. Engine adapters live in
:mod:`lorapub.adapters`, the protocols to implement in :mod:`lorapub.ports`, test
aids in :mod:`lorapub.testing`.
"""

from lorapub.core.identity import SessionKey, VersionKey
from lorapub.errors import (
    CapacityError,
    EngineError,
    LorapubError,
    NoPublishedVersion,
    OutcomeUnknown,
    PublicationBlocked,
    SessionClosed,
    VersionConflict,
    VersionMissing,
    VersionReclaiming,
)
from lorapub.runtime.deployment import Deployment, deploy
from lorapub.runtime.overwrite import OverwriteDeployment
from lorapub.runtime.publisher import PublicationFailed, PublicationReport
from lorapub.runtime.runner import Deadlines
from lorapub.runtime.snapshot import Snapshot

__version__ = "0.1.0"
__all__ = [
    "CapacityError", "Deadlines", "Deployment", "EngineError", "LorapubError", "NoPublishedVersion",
    "OutcomeUnknown", "OverwriteDeployment", "PublicationBlocked", "PublicationFailed", "PublicationReport",
    "SessionClosed", "SessionKey", "Snapshot", "VersionConflict", "VersionKey", "VersionMissing",
    "VersionReclaiming", "deploy",
]
