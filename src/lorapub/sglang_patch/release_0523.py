"""lorapub's patch for SGLang 0.5.23, runtime form (the diffs are in ``diffs/0.5.23``). 0.5.23
already releases every LoRA ref exactly once upstream; what remains: nothing acquired -> nothing
released, no implicit reload of managed adapters, managed pinned adapters unloadable only with a
reclaim id (header ``X-Lorapub-Reclaim-Id``).
See docs/sglang-patch.md, "What each patch changes and why".
"""

from __future__ import annotations

from typing import Any

from lorapub.wire.routes import RECLAIM_HEADER
from lorapub.sglang_patch.targets import is_managed


# The patched methods' ``self`` is SGLang's TokenizerManager, their arguments its request states, request
# objects and Starlette requests: SGLang's objects, Any here.
def apply(cls: Any, managed_prefix: str) -> None:
    orig_release = cls._release_lora_once
    orig_unload_locked = cls._unload_lora_adapter_locked
    orig_unload = cls.unload_lora_adapter
    unload_output = orig_unload.__globals__["UnloadLoRAAdapterReqOutput"]

    def _release_lora_once(self: Any, state: Any) -> Any:
        # Patch 1: nothing acquired (rejected before acquire) -> nothing to release.
        if not state.lora_released and getattr(state.obj, "lora_id", None) is None:
            state.lora_released = True
            return None
        return orig_release(self, state)

    async def _unload_lora_adapter_locked(self: Any, obj: Any) -> Any:
        # Patch 2: from the moment a managed adapter starts unloading, no request can reload it.
        if is_managed(obj.lora_name, managed_prefix):
            self.lora_ref_cache.pop(obj.lora_name, None)
        return await orig_unload_locked(self, obj)

    async def unload_lora_adapter(self: Any, obj: Any, request: Any = None) -> Any:
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

    cls._release_lora_once = _release_lora_once
    cls._unload_lora_adapter_locked = _unload_lora_adapter_locked
    cls.unload_lora_adapter = unload_lora_adapter


def pending_unloads(tm: Any) -> dict[str, Any]:
    return dict(tm.pending_lora_unloads)
