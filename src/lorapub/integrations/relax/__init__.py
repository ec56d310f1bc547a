"""Relax integration: immutable LoRA versions for Relax's agentic rollouts, behind one flag.

The hooks are what Relax's ``AgenticSessionShard`` and ``DeviceDirectBackend`` call, written against
the Relax files of :data:`RELAX_COMMITS`. Off (the default) nothing changes: every hook returns at
once or hands back Relax's own. Importing this module needs neither Relax, Megatron, Ray, torch nor aiohttp.
See docs/relax.md, "What changes in Relax's code".
"""

from __future__ import annotations

from .errors import NOT_RESENDABLE, RESENDABLE, RelaxChatError, chat_error, error_result, export_metadata
from .options import (
    CONFIG_FLAG,
    DEFAULT_NAME_PREFIX,
    ENABLE_FLAG,
    MAX_STALENESS,
    RELAX_ADAPTER_NAME,
    RELAX_NAME_FAMILIES,
    RELAX_OPTIONS,
    TRANSPORTS,
    LorapubConfig,
    OptionClash,
    add_arguments,
    check_name_prefix,
    check_parser,
    config_from_args,
    engine_env,
    engine_name,
    is_enabled,
    sglang_overrides,
    topology_urls,
    validate_args,
    version_id_for,
)
from .shard import GenerateResult, LorapubGenerationBackend, RelaxLorapub
from .trainer import (
    LorapubPublisher,
    LorapubWeightPath,
    PublishOutcome,
    WeightPublicationFailed,
    install_weight_path,
    max_over,
)

__all__ = [
    "CONFIG_FLAG", "ENABLE_FLAG", "MAX_STALENESS", "NOT_RESENDABLE", "RESENDABLE", "DEFAULT_NAME_PREFIX", "RELAX_ADAPTER_NAME", "RELAX_COMMITS", "RELAX_NAME_FAMILIES",
    "RELAX_OPTIONS", "TRANSPORTS", "GenerateResult", "LorapubConfig", "LorapubGenerationBackend", "LorapubPublisher",
    "LorapubWeightPath", "OptionClash", "PublishOutcome", "RelaxChatError", "RelaxLorapub", "WeightPublicationFailed",
    "add_arguments", "chat_error", "check_name_prefix", "check_parser", "config_from_args", "engine_env",
    "engine_name", "error_result", "export_metadata", "install_weight_path", "is_enabled", "max_over", "sglang_overrides",
    "topology_urls", "validate_args", "version_id_for",
]

#: The Relax files (and the commits of them) these hooks were written against.
RELAX_COMMITS: dict[str, str] = {
    "relax/agentic/session/service.py": "29f596af1fdcb6f045577f0b1d3eb28ed932da6d",
    "relax/agentic/session/state.py": "29f596af1fdcb6f045577f0b1d3eb28ed932da6d",
    "relax/agentic/pipeline/runtime.py": "b71db72d4370f8cb0e26fafbc5864fe46539a4e1",
    "relax/distributed/checkpoint_service/backends/device_direct.py": "0a91dd1db44022920f61f05948e89a5cb83f8b38",
    "relax/backends/megatron/weight_update/lora_adapter_sync.py": "b71db72d4370f8cb0e26fafbc5864fe46539a4e1",
    "relax/utils/megatron_peft_utils.py": "0a91dd1db44022920f61f05948e89a5cb83f8b38",
    "relax/utils/arguments.py": "02bf712a9e601780904cede4ed5ec3b662eeb929",
}
