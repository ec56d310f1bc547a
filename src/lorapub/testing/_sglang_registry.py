"""Load SGLang's real ``LoRARegistry`` on a CPU machine, without importing all of SGLang.

``import sglang`` pulls the whole GPU runtime (PIL, triton, CUDA kernels…). The LoRA
registry is pure asyncio, so its exact source file is loaded from the installed wheel,
with its two utility imports taken from the same wheel: ``ConcurrentCounter``
(extracted verbatim from ``sglang/srt/utils/common.py``) and ``RWLock``.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
import types
from functools import lru_cache

from lorapub.errors import LorapubError


class SGLangMissing(LorapubError):
    """The SGLang contract double needs SGLang's ``LoRARegistry`` and SGLang is not installed."""

    code = "SGLANG_MISSING"


def sglang_root() -> str | None:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _missing() -> SGLangMissing:
    return SGLangMissing(
        "the SGLang contract double runs SGLang's own LoRARegistry: "
        "`pip install 'lorapub[demo]' && pip install --no-deps sglang==0.5.23` (no GPU stack needed)"
    )


def _extract(root: str, rel: str, name: str) -> str:
    """Verbatim source of one top-level class or function of the wheel's file ``rel``."""
    with open(os.path.join(root, rel)) as f:
        src = f.read()
    node = next(
        n for n in ast.parse(src).body
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    )
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    return "\n".join(src.splitlines()[start : node.end_lineno]) + "\n"


@lru_cache(maxsize=1)
def lora_registry_module() -> types.ModuleType:
    """The real ``sglang.srt.lora.lora_registry`` module; :class:`SGLangMissing` without SGLang."""
    try:  # a full install (GPU machine) imports normally
        import sglang.srt.lora.lora_registry as real

        return real
    except Exception:
        pass
    root = sglang_root()
    if root is None:
        raise _missing()
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    utils = types.ModuleType("sglang.srt.utils")
    source = "import asyncio\n" + _extract(root, "srt/utils/common.py", "ConcurrentCounter")
    exec(compile(source, "common.py", "exec"), utils.__dict__)
    for pkg, where in (
        ("sglang", root), ("sglang.srt", os.path.join(root, "srt")), ("sglang.srt.lora", os.path.join(root, "srt", "lora")),
    ):
        mod = types.ModuleType(pkg)
        mod.__path__ = []  # placeholder package: only the files loaded below are real
        mod.__spec__ = importlib.machinery.ModuleSpec(pkg, None, is_package=True)
        mod.__spec__.submodule_search_locations = [where]  # so find_spec still locates the wheel
        sys.modules[pkg] = mod
    sys.modules["sglang.srt.utils"] = utils
    utils.__path__ = []
    for name, rel in (
        ("sglang.srt.utils.aio_rwlock", "srt/utils/aio_rwlock.py"),
        ("sglang.srt.lora.lora_registry", "srt/lora/lora_registry.py"),
    ):
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, rel))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules["sglang.srt.lora.lora_registry"]
