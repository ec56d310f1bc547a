"""SGLang's API keys as the double enforces them: each route's auth level, as SGLang marks it, and
SGLang's own rule (``decide_request_auth``: the installed SGLang's where there is one, else this
restatement, which a test checks against 0.5.17's and 0.5.23's).
See docs/embedding.md, "SGLang's keys, and which call carries which".
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any, Callable

from lorapub.testing._sglang_registry import registry_root
from lorapub.wire.routes import ROUTES, STATE_ROUTE

__all__ = ["NORMAL", "ADMIN_OPTIONAL", "ADMIN_FORCE", "ROUTE_AUTH_LEVELS", "decide_request_auth"]

NORMAL, ADMIN_OPTIONAL, ADMIN_FORCE = "normal", "admin_optional", "admin_force"

#: Each route's auth level, as SGLang's ``http_server.py`` marks it with ``@auth_level`` (unmarked:
#: NORMAL) and as lorapub's patch registers its state route (ADMIN_OPTIONAL, like the LoRA routes).
#: A test keeps this equal to SGLang's own file.
ROUTE_AUTH_LEVELS: dict[tuple[str, str], str] = {
    ("POST", "/load_lora_adapter"): ADMIN_OPTIONAL,
    ("POST", "/unload_lora_adapter"): ADMIN_OPTIONAL,
    ("POST", "/pause_generation"): ADMIN_OPTIONAL,
    ("POST", "/continue_generation"): ADMIN_OPTIONAL,
    ("POST", "/flush_cache"): ADMIN_OPTIONAL,
    ("POST", "/abort_request"): ADMIN_OPTIONAL,
    ("GET", STATE_ROUTE): ADMIN_OPTIONAL,
    ("POST", "/generate"): NORMAL,
    ("GET", "/v1/models"): NORMAL,
    ("GET", "/server_info"): NORMAL,
    ("GET", "/health"): NORMAL,
}
# lorapub's engine-side staging routes: admin-level, like SGLang's LoRA admin routes (see below).
ROUTE_AUTH_LEVELS.update({route: ADMIN_OPTIONAL for route in ROUTES})


def decide_request_auth(*, method: str, path: str, authorization_header: str | None, api_key: str | None,
                        admin_api_key: str | None, auth_level: str) -> tuple[bool, int]:
    """SGLang's rule (``srt/utils/auth.py``: ``decide_request_auth``), restated for where SGLang
    is not installed; ``(allowed, status when refused)``. A test checks it against 0.5.17's and
    0.5.23's own function for every combination."""
    import secrets

    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True, 401

    def bearer(expected: str) -> bool:
        if not authorization_header:
            return False
        parts = authorization_header.split(" ", 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return False
        return secrets.compare_digest(parts[1], expected)

    if auth_level == ADMIN_FORCE:
        if not admin_api_key:
            return False, 403
        return bearer(admin_api_key), 401
    if auth_level == ADMIN_OPTIONAL:
        if admin_api_key:
            return bearer(admin_api_key), 401
        if api_key:
            return bearer(api_key), 401
        return True, 401
    if api_key:
        return bearer(api_key), 401
    return True, 401


@functools.lru_cache(maxsize=1)
def sglang_decide() -> Callable[..., tuple[bool, int]] | None:
    """SGLang's own ``decide_request_auth`` (the installed tree's ``srt/utils/auth.py``, which
    imports nothing beyond the standard library), adapted to this module's levels; None where
    SGLang is not installed."""
    path = os.path.join(registry_root(), "srt", "utils", "auth.py")
    if not os.path.exists(path):
        return None
    name = "lorapub_sglang.auth"  # a private name: the ``sglang`` namespace is left alone
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # a .py path always has both
        raise ImportError(f"no loader for {path}")
    auth = importlib.util.module_from_spec(spec)
    sys.modules[name] = auth  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(auth)

    def decide(*, auth_level: str, **kw: Any) -> tuple[bool, int]:
        decision = auth.decide_request_auth(auth_level=auth.AuthLevel(auth_level), **kw)
        return decision.allowed, decision.error_status_code

    return decide
