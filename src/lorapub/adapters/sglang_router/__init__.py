"""lorapub behind the SGLang router (``sglang-router``, the SGLang Model Gateway), as Relax and Miles
deploy it: generations go through the router (:class:`RouterRouting`, in :mod:`.client`), publication,
cleanup and reclaim to every worker directly, and :class:`WorkerWatcher` (:mod:`.workers`) keeps
the router's rotation to workers that hold the live versions. The router must run with
:data:`REQUIRED_ROUTER_FLAGS`.
See docs/router.md.
"""

from __future__ import annotations

from lorapub.adapters.sglang_router.client import (
    REQUIRED_ROUTER_FLAGS,
    ROUTER_VERSION,
    RoutedGeneration,
    RouterRouting,
    RouterWorker,
    SGLangRouter,
    engine_name,
    normalize_url,
    router_command,
)
from lorapub.adapters.sglang_router.workers import (
    Heal,
    HealFailed,
    WorkerEvent,
    WorkerHealed,
    WorkerJoined,
    WorkerLeft,
    WorkerQuarantined,
    WorkerReadmitted,
    WorkerRestarted,
    WorkerStatus,
    WorkerUnreachable,
    WorkerWatcher,
    reconcile_heal,
)

__all__ = [
    "ROUTER_VERSION", "REQUIRED_ROUTER_FLAGS", "router_command", "normalize_url", "engine_name", "RouterWorker",
    "SGLangRouter", "RoutedGeneration", "RouterRouting", "WorkerJoined", "WorkerLeft", "WorkerRestarted",
    "WorkerUnreachable", "WorkerQuarantined", "WorkerHealed", "HealFailed", "WorkerReadmitted", "WorkerEvent",
    "WorkerStatus", "Heal", "reconcile_heal", "WorkerWatcher",
]
