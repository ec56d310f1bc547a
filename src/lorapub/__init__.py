"""lorapub: immutable LoRA versions, published online, bound once per session, reclaimed safely.

The public face: ``from lorapub import Deployment, Snapshot, PublicationReport``, :func:`deploy` (the one
switch between versioned publication and the old overwrite path), the keys (and :class:`AttemptToken`),
:class:`VersionState` and the typed errors. Engine adapters live in :mod:`lorapub.adapters`, the
protocols to implement in :mod:`lorapub.ports`, test aids in :mod:`lorapub.testing`.
"""

import logging as _logging

from lorapub.core.identity import AttemptToken, SessionKey, VersionKey
from lorapub.core.version import VersionState
from lorapub.errors import (
    AlreadyStarted,
    BindingStale,
    DeploymentClosed,
    DrainTimeout,
    CapacityError,
    EngineCapacityError,
    EngineClosed,
    EngineError,
    EngineNotDrained,
    EngineUnavailable,
    EpochMismatch,
    GroupClosed,
    InvalidInput,
    InvalidTransition,
    LorapubError,
    NoPublishedVersion,
    NotReady,
    NotReclaimable,
    NumericMismatch,
    OutcomeUnknown,
    PublicationBlocked,
    PublicationFailed,
    PublicationSuperseded,
    ProvenanceMismatch,
    SessionClosed,
    SessionExpired,
    StaleAttempt,
    StoreCorrupted,
    StoreError,
    UnknownEngine,
    UnknownVersion,
    VersionConflict,
    VersionMissing,
    VersionReclaiming,
    VersionSuspect,
)
from lorapub.runtime.deployment import Deployment, DeploymentSettings, deploy
from lorapub.runtime.overwrite import OverwriteDeployment
from lorapub.runtime.publication_report import PublicationReport, WaitReport
from lorapub.runtime.runner import Deadlines
from lorapub.runtime.sessions import Session
from lorapub.probe import Probe
from lorapub.snapshot import Snapshot

__version__ = "0.1.0"
# Every typed error of lorapub.errors is here too: a caller catches them from one import.

# A library adds no handler but this one: the application configures logging (docs/operating.md,
# "Logs"); unconfigured, Python's last-resort handler would print bare lines with no time or level.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "AlreadyStarted", "BindingStale", "CapacityError", "EngineCapacityError", "EngineClosed", "EngineError",
    "EngineUnavailable", "EpochMismatch", "GroupClosed", "InvalidInput", "InvalidTransition", "LorapubError",
    "NoPublishedVersion", "NotReady", "NotReclaimable", "OutcomeUnknown", "PublicationBlocked", "PublicationFailed",
    "PublicationSuperseded", "SessionClosed", "SessionExpired", "StaleAttempt", "StoreCorrupted", "StoreError",
    "UnknownEngine", "UnknownVersion", "VersionConflict", "VersionMissing", "VersionReclaiming",
    "DeploymentClosed", "DrainTimeout", "EngineNotDrained", "NumericMismatch", "VersionSuspect",
    "ProvenanceMismatch",
    "AttemptToken", "Deadlines", "Deployment", "DeploymentSettings", "OverwriteDeployment", "Probe", "PublicationReport", "Session", "SessionKey",
    "Snapshot", "VersionKey", "VersionState", "WaitReport", "deploy",
]
