"""What was read in Relax (``redai-studio/Relax``): the one table of the names lorapub's hooks and
the stand-ins of ``relax_harness.py`` depend on.

Each row: (class, method, parameters, file, line, commit, kind). ``parameters`` is the definition's
parameter list as written in Relax (names, ``*`` before keyword-only ones, defaults), ``line`` the
line of its ``def`` (or of the constant) in that file at that commit; ``kind`` is ``async``,
``def`` or ``const`` (a module constant: ``parameters`` is then its value's ``repr``). ``class``
``-`` is a module-level name. ``test_relax.py`` compares every stand-in's ``inspect.signature``
with its row, so a change in Relax shows up as one failing row once this table is brought up to
date with it (and a stand-in that drifts from what was read fails the same way).
"""

from __future__ import annotations

SERVICE = "relax/agentic/session/service.py"
RUNTIME = "relax/agentic/pipeline/runtime.py"
DEVICE_DIRECT = "relax/distributed/checkpoint_service/backends/device_direct.py"
LORA_SYNC = "relax/backends/megatron/weight_update/lora_adapter_sync.py"
PEFT_UTILS = "relax/utils/megatron_peft_utils.py"

SERVICE_AT = "29f596af1fdcb6f045577f0b1d3eb28ed932da6d"
RUNTIME_AT = "b71db72d4370f8cb0e26fafbc5864fe46539a4e1"
DEVICE_DIRECT_AT = "0a91dd1db44022920f61f05948e89a5cb83f8b38"
LORA_SYNC_AT = "b71db72d4370f8cb0e26fafbc5864fe46539a4e1"
PEFT_UTILS_AT = "0a91dd1db44022920f61f05948e89a5cb83f8b38"

# fmt: off
RELAX_SURFACE: list[tuple[str, str, str, str, int, str, str]] = [
    # class, method, parameters, file, line, commit, kind
    ("-", "_backend_request_id", "ir", SERVICE, 181, SERVICE_AT, "def"),
    ("AgenticChatRequestError", "__init__",
     "self, message, *, code='invalid_request_error', param=None, status_code=400, error_type='invalid_request_error'",
     SERVICE, 305, SERVICE_AT, "def"),
    ("-", "_error_from_exception", "error", SERVICE, 359, SERVICE_AT, "def"),
    ("AgenticSessionShard", "__init__", "self, args, sglang_request_capacity, sglang_request_limiter, admission_coordinator",
     SERVICE, 1467, SERVICE_AT, "def"),
    ("AgenticSessionShard", "start_group", "self, rollout_mode, group_id, session_specs", SERVICE, 1562, SERVICE_AT, "async"),
    ("AgenticSessionShard", "lease_group", "self, group_id, rollout_id", SERVICE, 1653, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_group_generation_open", "self, group", SERVICE, 1669, SERVICE_AT, "def"),
    ("AgenticSessionShard", "_open_group", "self, group", SERVICE, 1677, SERVICE_AT, "async"),
    ("AgenticSessionShard", "pause_generation", "self", SERVICE, 1694, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_interrupt_running_requests", "self", SERVICE, 1705, SERVICE_AT, "async"),
    ("AgenticSessionShard", "resume_generation", "self, rollout_id", SERVICE, 1753, SERVICE_AT, "async"),
    ("AgenticSessionShard", "take_session_results", "self, group_id, session_ids", SERVICE, 1809, SERVICE_AT, "async"),
    ("AgenticSessionShard", "release_group", "self, group_id", SERVICE, 1824, SERVICE_AT, "async"),
    ("AgenticSessionShard", "drop_group", "self, group_id", SERVICE, 1835, SERVICE_AT, "async"),
    ("AgenticSessionShard", "chat",
     "self, *, session_id, messages, tools, chat_template_kwargs, max_completion_tokens, stop, seed, logprobs=False",
     SERVICE, 1852, SERVICE_AT, "async"),
    ("AgenticSessionShard", "shutdown", "self", SERVICE, 1911, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_shutdown", "self", SERVICE, 2007, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_chat",
     "self, *, session, messages, tools, chat_template_kwargs, max_completion_tokens, stop, seed, logprobs",
     SERVICE, 2034, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_start_session", "self, session, session_input", SERVICE, 2238, SERVICE_AT, "def"),
    ("AgenticSessionShard", "_dispatch_queued_irs_locked", "self, session", SERVICE, 2264, SERVICE_AT, "def"),
    ("AgenticSessionShard", "_fail_ir_locked", "self, session, ir, error", SERVICE, 2303, SERVICE_AT, "def"),
    ("AgenticSessionShard", "_run_ir", "self, session, ir", SERVICE, 2410, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_apply_generate_result", "self, ir, result", SERVICE, 2563, SERVICE_AT, "def"),
    ("AgenticSessionShard", "_finalize_terminal_session", "self, session", SERVICE, 2727, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_finish_session", "self, session, outcome", SERVICE, 2866, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_finish_session_once", "self, session, outcome", SERVICE, 2884, SERVICE_AT, "async"),
    ("AgenticSessionShard", "_drop_group", "self, group", SERVICE, 2965, SERVICE_AT, "async"),
    ("BackendGenerateResult", "__init__", "self, new_tokens, new_log_probs, finish_type, meta_info, elapsed",
     RUNTIME, 174, RUNTIME_AT, "def"),
    ("-", "finish_before_cancellation", "work, task_name", RUNTIME, 510, RUNTIME_AT, "async"),
    ("SGLangBackendAdapter", "__init__", "self, args", RUNTIME, 557, RUNTIME_AT, "def"),
    ("SGLangBackendAdapter", "generate",
     "self, *, input_ids, sampling_params, session_id, request_id, image_data=None, audio_data=None, video_data=None, "
     "return_logprob=True",
     RUNTIME, 577, RUNTIME_AT, "async"),
    ("SGLangBackendAdapter", "abort_request", "self, request_id", RUNTIME, 629, RUNTIME_AT, "async"),
    ("SGLangBackendAdapter", "close_session", "self, session_id, *, timeout_s", RUNTIME, 633, RUNTIME_AT, "async"),
    ("SGLangBackendAdapter", "_worker_urls", "self", RUNTIME, 652, RUNTIME_AT, "async"),
    ("SGLangBackendAdapter", "shutdown", "self", RUNTIME, 670, RUNTIME_AT, "async"),
    ("DeviceDirectBackend", "__init__",
     "self, args, backend_type, role_info, model, *, model_name, quantization_config, coordinator_url=None, lock=None, "
     "timeout_seconds=300",
     DEVICE_DIRECT, 139, DEVICE_DIRECT_AT, "def"),
    ("DeviceDirectBackend", "_batch_request", "self, endpoint, payload=None, get_rank=False",
     DEVICE_DIRECT, 254, DEVICE_DIRECT_AT, "def"),
    ("DeviceDirectBackend", "init_process_group_for_rollout", "self, topology_data=None",
     DEVICE_DIRECT, 421, DEVICE_DIRECT_AT, "def"),
    ("DeviceDirectBackend", "update_weights_for_rollout", "self, rollout_only=False, actor_fwd_only=False",
     DEVICE_DIRECT, 631, DEVICE_DIRECT_AT, "def"),
    ("DeviceDirectBackend", "_push_lora_adapter_distributed", "self, *, first_sync",
     DEVICE_DIRECT, 1220, DEVICE_DIRECT_AT, "def"),
    ("LoraAdapterSync", "__init__", "self, args, model", LORA_SYNC, 50, LORA_SYNC_AT, "def"),
    ("LoraAdapterSync", "config_dict", "self", LORA_SYNC, 76, LORA_SYNC_AT, "def"),
    ("LoraAdapterSync", "export_local_adapter", "self, all_params", LORA_SYNC, 99, LORA_SYNC_AT, "def"),
    ("LoraAdapterSync", "should_skip", "self, all_params", LORA_SYNC, 125, LORA_SYNC_AT, "def"),
    ("LoraAdapterSync", "gather_full_adapter", "self, local_adapter, *, all_gather", LORA_SYNC, 143, LORA_SYNC_AT, "def"),
    ("-", "LORA_ADAPTER_NAME", "'relax_policy_lora'", PEFT_UTILS, 15, PEFT_UTILS_AT, "const"),
]
# fmt: on


def row(cls: str, method: str) -> tuple[str, str, str, str, int, str, str]:
    """The table row of ``cls.method`` (``"-"`` for a module-level name)."""
    found = [r for r in RELAX_SURFACE if r[0] == cls and r[1] == method]
    assert len(found) == 1, (cls, method, found)
    return found[0]
