"""Load the real SGLang 0.5.23 LoRA code on a CPU machine.

``import sglang`` pulls the whole GPU runtime (PIL, triton, CUDA kernels…).
The LoRA registry and the tokenizer-manager LoRA paths are pure asyncio, so
we load those exact source files from the installed wheel and provide only
their two utility imports, taken from the same wheel: ``ConcurrentCounter``
(extracted verbatim from ``sglang/srt/utils/common.py``) and ``RWLock``.
Functions of TokenizerManager are extracted verbatim the same way.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
import types
from functools import lru_cache


def sglang_root() -> str | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def sglang_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return None


def _source(rel: str) -> str:
    root = sglang_root()
    if root is None:
        raise ImportError("sglang is not installed")
    with open(os.path.join(root, rel)) as f:
        return f.read()


def extract(rel: str, name: str, class_name: str | None = None) -> str:
    """Verbatim source of a top-level class/function, or of a method of ``class_name``."""
    src = _source(rel)
    tree = ast.parse(src)
    nodes = tree.body
    if class_name is not None:
        cls = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == class_name)
        nodes = cls.body
    node = next(n for n in nodes if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    lines = src.splitlines()[start : node.end_lineno]
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines) + "\n"


@lru_cache(maxsize=1)
def lora_registry_module() -> types.ModuleType:
    """The real ``sglang.srt.lora.lora_registry`` module."""
    try:  # a full install (GPU machine) imports normally
        import sglang.srt.lora.lora_registry as real  # noqa: F401

        return real
    except Exception:
        pass
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    root = sglang_root()
    if root is None:
        raise ImportError("sglang is not installed")
    utils = types.ModuleType("sglang.srt.utils")
    exec(compile("import asyncio\n" + extract("srt/utils/common.py", "ConcurrentCounter"), "common.py", "exec"), utils.__dict__)
    for pkg, where in (("sglang", root), ("sglang.srt", os.path.join(root, "srt")), ("sglang.srt.lora", os.path.join(root, "srt", "lora"))):
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


def available() -> bool:
    try:
        lora_registry_module()
        return True
    except Exception:
        return False
