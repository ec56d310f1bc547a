"""A TokenizerManager made of SGLang 0.5.23's own LoRA code, runnable on a CPU.

The methods below are extracted verbatim from the installed wheel (or from a
patched copy of its files); only what lives on the GPU side is replaced: the
scheduler fan-out (``update_lora_adapter_communicator``) and the request
plumbing around the LoRA calls, which follows ``generate_request``'s order:
resolve+acquire -> tokenizer validation -> dispatch -> terminal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import types
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Union

from tests import sglang_real

TM_FILE = "srt/managers/tokenizer_manager.py"
MIXIN_FILE = "srt/managers/tokenizer_control_mixin.py"
TM_METHODS = ["_release_lora_once", "_release_req_states_on_failure", "_handle_abort_finish_reason",
              "_validate_and_resolve_lora", "_resolve_lora_path"]
MIXIN_METHODS = ["_unload_lora_adapter_locked", "load_lora_adapter", "unload_lora_adapter"]
MIXIN_FUNCTIONS = ["_merge_lora_update_results", "_lora_load_needs_cleanup"]


@dataclasses.dataclass(kw_only=True)
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: Optional[str] = None


@dataclasses.dataclass(kw_only=True)
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: Optional[str] = None


@dataclasses.dataclass(kw_only=True)
class LoRAUpdateOutput:
    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Optional[Dict[str, Any]] = None


@dataclasses.dataclass
class GenerateReqInput:
    rid: str
    input_ids: list
    lora_path: Any = None
    lora_id: Any = None


@dataclasses.dataclass
class ReqState:
    obj: Any
    dispatched: bool = False
    lora_released: bool = False


class HTTPException(Exception):
    def __init__(self, status_code, detail):
        super().__init__(detail)
        self.status_code = status_code


@dataclasses.dataclass
class Request:
    headers: dict


def _namespace(registry_module) -> dict:
    lora = types.SimpleNamespace(enable_lora=True, max_loaded_loras=3, lora_paths=None)
    return {
        "asyncio": asyncio, "os": os, "logger": logging.getLogger("sglang.harness"), "HTTPStatus": HTTPStatus,
        "fastapi": types.SimpleNamespace(HTTPException=HTTPException, Request=Request),
        "Optional": Optional, "Union": Union, "List": List, "Dict": Dict, "Any": Any,
        "get_lora": lambda: lora, "get_parallel": lambda: types.SimpleNamespace(dp_size=1),
        "LoRARef": registry_module.LoRARef, "LoRARegistry": registry_module.LoRARegistry,
        "LoadLoRAAdapterReqInput": LoadLoRAAdapterReqInput, "UnloadLoRAAdapterReqInput": UnloadLoRAAdapterReqInput,
        "LoRAUpdateOutput": LoRAUpdateOutput, "LoadLoRAAdapterReqOutput": LoRAUpdateOutput,
        "UnloadLoRAAdapterReqOutput": LoRAUpdateOutput, "GenerateReqInput": GenerateReqInput,
        "EmbeddingReqInput": GenerateReqInput, "ReqState": ReqState, "TokenizerManager": object,
        "_lora_settings": lora,
    }


def _source_of(root: str, rel: str, name: str, class_name: str | None) -> str:
    import ast

    from lorapub.sglang_patch import _parsed

    path = os.path.join(root, rel)
    src, tree = _parsed(path, os.path.getmtime(path))
    nodes = tree.body
    if class_name:
        nodes = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == class_name).body
    node = next(n for n in nodes if getattr(n, "name", None) == name)
    seg = ast.get_source_segment(src, node)
    lines = seg.splitlines()
    return "\n".join([lines[0]] + [l[4:] if class_name and l.startswith("    ") else l for l in lines[1:]]) + "\n"


def build(root: str | None = None) -> type:
    """A class whose LoRA methods are SGLang's (from ``root``, default: the installed wheel)."""
    root = root or sglang_real.sglang_root()
    registry_module = sglang_real.lora_registry_module()
    ns = _namespace(registry_module)
    import ast

    mixin_src = open(os.path.join(root, MIXIN_FILE)).read()
    for node in ast.parse(mixin_src).body:
        # the helpers the LoRA methods call, and (in a patched copy) lorapub's constants
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] + [getattr(node, "name", "")]
        if any(n in MIXIN_FUNCTIONS or n.startswith(("LORAPUB_", "_is_managed_lora")) for n in names):
            code = "from __future__ import annotations\n" + ast.get_source_segment(mixin_src, node)
            exec(compile(code, MIXIN_FILE, "exec"), ns)
    methods = {}
    for rel, cls, names in ((TM_FILE, "TokenizerManager", TM_METHODS), (MIXIN_FILE, "TokenizerControlMixin", MIXIN_METHODS)):
        for name in names:
            local: dict = {}
            exec(compile("from __future__ import annotations\n" + _source_of(root, rel, name, cls), rel, "exec"), ns, local)
            methods[name] = local[name]

    class Harness:
        enable_lora = True

        def __init__(self, max_loaded_loras: int = 3) -> None:
            ns["_lora_settings"].max_loaded_loras = max_loaded_loras
            self.lora_registry = registry_module.LoRARegistry()
            self.lora_ref_cache: dict = {}
            self.pending_lora_unloads: dict = {}
            self.lora_update_lock = asyncio.Lock()
            self.rid_to_state: dict = {}
            self.encoder_dispatch_ready: dict = {}
            self._lora_release_tasks: set = set()
            self.rank_ops: list[tuple[str, str]] = []  # what reached the (GPU) ranks
            self.rank_loaded: dict[str, str] = {}
            self.aborted: list[str] = []
            self.releases: list[Any] = []
            real_release = self.lora_registry.release

            async def release(lora_id):
                self.releases.append(lora_id)
                return await real_release(lora_id)

            self.lora_registry.release = release

        def auto_create_handle_loop(self) -> None:
            pass

        async def update_lora_adapter_communicator(self, obj):
            op = "load" if isinstance(obj, LoadLoRAAdapterReqInput) else "unload"
            self.rank_ops.append((op, obj.lora_name))
            if op == "load":
                self.rank_loaded[obj.lora_name] = obj.lora_path
            else:
                self.rank_loaded.pop(obj.lora_name, None)
            return [LoRAUpdateOutput(success=True, loaded_adapters=dict(self.rank_loaded))]

        def abort_request(self, rid: str) -> None:
            self.aborted.append(rid)

        # generate_request's order around the LoRA calls
        async def generate(self, rid, lora_path, *, n_tokens=4, context_len=64, terminal="finish", hold=None):
            obj = GenerateReqInput(rid, list(range(n_tokens)), lora_path)
            state = ReqState(obj)
            self.rid_to_state[rid] = state
            states = {rid: state}
            try:
                await self._validate_and_resolve_lora(obj)
                if n_tokens > context_len:  # _tokenize_one_request's input-length check
                    raise ValueError(f"The input ({n_tokens} tokens) is longer than the model's context length ({context_len} tokens).")
                state.dispatched = True
                if hold is not None:
                    await hold.wait()
                if terminal == "finish":  # the scheduler's final output (_handle_batch_output)
                    del self.rid_to_state[rid]
                    self._release_lora_once(state)
                else:
                    out = {"meta_info": {"finish_reason": {"type": "abort", "status_code": terminal, "message": "injected"}}}
                    await self._handle_abort_finish_reason(out, state, False)
                return obj.lora_id
            except BaseException:
                self._release_req_states_on_failure(states)
                raise

        def scheduler_finished(self, rid: str) -> None:
            """The scheduler's answer to an abort: the normal terminal path."""
            state = self.rid_to_state.pop(rid)
            self._release_lora_once(state)

        async def settle(self) -> None:
            for _ in range(5):
                if self._lora_release_tasks:
                    await asyncio.gather(*list(self._lora_release_tasks), return_exceptions=True)
                await asyncio.sleep(0)

        def refs(self, name: str) -> int | None:
            ref = self.lora_registry.get_all_adapters().get(name)
            return None if ref is None else self.lora_registry._counters[ref.lora_id].value()

    for name, fn in methods.items():
        setattr(Harness, name, fn)
    Harness.__module__ = __name__
    return Harness


def build_runtime_patched() -> type:
    """The installed code with ``lorapub.sglang_patch.apply()`` on top."""
    from lorapub import sglang_patch

    return sglang_patch.apply(build(), add_state_route=False)
