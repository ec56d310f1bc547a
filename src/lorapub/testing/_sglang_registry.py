"""Load SGLang's real ``LoRARegistry`` on a CPU machine, without importing all of SGLang: its exact
source file, with ``ConcurrentCounter`` and ``RWLock`` from the same tree, from the installed
SGLang or, where SGLang is not installed, from ``_sglang_vendor/`` (verbatim copies of 0.5.23's).
See docs/testing.md, "`lorapub.testing`".
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from functools import lru_cache



# Verbatim copies of SGLang 0.5.23's registry files (Apache-2.0), used where SGLang is not installed.
VENDORED_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sglang_vendor")


def sglang_root() -> str | None:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def registry_root() -> str:
    """The installed SGLang's tree when it has the registry, else lorapub's verbatim copy of 0.5.23's."""
    root = sglang_root()
    if root is not None and os.path.exists(os.path.join(root, "srt", "lora", "lora_registry.py")):
        return root
    return VENDORED_ROOT


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


def _load_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # a .py path always has both
        raise ImportError(f"no loader for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def lora_registry_module() -> types.ModuleType:
    """SGLang's own ``srt/lora/lora_registry.py`` (see :func:`registry_root`), loaded under a
    private module name; the ``sglang`` namespace is left as it was."""
    root = registry_root()
    utils = types.ModuleType("lorapub_sglang.utils")
    source = "import asyncio\n" + _extract(root, "srt/utils/common.py", "ConcurrentCounter")
    exec(compile(source, "common.py", "exec"), utils.__dict__)
    rwlock = _load_file("lorapub_sglang.aio_rwlock", os.path.join(root, "srt", "utils", "aio_rwlock.py"))
    setattr(utils, "aio_rwlock", rwlock)  # a module made here: mypy knows no attributes of it
    # lora_registry imports `sglang.srt.utils` and `sglang.srt.utils.aio_rwlock`: resolve them to
    # the wheel's copies while it loads, then put back whatever was there.
    names = ("sglang.srt.utils", "sglang.srt.utils.aio_rwlock")
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update({"sglang.srt.utils": utils, "sglang.srt.utils.aio_rwlock": rwlock})
    try:
        return _load_file("lorapub_sglang.lora_registry", os.path.join(root, "srt", "lora", "lora_registry.py"))
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
