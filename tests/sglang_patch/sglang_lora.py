"""One SGLang release's own LoRA weight processing, runnable on a CPU without importing sglang.

``srt/lora/lora.py`` (``LoRALayer``, ``LoRAAdapter``) and ``srt/lora/lora_config.py`` (``LoRAConfig``)
are compiled verbatim from the release's files; their sglang imports resolve to what they use of
them, taken verbatim from the same tree (``get_layer_id``, ``get_normalized_target_modules``), or
to empty stand-ins for what only annotations and the GPU-side paths name. Nothing is put into
``sys.modules``: the modules' own ``import`` statements, the lazy ones inside methods included, go
through an ``__import__`` of their own.

:func:`process` is the helper processor the tests name in a :class:`Kit` (it runs in the helper
process): the release's own processing, plus two ways to misbehave, chosen by a file in the folder
(``die``: the process ends at once; ``hang``: it never answers; ``slow``: it writes the file
``started``, then waits for the file ``go`` to appear)."""

from __future__ import annotations

import builtins
import functools
import os
import time
import types

from tests import sglang_real


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@functools.lru_cache(maxsize=4)
def release(root: str) -> types.SimpleNamespace:
    """The LoRA classes of the SGLang tree at ``root``."""
    ns: dict = {}
    exec(compile("import re\n" + sglang_real.extract(root, "srt/layers/utils/common.py", "get_layer_id"),
                 "common.py", "exec"), ns)
    utils_ns: dict = {}
    exec(compile("from typing import Iterable, Union\n"
                 + sglang_real.extract(root, "srt/lora/utils.py", "get_normalized_target_modules"), "utils.py", "exec"),
         utils_ns)

    class Placeholder:  # annotations only
        pass

    def snapshot_download(*a, **k):
        raise OSError("no hub on this machine")

    modules = {
        "huggingface_hub": _stub("huggingface_hub", snapshot_download=snapshot_download),
        "sglang.srt.configs.load_config": _stub("load_config", LoadConfig=Placeholder),
        "sglang.srt.layers.utils": _stub("layers_utils", get_layer_id=ns["get_layer_id"]),
        "sglang.srt.lora.backend.base_backend": _stub("base_backend", BaseLoRABackend=Placeholder),
        "sglang.srt.model_loader.loader": _stub("loader", DefaultModelLoader=Placeholder),
        "sglang.srt.utils.hf_transformers_utils": _stub("hf", AutoConfig=Placeholder),
        "sglang.srt.lora.utils": _stub("lora_utils", get_normalized_target_modules=utils_ns["get_normalized_target_modules"]),
    }

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name in modules:
            return modules[name]
        return builtins.__import__(name, globals, locals, fromlist, level)

    own_builtins = dict(builtins.__dict__, __import__=importer)

    def load(rel: str, name: str) -> dict:
        path = os.path.join(root, rel)
        with open(path) as f:
            src = f.read()
        module_ns = {"__builtins__": own_builtins, "__name__": name, "__file__": path}
        exec(compile(src, path, "exec"), module_ns)
        return module_ns

    config_ns = load("srt/lora/lora_config.py", "sglang_lora_config")
    modules["sglang.srt.lora.lora_config"] = _stub("lora_config", LoRAConfig=config_ns["LoRAConfig"])
    lora_ns = load("srt/lora/lora.py", "sglang_lora")
    return types.SimpleNamespace(LoRAAdapter=lora_ns["LoRAAdapter"], LoRAConfig=config_ns["LoRAConfig"], root=root)


def process(kit, job):
    """The helper processor of the tests: ``kit.options["root"]``'s own processing of ``job``'s folder."""
    from lorapub.sglang_patch.prepared_load.helper import process_with

    folder = job.lora_path
    if os.path.exists(os.path.join(folder, "die")):
        os._exit(7)
    if os.path.exists(os.path.join(folder, "hang")):
        while True:
            time.sleep(60)
    if os.path.exists(os.path.join(folder, "slow")):
        with open(os.path.join(folder, "started"), "w") as f:
            f.write(str(os.getpid()))
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.01)
    real = release(kit.options["root"])
    return process_with(real.LoRAAdapter, real.LoRAConfig, kit, job)


def _last_def(root: str, rel: str, name: str) -> str:
    """Verbatim source of the last top-level function ``name`` of a file (the one its ``@overload``s name)."""
    import ast

    path = os.path.join(root, rel)
    with open(path) as f:
        src = f.read()
    node = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == name][-1]
    return "\n".join(src.splitlines()[node.lineno - 1:node.end_lineno]) + "\n"


EMPTY_SLOT = object()  # what make_resident looks up in the pool class's module, as SGLang's mem_pool has it


@functools.lru_cache(maxsize=4)
def pool_class(root: str) -> type:
    """The release's own slot fill: ``LoRAMemoryPool.load_lora_weight_to_buffer`` and the methods it calls
    for dense adapters, compiled verbatim from ``srt/lora/mem_pool.py`` with the ``srt/lora/utils.py``
    functions it uses, into a class whose instances the tests give the buffers and attributes a pool has."""
    import logging
    import textwrap

    class Placeholder:  # only MoE layers are instances of it
        pass

    modules = {"sglang.srt.lora.layers": _stub("layers", FusedMoEWithLoRA=Placeholder)}

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name in modules:
            return modules[name]
        return builtins.__import__(name, globals, locals, fromlist, level)

    ns: dict = {"__builtins__": dict(builtins.__dict__, __import__=importer), "__name__": __name__,
                "logger": logging.getLogger("sglang_mem_pool")}
    header = ("import re\nimport torch\nfrom typing import Dict, List, Optional, Set, Tuple, Union\n"
              "_SGLANG_EXPERIMENTAL_LORA_OPTI = False\n")  # an environment switch of the release, off by default
    utils = "".join(sglang_real.extract(root, "srt/lora/utils.py", f)
                    for f in ("get_target_module_name", "get_stacked_multiply", "copy_weight_into_buffer"))
    methods = [sglang_real.extract(root, "srt/lora/mem_pool.py", m, "LoRAMemoryPool")
               for m in ("load_lora_weight_to_buffer", "_get_maybe_cached_weight_for_transfer")]
    body = "".join(textwrap.indent(m, "    ") + "\n" for m in methods)
    src = (header + utils + _last_def(root, "srt/lora/mem_pool.py", "append_cache_key_suffix")
           + "LoRAAdapter = BaseLayerWithLoRA = object\n\nclass LoRAMemoryPool:\n" + body)
    exec(compile(src, os.path.join(root, "srt/lora/mem_pool.py"), "exec"), ns)
    return ns["LoRAMemoryPool"]


#: The modules of SGLang's LoRA memory pool for a dense decoder layer, and the part of the layer each is in.
LAYER_MODULES = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class LoRAModule:
    """A LoRA-wrapped linear layer as SGLang's fill slices its weights at tensor-parallel size 1 (a view, as
    SGLang's own layers return)."""

    def slice_lora_a_weights(self, a):
        return a

    def slice_lora_b_weights(self, b):
        return b[:b.shape[0]]


def shaped_pool(pool_cls: type, modules: dict, *, layers: int, max_r: int, slots: int, vocab: int,
                lm_head_hidden: int | None = None, device="cpu"):
    """An empty instance of ``pool_cls`` (a release's ``LoRAMemoryPool``, or :func:`pool_class`'s), not made by
    its constructor (there is no model): bf16 buffers of SGLang's shapes for ``modules`` (name -> input size,
    output size, stacked parts) on every layer, an lm_head pair where ``lm_head_hidden`` is given, and the
    attributes the slot fill and ``make_resident`` read. Returns the pool and each layer's LoRA modules."""
    import sys

    import torch

    pool = object.__new__(pool_cls)
    kw = {"dtype": torch.bfloat16, "device": device}
    pool.A_buffer = {m: [torch.zeros(slots, c * max_r, i, **kw) for _ in range(layers)] for m, (i, _, c) in modules.items()}
    pool.B_buffer = {m: [torch.zeros(slots, o, max_r, **kw) for _ in range(layers)] for m, (_, o, _) in modules.items()}
    pool.embedding_A_buffer, pool.embedding_B_buffer, pool.new_embeddings_buffer = {}, {}, {}
    pool.lm_head_A_buffer, pool.lm_head_B_buffer, pool.target_modules = {}, {}, set(modules)
    if lm_head_hidden is not None:
        pool.lm_head_A_buffer = {"lm_head": torch.zeros(slots, max_r, lm_head_hidden, **kw)}
        pool.lm_head_B_buffer = {"lm_head": torch.zeros(slots, vocab, max_r, **kw)}
        pool.target_modules.add("lm_head")
    pool.num_layer, pool.max_lora_rank, pool.max_loras_per_batch = layers, max_r, slots
    pool.base_model, pool.tp_rank, pool.strict_loading, pool.experts_shared_outer_loras = None, 0, False, False
    pool.pin_memory_available, pool.enable_lora_overlap_loading, pool.lora_added_tokens_size = False, False, 0
    pool.base_hf_config = types.SimpleNamespace(vocab_size=vocab)
    empty = getattr(sys.modules.get(pool_cls.__module__), "EMPTY_SLOT", None)  # SGLang's, beside its pool class
    pool.buffer_id_to_uid, pool.uid_to_buffer_id, pool.eviction_policy = [empty] * slots, {}, None
    module = LoRAModule()
    lora_modules = [{f"model.layers.{i}.{LAYER_MODULES[m]}.{m}": module for m in modules} for i in range(layers)]
    return pool, lora_modules
