"""Pure core: immutable state and transition functions. No I/O, clocks or randomness.

Importable without torch, ray, aiohttp or sglang.
"""

from lorapub.core import registry
from lorapub.core.attempt import Phase, ReadyLocal, TargetState
from lorapub.core.effects import (
    SOURCE,
    Ignored,
    ReadyToCommit,
    ReclaimEligible,
    SendBegin,
    SendCleanup,
    SendEnd,
    SendReclaim,
    TransferBucket,
)
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey, is_managed_name, lora_name_for
from lorapub.core.manifest import Bucket, BucketPlan, Manifest, TensorEntry
from lorapub.core.registry import Outcome, RegistryState, Result, handle, new_registry
from lorapub.core.session import Binding, SessionState
from lorapub.core.version import CommitReceipt, VersionState

__all__ = [
    "SOURCE", "AttemptToken", "Binding", "Bucket", "BucketPlan", "CommitReceipt", "Ignored", "Manifest",
    "Outcome", "Phase", "ReadyLocal", "Result", "ReadyToCommit", "ReclaimEligible", "RegistryState", "SendBegin",
    "SendCleanup", "SendEnd", "SendReclaim", "SessionKey", "SessionState", "TargetState", "TensorEntry",
    "TransferBucket", "VersionKey", "VersionState", "handle", "is_managed_name", "lora_name_for", "new_registry",
    "registry",
]
