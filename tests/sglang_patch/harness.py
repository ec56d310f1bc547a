"""A TokenizerManager made of one SGLang release's own LoRA code, runnable on a CPU.

The LoRA methods are compiled verbatim from that release's files (a wheel, or a copy
with lorapub's diffs applied); only what lives on the GPU side is replaced: the
scheduler fan-out (``update_lora_adapter_communicator``) and the request plumbing
around the LoRA calls, which follows ``generate_request``'s order:
resolve+acquire -> tokenizer validation -> dispatch -> terminal.

SGLang 0.5.17 releases a finished request's ref inside the 250-line
``_handle_batch_output``; the harness runs the two blocks of it that matter here,
extracted verbatim: the "state is None" branch and the "state.finished" branch.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import logging
import os
import textwrap
import types
from http import HTTPStatus
from typing import Any, Dict, List, Optional, Union

from lorapub.sglang_patch import targets
from tests import sglang_real

TM_FILE, MIXIN_FILE = targets.TM_FILE, targets.MIXIN_FILE
MIXIN_METHODS = ["_unload_lora_adapter_locked", "load_lora_adapter", "unload_lora_adapter", "load_lora_adapter_from_tensors"]
MIXIN_FUNCTIONS = ["_merge_lora_update_results", "_lora_load_needs_cleanup"]
TM_METHODS = {
    "0.5.23": ["_release_lora_once", "_release_req_states_on_failure", "_handle_abort_finish_reason",
               "_validate_and_resolve_lora", "_resolve_lora_path"],
    "0.5.17": ["_handle_batch_output", "_handle_abort_req", "_handle_abort_finish_reason", "_discard_pending_req_states", "_remove_req_state",
               "_validate_and_resolve_lora", "_resolve_lora_path"],
}


@dataclasses.dataclass(kw_only=True)
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: Optional[str] = None


@dataclasses.dataclass(kw_only=True)
class LoadLoRAAdapterFromTensorsReqInput:
    """SGLang's fields (0.5.17 and 0.5.23 have the same): the serialized tensors go to every TP rank."""

    lora_name: str
    config_dict: Dict[str, Any]
    serialized_named_tensors: List[bytes]
    pinned: bool = False
    added_tokens_config: Optional[Dict[str, int]] = None
    lora_id: Optional[str] = None
    load_format: Optional[str] = None
    expected_checksums: Optional[Dict[str, str]] = None


@dataclasses.dataclass(kw_only=True)
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: Optional[str] = None


@dataclasses.dataclass(kw_only=True)
class UpdateLoRAFromDistributedReqInput:
    """The fields of the request Relax's patch adds (its tensors arrive over an NCCL group)."""

    lora_name: str
    config_dict: Dict[str, Any]
    names: List[str]
    dtypes: List[str]
    shapes: List[List[int]]
    bucket_sizes: Optional[List[int]] = None
    group_name: str = "weight_update_group"
    pinned: bool = False
    added_tokens_config: Optional[Dict[str, Any]] = None
    lora_id: Optional[str] = None
    load_format: Optional[str] = None
    lora_path: str = "__distributed__"  # what its to_ref() gives the ranks


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
    is_single: bool = True


class _TimeStats:
    trace_ctx = types.SimpleNamespace(tracing_enable=False)

    def set_finished_time(self) -> None:
        pass

    def get_e2e_latency(self) -> float:
        return 0.0


@dataclasses.dataclass
class ReqState:
    obj: Any
    dispatched: bool = False
    lora_released: bool = False
    finished: bool = False
    abort_requested: bool = False
    lifecycle_id: object = dataclasses.field(default_factory=object)
    time_stats: Any = dataclasses.field(default_factory=_TimeStats)


@dataclasses.dataclass(kw_only=True)
class AbortReq:
    rid: str = ""
    abort_all: bool = False


class HTTPException(Exception):
    def __init__(self, status_code, detail):
        super().__init__(detail)
        self.status_code = status_code


@dataclasses.dataclass
class Request:
    headers: dict


@dataclasses.dataclass
class BatchOutput:
    rids: list
    finished_reasons: list


def _namespace(registry_module, server_args) -> dict:
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
        "LoadLoRAAdapterFromTensorsReqInput": LoadLoRAAdapterFromTensorsReqInput,
        "LoadLoRAAdapterFromTensorsReqOutput": LoRAUpdateOutput,
        "UpdateLoRAFromDistributedReqInput": UpdateLoRAFromDistributedReqInput,
        "UpdateLoRAFromDistributedReqOutput": LoRAUpdateOutput,
        # stand-in for SGLang's payload normaliser (base64 strings -> bytes); payloads here are bytes
        "normalize_serialized_named_tensor_payloads": lambda payloads: [bytes(p) for p in payloads],
        "EmbeddingReqInput": GenerateReqInput, "ReqState": ReqState, "TokenizerManager": object,
        "AbortReq": AbortReq, "HEALTH_CHECK_RID_PREFIX": "HEALTH_CHECK", "BatchEmbeddingOutput": type(None),
        "_lora_settings": lora, "_server_args": server_args,
    }


def _source_of(root: str, rel: str, name: str, class_name: str | None) -> str:
    src, tree = targets.parsed(os.path.join(root, rel))
    nodes = tree.body
    if class_name:
        nodes = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == class_name).body
    node = next(n for n in nodes if getattr(n, "name", None) == name)
    seg = ast.get_source_segment(src, node)
    lines = seg.splitlines()
    return "\n".join([lines[0]] + [l[4:] if class_name and l.startswith("    ") else l for l in lines[1:]]) + "\n"


def _is_static(root: str, rel: str, name: str, class_name: str) -> bool:
    _, tree = targets.parsed(os.path.join(root, rel))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    node = next(n for n in cls.body if getattr(n, "name", None) == name)
    return any(getattr(d, "id", None) == "staticmethod" for d in node.decorator_list)


def _batch_output_blocks(method_source: str) -> str:
    """0.5.17: the two blocks of ``_handle_batch_output`` that end a request, as two methods."""
    lines = method_source.splitlines()
    src = "\n".join([lines[0]] + [line[4:] if line.startswith("    ") else line for line in lines[1:]])
    fn = ast.parse(src).body[0]
    loop = next(n for n in fn.body if isinstance(n, ast.For))
    missing = next(n for n in loop.body if isinstance(n, ast.If) and ast.unparse(n.test) == "state is None")
    finished = next(n for n in loop.body if isinstance(n, ast.If) and ast.unparse(n.test) == "state.finished")

    def body(node: ast.If, indent: str) -> str:
        seg = ast.get_source_segment(src, node, padded=True)
        return textwrap.indent(textwrap.dedent("\n".join(seg.splitlines()[1:])), indent)

    return (
        "def _missing_state(self, rid, recv_obj, i):\n    for _once in (0,):\n" + body(missing, " " * 8) + "\n\n"
        "def _finished_state(self, state, rid, recv_obj, i, meta_info):\n" + body(finished, " " * 4) + "\n"
    )


def build(root: str | None = None, release: str | None = None) -> type:
    """A class whose LoRA methods are SGLang's (from ``root``, default: the installed wheel)."""
    root = root or sglang_real.sglang_root()
    release = release or sglang_real.release_of(root)
    registry_module = sglang_real.lora_registry_module(root)
    server_args = types.SimpleNamespace(
        enable_lora=True, max_loaded_loras=3, dp_size=1, enable_dp_attention=False, speculative_algorithm=None
    )
    ns = _namespace(registry_module, server_args)
    mixin_src = open(os.path.join(root, MIXIN_FILE)).read()
    for node in ast.parse(mixin_src).body:
        # the helpers the LoRA methods call, and (in a patched copy) lorapub's constants
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] + [getattr(node, "name", "")]
        if any(n in MIXIN_FUNCTIONS or n.startswith(("LORAPUB_", "_is_managed_lora")) for n in names):
            code = "from __future__ import annotations\n" + ast.get_source_segment(mixin_src, node)
            exec(compile(code, MIXIN_FILE, "exec"), ns)
    methods = {}
    tm_names = list(TM_METHODS[release])
    # a patched copy carries lorapub's helper methods too
    _, tm_tree = targets.parsed(os.path.join(root, TM_FILE))
    _, mx_tree = targets.parsed(os.path.join(root, MIXIN_FILE))
    for tree, rel, cls_name, names in ((tm_tree, TM_FILE, "TokenizerManager", tm_names),
                                       (mx_tree, MIXIN_FILE, "TokenizerControlMixin", list(MIXIN_METHODS))):
        cls_node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        names += [n.name for n in cls_node.body if getattr(n, "name", "").startswith("_lorapub_")]
        # a tree with Relax's patch (0.5.17+relax) carries its route handler too
        if cls_name == targets.MIXIN:
            names += [n.name for n in cls_node.body if getattr(n, "name", "") == targets.RELAX_ROUTE[2]]
        for name in names:
            local: dict = {}
            exec(compile("from __future__ import annotations\n" + _source_of(root, rel, name, cls_name), rel, "exec"), ns, local)
            fn = local[name]
            methods[name] = staticmethod(fn) if _is_static(root, rel, name, cls_name) else fn
    if release == "0.5.17":
        local = {}
        exec(compile("from __future__ import annotations\n" + _source_of(root, TM_FILE, "_logical_rids", "TokenizerManager"),
                     TM_FILE, "exec"), ns, local)
        methods["_logical_rids"] = staticmethod(local["_logical_rids"])

    class Harness:
        enable_lora = True
        enable_metrics = False
        sglang_release = release

        def __init__(self, max_loaded_loras: int = 3) -> None:
            ns["_lora_settings"].max_loaded_loras = max_loaded_loras
            ns["_server_args"].max_loaded_loras = max_loaded_loras
            self.server_args = ns["_server_args"]
            self.lora_registry = registry_module.LoRARegistry()
            self.lora_ref_cache: dict = {}
            if release == "0.5.23":
                self.pending_lora_unloads: dict = {}
            self.lora_update_lock = asyncio.Lock()
            self.rid_to_state: dict = {}
            self.child_rid_to_logical_rid: dict = {}
            self.logical_rid_to_child_rids: dict = {}
            self.encoder_dispatch_ready: dict = {}
            self._lora_release_tasks: set = set()
            self.rank_ops: list[tuple[str, str]] = []  # what reached the (GPU) ranks
            self.rank_loaded: dict[str, str] = {}
            self.rank_tensors: dict[str, dict] = {}
            self.aborted: list[str] = []
            self.releases: list[Any] = []
            self._tasks: set = set()
            real_release = self.lora_registry.release

            async def counted_release(lora_id):
                self.releases.append(lora_id)
                return await real_release(lora_id)

            self.lora_registry.release = counted_release

        def auto_create_handle_loop(self) -> None:
            pass

        async def update_lora_adapter_communicator(self, obj):
            op = "unload" if isinstance(obj, UnloadLoRAAdapterReqInput) else "load"
            self.rank_ops.append((op, obj.lora_name))
            if isinstance(obj, LoadLoRAAdapterFromTensorsReqInput):
                # what a TP rank does (tp_worker.load_lora_adapter_from_tensors): deserialize its own
                # copy, check every tensor's SHA-256 against expected_checksums
                import hashlib
                import pickle

                tensors = pickle.loads(obj.serialized_named_tensors[0])
                for name, want in (obj.expected_checksums or {}).items():
                    raw = tensors[name].contiguous().flatten().view(__import__("torch").uint8).numpy()
                    if hashlib.sha256(raw).hexdigest() != want:
                        return [LoRAUpdateOutput(success=False, error_message=f"[LORA-CHECK] MISMATCH {name}")]
                self.rank_tensors[obj.lora_name] = tensors
                self.rank_loaded[obj.lora_name] = "__tensor__"
            elif op == "load":
                self.rank_loaded[obj.lora_name] = obj.lora_path
            else:
                self.rank_loaded.pop(obj.lora_name, None)
            return [LoRAUpdateOutput(success=True, loaded_adapters=dict(self.rank_loaded))]

        def abort_request(self, rid: str) -> None:
            self.aborted.append(rid)

        def _dispatch_to_scheduler(self, req) -> None:
            self.aborted.append(req.rid)

        # -- the scheduler's answers ---------------------------------------------------
        def _batch_output_finished(self, rid: str, status: int | None = None):
            """What ``_handle_batch_output`` does for a finished request (0.5.17's own blocks)."""
            recv = BatchOutput([rid], [{"type": "abort" if status else "length", "status_code": status}])
            fn = type(self)._handle_batch_output
            blocks = fn.__dict__.get("harness_blocks")
            if blocks is None:  # the blocks of exactly the code installed: shipped, diffed or runtime-edited
                source = (getattr(fn, "__lorapub_source__", None)
                          or targets.function_source(TM_FILE, "TokenizerManager", "_handle_batch_output", root))
                blocks = fn.harness_blocks = {}
                exec(compile("from __future__ import annotations\n" + _batch_output_blocks(source), TM_FILE, "exec"), ns, blocks)
            state = self.rid_to_state.get(rid)
            if state is None:
                blocks["_missing_state"](self, rid, recv, 0)
                return None
            state.finished = True
            blocks["_finished_state"](self, state, rid, recv, 0, {})
            return state

        def scheduler_finished(self, rid: str) -> None:
            """The scheduler's terminal answer (normal finish, or the echo of an abort)."""
            if release == "0.5.23":
                state = self.rid_to_state.pop(rid)
                self._release_lora_once(state)
            else:
                self._batch_output_finished(rid)

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
                    self.scheduler_finished(rid)
                else:
                    out = {"meta_info": {"finish_reason": {"type": "abort", "status_code": terminal, "message": "injected"}}}
                    if release == "0.5.17":  # the abort finished through the batch-output path first
                        self._batch_output_finished(rid, terminal)
                    await self._handle_abort_finish_reason(out, state, False)
                return obj.lora_id
            except BaseException:
                if release == "0.5.23":
                    self._release_req_states_on_failure(states)
                else:
                    self._discard_pending_req_states(obj, {rid: state.lifecycle_id})
                raise

        async def settle(self) -> None:
            for _ in range(5):
                await asyncio.sleep(0)
                pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
                releases = [t for t in pending if "release" in repr(t.get_coro())]
                if releases:
                    await asyncio.gather(*releases, return_exceptions=True)

        def refs(self, name: str) -> int | None:
            ref = self.lora_registry.get_all_adapters().get(name)
            return None if ref is None else self.lora_registry._counters[ref.lora_id].value()

    for name, fn in methods.items():
        setattr(Harness, name, fn)
    Harness.__module__ = __name__
    return Harness


def build_runtime_patched(root: str | None = None) -> type:
    """The release's own code with ``lorapub.sglang_patch.apply()`` on top."""
    from lorapub import sglang_patch

    return sglang_patch.apply(build(root), root=root, add_state_route=False)
