"""``GET /lorapub/state``: the server's incarnation and its LoRA registry, as lorapub reads it.

Admin-level like SGLang's own LoRA admin routes: with ``--admin-api-key`` set, only callers
holding that key may read it.
"""

from __future__ import annotations

import uuid
from typing import Any

from lorapub.sglang_patch.targets import STATE_ROUTE

INCARNATION = uuid.uuid4().hex  # one per server process life


def _max_loaded_loras(tm: Any) -> Any:
    get_lora = type(tm)._resolve_lora_path.__globals__.get("get_lora")
    if get_lora is not None:  # 0.5.23 keeps LoRA settings in their own config
        return get_lora().max_loaded_loras
    return tm.server_args.max_loaded_loras


def _pending_unloads(tm: Any) -> dict:
    pending = getattr(tm, "pending_lora_unloads", None)
    if pending is None:  # 0.5.17: lorapub's backport (absent on an observed, unpatched server)
        backport = getattr(tm, "_lorapub_pending_unloads", None)
        pending = backport() if backport is not None else {}
    return dict(pending)


def state_of(tm: Any, release: str, form: str) -> dict[str, Any]:
    registry = tm.lora_registry
    return {
        "incarnation": INCARNATION,
        "sglang": release,
        "patch": form,
        "managed_patch": form != "observe",
        "max_loaded_loras": _max_loaded_loras(tm),
        "adapters": {
            name: {
                "lora_id": ref.lora_id,
                "lora_path": ref.lora_path,
                "pinned": bool(ref.pinned),
                "refs": registry._counters[ref.lora_id].value() if ref.lora_id in registry._counters else 0,
            }
            for name, ref in registry.get_all_adapters().items()
        },
        "pending_unloads": _pending_unloads(tm),
    }


def add_state_route(app: Any, release: str, form: str = "runtime") -> None:
    if app is None:
        try:
            from sglang.srt.entrypoints import http_server
        except Exception:
            return  # no HTTP server in this process (tests, offline engine)
        app = http_server.app

        def tokenizer_manager():
            return http_server._global_state.tokenizer_manager
    else:
        def tokenizer_manager():
            return app.state.tokenizer_manager
    if any(getattr(r, "path", None) == STATE_ROUTE for r in app.routes):
        return

    async def lorapub_state():
        return state_of(tokenizer_manager(), release, form)

    try:
        from sglang.srt.utils.auth import AuthLevel

        lorapub_state._auth_level = AuthLevel.ADMIN_OPTIONAL
    except Exception:
        pass  # a release without per-route auth levels
    app.add_api_route(STATE_ROUTE, lorapub_state, methods=["GET"])
