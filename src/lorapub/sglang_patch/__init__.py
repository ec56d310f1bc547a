"""lorapub's SGLang patch, runtime form: ``lorapub.sglang_patch.apply()``.

For users who cannot rebuild SGLang. It patches the TokenizerManager class of
the running process (the HTTP server process, where SGLang keeps its
``LoRARegistry``) and adds ``GET /lorapub/state``. The same three changes ship
as unified diffs in the repository's ``sglang_patch/`` folder.

1. Exactly-once release: a request that never acquired a LoRA ref (rejected
   before ``acquire``) never schedules a release.
2. Managed adapters are never implicitly reloaded: a managed name leaves the
   reload cache when its unload starts, so a late request is rejected.
3. Managed pinned adapters are unloadable only with a reclaim id (header
   ``X-Lorapub-Reclaim-Id``); ordinary unload is refused, LRU already skips pinned.

Every target function is fingerprinted: the patch refuses to apply to code
other than the SGLang release it was written against.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
import uuid
from typing import Any

SGLANG_VERSION = "0.5.23"
RECLAIM_HEADER = "X-Lorapub-Reclaim-Id"
MANAGED_PREFIX = "relax_policy_lora@"
PATCH_MARK = "__lorapub_patched__"
INCARNATION = uuid.uuid4().hex  # one per server process life

TM_FILE = "srt/managers/tokenizer_manager.py"
MIXIN_FILE = "srt/managers/tokenizer_control_mixin.py"
# sha256 of each target's source text in SGLang 0.5.23 (see fingerprint()).
EXPECTED = {
    (TM_FILE, "TokenizerManager", "_release_lora_once"):
        "43c0ffb0b9b40bd47aded7006d1bf1435cb4c27f49c5e637bd62862c0783d44e",
    (TM_FILE, "TokenizerManager", "_resolve_lora_path"):
        "a0718ec3647eaae1c5bd42d2e5adec3422bea3aba80263700bcc4810fb14e8c1",
    (MIXIN_FILE, "TokenizerControlMixin", "_unload_lora_adapter_locked"):
        "d774b493d258aeff0cf2c09e9c6e966bcc5c68f21555002768c6064d75adc4b1",
    (MIXIN_FILE, "TokenizerControlMixin", "unload_lora_adapter"):
        "1b96d090c7dfc432b1497083e4a5c48756142059d1f0583f99afbef859bd6bac",
    (MIXIN_FILE, "TokenizerControlMixin", "load_lora_adapter"):
        "e96d92b277cf95f38cb8b4eda91672608d8e33561b44616dfc25ff96d39cb928",
}


class PatchMismatch(RuntimeError):
    """The installed SGLang is not the code this patch was written for."""


def sglang_root() -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PatchMismatch("sglang is not installed")
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime: float) -> tuple[str, ast.Module]:
    with open(path) as f:
        src = f.read()
    return src, ast.parse(src)


def function_source(rel: str, class_name: str, name: str, root: str | None = None) -> str:
    path = os.path.join(root or sglang_root(), rel)
    src, tree = _parsed(path, os.path.getmtime(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return ast.get_source_segment(src, item) or ""
    raise PatchMismatch(f"{rel}: {class_name}.{name} not found")


def fingerprint(rel: str, class_name: str, name: str, root: str | None = None) -> str:
    return hashlib.sha256(function_source(rel, class_name, name, root).encode()).hexdigest()


def verify(root: str | None = None) -> None:
    """Raise :class:`PatchMismatch` naming every target whose code is not the expected one."""
    bad = []
    for (rel, cls, name), expected in EXPECTED.items():
        try:
            got = fingerprint(rel, cls, name, root)
        except (OSError, PatchMismatch) as e:
            bad.append(f"{cls}.{name}: {e}")
            continue
        if got != expected:
            bad.append(f"{cls}.{name}: fingerprint {got[:12]} != expected {expected[:12]}")
    if bad:
        raise PatchMismatch(
            f"lorapub's SGLang patch targets SGLang {SGLANG_VERSION}; refusing to patch other code:\n  " + "\n  ".join(bad)
        )


def is_managed(name: Any, prefix: str = MANAGED_PREFIX) -> bool:
    return isinstance(name, str) and name.startswith(prefix)


def apply(
    tokenizer_manager_cls: Any = None,
    *,
    root: str | None = None,
    managed_prefix: str = MANAGED_PREFIX,
    app: Any = None,
    add_state_route: bool = True,
) -> Any:
    """Patch ``tokenizer_manager_cls`` (default: SGLang's TokenizerManager) in place. Idempotent."""
    verify(root)
    if tokenizer_manager_cls is None:
        from sglang.srt.managers.tokenizer_manager import TokenizerManager as tokenizer_manager_cls
    if getattr(tokenizer_manager_cls, PATCH_MARK, False):
        return tokenizer_manager_cls

    orig_release = tokenizer_manager_cls._release_lora_once
    orig_unload_locked = tokenizer_manager_cls._unload_lora_adapter_locked
    orig_unload = tokenizer_manager_cls.unload_lora_adapter
    unload_output = orig_unload.__globals__["UnloadLoRAAdapterReqOutput"]

    def _release_lora_once(self, state):
        # Patch 1: nothing acquired (rejected before acquire) -> nothing to release.
        if not state.lora_released and getattr(state.obj, "lora_id", None) is None:
            state.lora_released = True
            return None
        return orig_release(self, state)

    async def _unload_lora_adapter_locked(self, obj):
        # Patch 2: from the moment a managed adapter starts unloading, no request can reload it.
        if is_managed(obj.lora_name, managed_prefix):
            self.lora_ref_cache.pop(obj.lora_name, None)
        return await orig_unload_locked(self, obj)

    async def unload_lora_adapter(self, obj, request=None):
        # Patch 3: a managed pinned adapter leaves only through lorapub's reclaim/cleanup.
        name = obj.lora_name
        ref = self.lora_registry.get_all_adapters().get(name)
        if is_managed(name, managed_prefix) and ref is not None and ref.pinned and name not in self.pending_lora_unloads:
            reclaim_id = request.headers.get(RECLAIM_HEADER) if request is not None else None
            if not reclaim_id:
                return unload_output(
                    success=False,
                    error_message=f"LoRA adapter '{name}' is managed by lorapub; unload refused without {RECLAIM_HEADER}",
                )
        return await orig_unload(self, obj, request)

    tokenizer_manager_cls._release_lora_once = _release_lora_once
    tokenizer_manager_cls._unload_lora_adapter_locked = _unload_lora_adapter_locked
    tokenizer_manager_cls.unload_lora_adapter = unload_lora_adapter
    tokenizer_manager_cls.lorapub_managed_prefix = managed_prefix
    setattr(tokenizer_manager_cls, PATCH_MARK, True)
    if add_state_route:
        _add_state_route(app, orig_release.__globals__)
    return tokenizer_manager_cls


def state_of(tm: Any, get_lora: Any) -> dict[str, Any]:
    registry = tm.lora_registry
    return {
        "incarnation": INCARNATION,
        "max_loaded_loras": get_lora().max_loaded_loras,
        "managed_patch": True,
        "adapters": {
            name: {
                "lora_id": ref.lora_id,
                "lora_path": ref.lora_path,
                "pinned": bool(ref.pinned),
                "refs": registry._counters[ref.lora_id].value() if ref.lora_id in registry._counters else 0,
            }
            for name, ref in registry.get_all_adapters().items()
        },
        "pending_unloads": dict(tm.pending_lora_unloads),
    }


def _add_state_route(app: Any, tm_globals: dict) -> None:
    if app is None:
        try:
            from sglang.srt.entrypoints import http_server
        except Exception:
            return  # no HTTP server in this process (tests, offline engine)
        app = http_server.app
        global_state = lambda: http_server._global_state  # noqa: E731
    else:
        global_state = lambda: app.state  # noqa: E731
    if any(getattr(r, "path", None) == "/lorapub/state" for r in app.routes):
        return

    async def lorapub_state():
        return state_of(global_state().tokenizer_manager, tm_globals["get_lora"])

    app.add_api_route("/lorapub/state", lorapub_state, methods=["GET"])
