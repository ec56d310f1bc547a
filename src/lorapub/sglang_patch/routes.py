"""``GET /lorapub/state``: the server's incarnation and its LoRA registry, as lorapub reads it.

Admin-level exactly like SGLang's own LoRA admin routes (``/load_lora_adapter``: ADMIN_OPTIONAL
in 0.5.17 and 0.5.23): with ``--admin-api-key`` set only that key reads it, with ``--api-key``
alone that key, with neither anyone (SGLang's ``decide_request_auth``). The diff form marks it
with SGLang's ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` in both releases.
"""

from __future__ import annotations

import uuid
from typing import Any

from lorapub.sglang_patch.targets import STATE_ROUTE, PatchMismatch

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


def _admin_level(app: Any) -> Any:
    """The auth level of SGLang's own ``/load_lora_adapter`` on ``app`` (ADMIN_OPTIONAL in 0.5.17
    and 0.5.23), so lorapub's route is exactly as protected as SGLang's LoRA admin routes."""
    try:
        from sglang.srt.utils.auth import AuthLevel
    except ImportError as e:  # both supported releases have per-route auth levels
        raise PatchMismatch(
            f"SGLang's auth levels (sglang.srt.utils.auth) are missing ({e}); {STATE_ROUTE} is not "
            "added rather than served without --admin-api-key protection"
        ) from None
    for route in getattr(app, "routes", []):
        if getattr(route, "path", None) == "/load_lora_adapter":
            level = getattr(getattr(route, "endpoint", None), "_auth_level", None)
            if isinstance(level, AuthLevel):
                return level
    return AuthLevel.ADMIN_OPTIONAL


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

    # What SGLang's @auth_level decorator does; its middleware reads it from the matched endpoint.
    lorapub_state._auth_level = _admin_level(app)
    app.add_api_route(STATE_ROUTE, lorapub_state, methods=["GET"])
