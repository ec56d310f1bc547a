"""``GET /lorapub/state`` and the engine-side staging routes (``POST /lorapub/stage/*``), runtime form.
The state route gives the server's incarnation, its LoRA registry as lorapub reads it, and what
the engine-side staging holds; the staging routes run :mod:`lorapub.sglang_patch.staging` in the
server process. Each is admin-level exactly like SGLang's own ``/load_lora_adapter``.
See docs/sglang-patch.md, "Engine-side staging routes (both releases)".
"""

from __future__ import annotations

import uuid
from typing import Any, Awaitable, Callable

from lorapub.sglang_patch import staging as _staging
from lorapub.sglang_patch.metrics import serve_engine_series
from lorapub.sglang_patch.staging import max_loaded_loras as _max_loaded_loras
from lorapub.sglang_patch.targets import PatchMismatch
from lorapub.wire.messages import AdapterEntry, StateReply
from lorapub.wire.routes import BEGIN_ROUTE, BUCKET_ROUTE, CLEANUP_ROUTE, END_ROUTE, PREFIX, RELEASE_ROUTE, STATE_ROUTE

INCARNATION = uuid.uuid4().hex  # one per server process life
#: The engine-side staging of this server life (set when the staging routes are added).
STAGING: _staging.EngineStaging | None = None

#: A staging route's handler: the request (Starlette's, SGLang's server) or its JSON body to (status, reply).
Handler = Callable[[Any], Awaitable[tuple[int, dict[str, Any]]]]


def _pending_unloads(tm: Any) -> dict[str, Any]:
    pending = getattr(tm, "pending_lora_unloads", None)
    if pending is None:  # 0.5.17: lorapub's backport (absent on an observed, unpatched server)
        backport = getattr(tm, "_lorapub_pending_unloads", None)
        pending = backport() if backport is not None else {}
    return dict(pending)


def adapter_entries(registry: Any) -> dict[str, AdapterEntry]:
    """SGLang's LoRA registry as the state route reports it: each name's id, path, pin and native
    request count (both forms of the patch, both releases)."""
    counters = registry._counters  # SGLang keeps its per-adapter request counts here, in both releases
    return {name: AdapterEntry(ref.lora_id, ref.lora_path, bool(ref.pinned),
                               counters[ref.lora_id].value() if ref.lora_id in counters else 0)
            for name, ref in registry.get_all_adapters().items()}


def adapter_table(registry: Any) -> dict[str, dict[str, Any]]:
    """:func:`adapter_entries` as JSON (the diff form's state route answers it)."""
    return {name: entry.to_json() for name, entry in adapter_entries(registry).items()}


def state_of(tm: Any, release: str, form: str) -> dict[str, Any]:
    managed = form != "observe"
    return StateReply(
        INCARNATION, adapter_entries(tm.lora_registry), _pending_unloads(tm), _max_loaded_loras(tm), managed,
        getattr(type(tm), "lorapub_managed_prefix", None) if managed else None,
        # its responses with a managed adapter carry a provenance stamp (docs/provenance.md)
        managed and bool(getattr(type(tm), "lorapub_stamps", False)),
        STAGING.staging_report() if STAGING is not None else None, release, form,
    ).to_json()


def _admin_level(app: Any) -> Any:
    """The auth level of SGLang's own ``/load_lora_adapter`` on ``app`` (ADMIN_OPTIONAL in 0.5.17
    and 0.5.23), so lorapub's route is exactly as protected as SGLang's LoRA admin routes."""
    try:
        from sglang.srt.utils.auth import AuthLevel
    except ImportError as e:  # both supported releases have per-route auth levels
        raise PatchMismatch(
            f"SGLang's auth levels (sglang.srt.utils.auth) are missing ({e}); lorapub's routes ({STATE_ROUTE}, "
            f"{PREFIX}/*) are not added rather than served without --admin-api-key protection"
        ) from None
    for route in getattr(app, "routes", []):
        if getattr(route, "path", None) == "/load_lora_adapter":
            level = getattr(getattr(route, "endpoint", None), "_auth_level", None)
            if isinstance(level, AuthLevel):
                return level
    return AuthLevel.ADMIN_OPTIONAL


def _server_app(app: Any) -> tuple[Any, Any]:
    """(app, a function returning its TokenizerManager); app None: SGLang's own HTTP server."""
    if app is None:
        try:
            from sglang.srt.entrypoints import http_server
        except Exception:
            return None, None  # no HTTP server in this process (tests, offline engine)
        return http_server.app, lambda: http_server._global_state.tokenizer_manager
    return app, lambda: app.state.tokenizer_manager


def add_staging_routes(app: Any = None, release: str = "", form: str = "runtime") -> _staging.EngineStaging | None:
    """Add ``POST /lorapub/stage/{begin,bucket,end,cleanup,release}`` at SGLang's LoRA admin level.
    Returns the server's :class:`~lorapub.sglang_patch.staging.EngineStaging` (None without a server)."""
    global STAGING
    own_server = app is None
    app, tokenizer_manager = _server_app(app)
    if app is None:
        return None
    if any(getattr(r, "path", None) == BEGIN_ROUTE for r in app.routes):
        return STAGING
    level = _admin_level(app)  # raises before anything is added where auth levels are missing
    from starlette.responses import JSONResponse

    staging = STAGING = _staging.for_server(tokenizer_manager, INCARNATION)
    if own_server:  # with --enable-metrics, SGLang's /metrics carries the staging's series too
        from sglang.srt.entrypoints import http_server

        http_server.add_prometheus_middleware = serve_engine_series(http_server.add_prometheus_middleware, staging)

    def route(path: str, handler: Handler) -> None:
        async def endpoint(request: Any) -> JSONResponse:  # a Starlette request: the bucket body is streamed
            status, body = await handler(request)
            return JSONResponse(body, status_code=status)

        endpoint.__name__ = "lorapub_" + path.rsplit("/", 1)[-1]
        setattr(endpoint, "_auth_level", level)  # what SGLang's @auth_level decorator sets
        from starlette.requests import Request

        endpoint.__annotations__ = {"request": Request}
        app.add_api_route(path, endpoint, methods=["POST"])

    route(BEGIN_ROUTE, lambda r: _with_json(r, staging.begin))
    route(BUCKET_ROUTE, lambda r: _staging.starlette_receive(staging, r))
    route(END_ROUTE, lambda r: _with_json(r, staging.end))
    route(CLEANUP_ROUTE, lambda r: _with_json(r, staging.cleanup))
    route(RELEASE_ROUTE, lambda r: _with_json(r, staging.release))
    return staging


async def _with_json(request: Any, handler: Handler) -> tuple[int, dict[str, Any]]:  # handler: of the JSON body
    return await handler(await _staging.starlette_json(request))


def add_state_route(app: Any, release: str, form: str = "runtime") -> None:
    if app is None:
        try:
            from sglang.srt.entrypoints import http_server
        except Exception:
            return  # no HTTP server in this process (tests, offline engine)
        app = http_server.app

        def tokenizer_manager() -> Any:
            return http_server._global_state.tokenizer_manager
    else:
        def tokenizer_manager() -> Any:
            return app.state.tokenizer_manager
    if any(getattr(r, "path", None) == STATE_ROUTE for r in app.routes):
        return

    async def lorapub_state() -> dict[str, Any]:
        return state_of(tokenizer_manager(), release, form)

    # What SGLang's @auth_level decorator does; its middleware reads it from the matched endpoint.
    setattr(lorapub_state, "_auth_level", _admin_level(app))
    app.add_api_route(STATE_ROUTE, lorapub_state, methods=["GET"])


def _http_staging_block() -> str:
    """The staging routes as the diff form adds them to ``http_server.py`` (both releases), after the
    state route: the same handlers as the runtime form, marked with SGLang's own ``@auth_level``."""
    out = [
        "# lorapub: engine-side staging of adapter versions runs in this process (lorapub/sglang_patch/staging/).\n"
        "from lorapub.sglang_patch import staging as _lorapub_staging\n\n"
        "_LORAPUB_STAGING = _lorapub_staging.for_server(\n"
        "    lambda: _global_state.tokenizer_manager, _LORAPUB_INCARNATION\n)\n\n"
        "# lorapub: with --enable-metrics, /metrics carries lorapub's engine series (lorapub/sglang_patch/metrics.py).\n"
        "from lorapub.sglang_patch.metrics import serve_engine_series as _lorapub_serve_engine_series\n\n"
        "add_prometheus_middleware = _lorapub_serve_engine_series(\n"
        "    add_prometheus_middleware, _LORAPUB_STAGING\n)\n\n\n"
    ]
    for path in (BEGIN_ROUTE, BUCKET_ROUTE, END_ROUTE,
                 CLEANUP_ROUTE, RELEASE_ROUTE):
        verb = path.rsplit("/", 1)[-1]
        if verb == "bucket":
            call = "await _lorapub_staging.starlette_receive(_LORAPUB_STAGING, request)"
        else:
            call = (f"await _LORAPUB_STAGING.{verb}(\n"
                    "        await _lorapub_staging.starlette_json(request)\n    )")
        out.append(
            f'@app.post("{path}")\n'
            "@auth_level(AuthLevel.ADMIN_OPTIONAL)\n"
            f"async def lorapub_stage_{verb}(request: Request):\n"
            f"    status, body = {call}\n"
            "    return ORJSONResponse(body, status_code=status)\n\n\n"
        )
    return "".join(out)


HTTP_STAGING_BLOCK = _http_staging_block()
