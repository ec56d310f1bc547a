"""AReaL integration: immutable LoRA versions for AReaL's remote SGLang rollouts, behind one config key.

:class:`LorapubSGLangEngine` is a drop-in for ``areal.engine.sglang_remote.RemoteSGLangEngine``; with
``rollout.lorapub.enabled: false`` (or no ``lorapub`` block) it is AReaL's own engine, unchanged.
Importing this package needs neither AReaL, torch nor aiohttp: the engine classes import AReaL when
first named. See docs/areal.md.
"""

from __future__ import annotations

from typing import Any

from .config import DEFAULT_NAME_PREFIX, LorapubAReaLConfig, areal_version, config_of, version_id

# The engine classes (LorapubSGLangEngine, LorapubInferenceEngineConfig, LorapubRemoteInfEngine) are
# importable from here too, but not listed: naming them imports AReaL, which the suite's own
# environment does not have (it lives in .cache/areal/1.0.4, for the AReaL tests alone).
__all__ = ["AREAL_FILES", "AREAL_VERSION", "DEFAULT_NAME_PREFIX", "LorapubAReaLConfig", "areal_version", "config_of",
           "version_id"]

#: The AReaL release these hooks were written and tested against.
AREAL_VERSION = "1.0.4"
#: What was read in it: the engine the drop-in extends, and what its methods mirror.
AREAL_FILES: dict[str, str] = {
    "areal/engine/sglang_remote.py": "RemoteSGLangEngine, SGLangBackend (build_generation_request, "
                                     "parse_generation_response, build_disk_weight_update_requests)",
    "areal/infra/remote_inf_engine.py": "RemoteInfEngine (initialize, _resolve_workflow, agenerate, "
                                        "update_weights_from_disk, pause_generation, continue_generation), "
                                        "GroupedRolloutWorkflow, _update_weights_from_disk",
    "areal/infra/workflow_executor.py": "WorkflowExecutor (one asyncio task per episode, workflow_context)",
    "areal/engine/fsdp_engine.py": "FSDPEngine._update_weights_from_disk (pause, update, save, name_resolve, continue)",
    "areal/trainer/rl_trainer.py": "lora_keep_versions = max_head_offpolicyness + 2; rollout.set_version",
    "areal/api/cli_args.py": "InferenceEngineConfig",
}

_LAZY = {"LorapubSGLangEngine", "LorapubInferenceEngineConfig", "LorapubRemoteInfEngine"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # imports AReaL
        from . import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
