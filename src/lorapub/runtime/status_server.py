"""The read-only status endpoint a running :class:`Deployment` may serve (``status=(host, port)``):
``GET /status`` (the :class:`~lorapub.runtime.status.Status` as JSON) and ``GET /metrics`` (the
Prometheus text of a ``lorapub.adapters.prometheus.Metrics`` observer). Off by default; beyond localhost it
needs a token. See docs/operating.md, "Status".
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from lorapub.errors import LorapubError
from lorapub.runtime.status import check_bind

__all__ = ["StatusServer"]

log = logging.getLogger(__name__)


class StatusServer:
    """Serves ``status()`` and ``exposition()`` (each called per request) on ``host:port``."""

    def __init__(self, host: str, port: int, *, status: Callable[[bool], Awaitable[Any]],
                 exposition: Callable[[], tuple[bytes, str]] | None = None, token: str | None = None,
                 health: Callable[[], Any] | None = None) -> None:
        check_bind(host, token)
        self.host, self.port = host, port
        self._status, self._exposition, self._token = status, exposition, token
        self._health = health  # the last reconcile pass's report: what a failed status is answered with
        self._runner: web.AppRunner | None = None

    def _allowed(self, request: web.Request) -> bool:
        if self._token is None:
            return True
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self._token.encode())

    async def _get_status(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return web.json_response({"error": "UNAUTHORIZED: send 'Authorization: Bearer <token>'"}, status=401)
        try:
            status = await self._status(request.query.get("probe", "1") != "0")
        except LorapubError as e:  # the registry did not answer, say: what is known is answered, typed
            health = self._health() if self._health is not None else None
            return web.json_response({"error": f"{e.code}: {e.message}", "code": e.code,
                                      "health": health.describe() if health is not None else None}, status=503)
        return web.Response(text=json.dumps(status.to_json(), default=str), content_type="application/json")

    async def _get_metrics(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return web.Response(text="UNAUTHORIZED: send 'Authorization: Bearer <token>'\n", status=401)
        if self._exposition is None:
            return web.Response(text="no metrics: give the deployment a lorapub.adapters.prometheus.Metrics() observer "
                                     "(pip install 'lorapub[metrics]')\n", status=404)
        body, content_type = self._exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def start(self) -> "StatusServer":
        app = web.Application()
        app.router.add_get("/status", self._get_status)
        app.router.add_get("/metrics", self._get_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or ()  # the port the OS chose for port 0
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("status endpoint: http://%s:%d/status", self.host, self.port)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
