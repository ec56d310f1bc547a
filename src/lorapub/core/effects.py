"""What the core asks the I/O layer to do (effects) and tells it happened (events).

The core never performs these; the publisher/reclaimer executes effects and
feeds each outcome back as a command.
"""

from __future__ import annotations

import attrs

from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.manifest import BucketPlan

__all__ = [
    "SOURCE", "SendBegin", "TransferBucket", "SendEnd", "ReadyToCommit", "SendCleanup", "SendReclaim",
    "ReclaimEligible", "Ignored", "Effect",
]

SOURCE = "<source>"  # the sending side of a bucket collective, next to the engine names


@attrs.frozen
class SendBegin:
    """Ask ``engine`` (in life ``incarnation``) to begin staging attempt ``token``: the adapter's name, digest
    and bucket plan, before any byte travels."""

    engine: str
    incarnation: str
    token: AttemptToken
    lora_name: str
    digest: str
    plan: BucketPlan


@attrs.frozen
class TransferBucket:
    """One collective: the source sends bucket ``index``, every engine receives it."""

    token: AttemptToken
    index: int
    engines: tuple[str, ...]


@attrs.frozen
class SendEnd:
    engine: str
    token: AttemptToken


@attrs.frozen
class ReadyToCommit:
    token: AttemptToken
    expected_default_revision: int


@attrs.frozen
class SendCleanup:
    engine: str
    incarnation: str
    token: AttemptToken
    lora_name: str


@attrs.frozen
class SendReclaim:
    engine: str
    version: VersionKey
    lora_name: str
    reclaim_id: str


@attrs.frozen
class ReclaimEligible:
    """A RETIRED version just reached zero session refs."""

    version: VersionKey


@attrs.frozen
class Ignored:
    """A late, stale or duplicate message that changed nothing."""

    reason: str


Effect = (
    SendBegin
    | TransferBucket
    | SendEnd
    | ReadyToCommit
    | SendCleanup
    | SendReclaim
    | ReclaimEligible
    | Ignored
)
