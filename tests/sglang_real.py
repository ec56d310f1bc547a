"""Load a real SGLang release's LoRA code on a CPU machine.

``import sglang`` pulls the whole GPU runtime (PIL, triton, CUDA kernels…). The LoRA
registry and the tokenizer-manager LoRA paths are pure asyncio, so we load those exact
source files from an SGLang tree and provide only their two utility imports, taken from
the same tree: ``ConcurrentCounter`` (extracted verbatim from ``srt/utils/common.py``) and
``RWLock``.

Two trees are used: the installed wheel (0.5.23) and an unpacked 0.5.17 wheel that
``.ci/install`` puts under ``.cache/sglang/0.5.17/sglang`` (or ``$LORAPUB_SGLANG_0517``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import types
from functools import lru_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sglang_root() -> str | None:
    """The installed sglang package folder."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def release_root(release: str) -> str | None:
    """The sglang package folder of ``release`` on this machine, if there is one."""
    if release == "0.5.17":
        root = os.environ.get("LORAPUB_SGLANG_0517") or os.path.join(REPO, ".cache", "sglang", "0.5.17", "sglang")
    else:
        root = sglang_root()
    if root and os.path.exists(os.path.join(root, "srt", "lora", "lora_registry.py")):
        if release_of(root) == release:
            return root
    return None


def release_of(root: str) -> str | None:
    """The version an sglang tree says it is (``_version.py``), without importing it."""
    try:
        with open(os.path.join(root, "_version.py")) as f:
            found = re.search(r"""^__version__ = version = ['"]([^'"]+)['"]""", f.read(), re.M)
        return found.group(1) if found else None
    except OSError:
        return None


def extract(root: str, rel: str, name: str, class_name: str | None = None) -> str:
    """Verbatim source of a top-level class/function, or of a method of ``class_name``."""
    with open(os.path.join(root, rel)) as f:
        src = f.read()
    nodes = ast.parse(src).body
    if class_name is not None:
        nodes = next(n for n in nodes if isinstance(n, ast.ClassDef) and n.name == class_name).body
    node = next(n for n in nodes if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    lines = src.splitlines()[start : node.end_lineno]
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines) + "\n"


def _load_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=4)
def lora_registry_module(root: str | None = None) -> types.ModuleType:
    """The real ``srt/lora/lora_registry.py`` of the tree at ``root`` (default: installed)."""
    root = root or sglang_root()
    if root is None:
        raise ImportError("sglang is not installed")
    tag = re.sub(r"\W", "_", release_of(root) or "x")
    utils = types.ModuleType(f"lorapub_sglang_{tag}.utils")
    exec(compile("import asyncio\n" + extract(root, "srt/utils/common.py", "ConcurrentCounter"), "common.py", "exec"),
         utils.__dict__)
    rwlock = _load_file(f"lorapub_sglang_{tag}.aio_rwlock", os.path.join(root, "srt/utils/aio_rwlock.py"))
    # lora_registry imports `sglang.srt.utils` and `sglang.srt.utils.aio_rwlock`: resolve them to this
    # tree's copies while it loads, then put back whatever was there.
    names = ("sglang.srt.utils", "sglang.srt.utils.aio_rwlock")
    saved = {n: sys.modules.get(n) for n in names}
    utils.aio_rwlock = rwlock
    sys.modules.update({"sglang.srt.utils": utils, "sglang.srt.utils.aio_rwlock": rwlock})
    try:
        return _load_file(f"lorapub_sglang_{tag}.lora_registry", os.path.join(root, "srt/lora/lora_registry.py"))
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module


def available(release: str = "0.5.23") -> bool:
    root = release_root(release)
    if root is None:
        return False
    try:
        lora_registry_module(root)
        return True
    except Exception:
        return False
