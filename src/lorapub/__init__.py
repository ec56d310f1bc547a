"""lorapub: immutable LoRA versions, published online, bound once per session, reclaimed safely."""

from lorapub.core.identity import SessionKey, VersionKey
from lorapub.errors import (
    CapacityError,
    LorapubError,
    NoPublishedVersion,
    OutcomeUnknown,
    PublicationBlocked,
    SessionClosed,
    VersionConflict,
    VersionMissing,
    VersionReclaiming,
)

__version__ = "0.1.0"
__all__ = [
    "CapacityError", "LorapubError", "NoPublishedVersion", "OutcomeUnknown", "PublicationBlocked",
    "SessionClosed", "SessionKey", "VersionConflict", "VersionKey", "VersionMissing", "VersionReclaiming",
]
