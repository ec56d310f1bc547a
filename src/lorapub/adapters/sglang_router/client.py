"""The SGLang router's HTTP API (:class:`SGLangRouter`: worker management, and ``/generate`` sent
once), its launch command with the flags lorapub needs (:func:`router_command`), and the session
service's routing through it (:class:`RouterRouting`), as sglang-router 0.3.2 behaves.
See docs/router.md, "What the router does to a generation (0.3.2, measured)".
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Mapping
from urllib.parse import urlsplit

import aiohttp
import attrs

from lorapub.adapters.sglang_http import MISSING_MARKERS, SGLangHTTP, engine_message
from lorapub.errors import EngineError, EngineUnavailable, InvalidInput, OutcomeUnknown, VersionMissing
from lorapub.ports import RoutedSession

__all__ = [
    "ROUTER_VERSION", "REQUIRED_ROUTER_FLAGS", "router_command", "normalize_url", "engine_name", "RouterWorker",
    "SGLangRouter", "RoutedGeneration", "RouterRouting",
]

log = logging.getLogger("lorapub.router")

ROUTER_VERSION = "0.3.2"
# Flags lorapub needs on the router besides --host/--port/--worker-urls/--policy.
REQUIRED_ROUTER_FLAGS = ("--disable-retries", "--disable-circuit-breaker")
# Router error codes meaning "the worker gave no (complete) answer": the generation may have run.
_NO_ANSWER_CODES = frozenset(
    {
        "call_upstream_request_error",
        "call_upstream_body_error",
        "call_upstream_decode_error",
        "call_upstream_timeout",
        "call_upstream_request_failed",
        "call_upstream_connection_failed",
    }
)


def router_command(
    worker_urls: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    policy: str = "cache_aware",
    python: str = "python",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The router's launch command with the flags lorapub needs (see docs/router.md)."""
    return [
        python, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        *REQUIRED_ROUTER_FLAGS,
        *extra,
    ]


def normalize_url(url: str) -> str:
    return url.rstrip("/")


def engine_name(url: str) -> str:
    """A stable engine name for a worker URL: ``http://10.0.0.7:30001`` -> ``10.0.0.7-30001``."""
    parts = urlsplit(normalize_url(url))
    host = (parts.hostname or "worker").strip("[]")
    name = f"{host}-{parts.port}" if parts.port else host
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)


def _router_error(body: object) -> tuple[str | None, str]:
    """(the router's own error code or None, the message) of an error answer."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return (code if isinstance(code, str) else None), engine_message(body)
    return None, engine_message(body)


@attrs.frozen
class RouterWorker:
    """One entry of the router's ``GET /workers``."""

    id: str
    url: str
    healthy: bool
    load: int


class SGLangRouter:
    """The SGLang router's HTTP API: worker management and ``/generate``.

    Admin calls (list/add/remove) time out after ``admin_timeout``; a generation after
    ``request_timeout`` (None: never, the router's own ``--request-timeout-secs`` bounds it).
    A request with no (complete) answer is :class:`OutcomeUnknown`; nothing is resent here.
    Every request goes through :class:`~lorapub.adapters.sglang_http.SGLangHTTP`'s ``request``
    (:attr:`client`): the same session, ``api_key`` checks and typed errors as an engine's.
    """

    def __init__(
        self,
        base_url: str,
        *,
        http: aiohttp.ClientSession | None = None,
        request_timeout: float | None = None,
        admin_timeout: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        self.client = SGLangHTTP("router", normalize_url(base_url), http=http, require_patch=False, api_key=api_key)
        self.base_url = self.client.base_url
        self.request_timeout = request_timeout
        self.admin_timeout = admin_timeout

    @property
    def http(self) -> aiohttp.ClientSession:
        return self.client.http

    @property
    def current_http(self) -> aiohttp.ClientSession | None:
        return self.client.current_http

    @property
    def owns_http(self) -> bool:
        return self.client.owns_http

    async def close(self) -> None:
        await self.client.close()

    async def release(self) -> None:
        await self.client.release()

    async def request(self, method: str, path: str, *, json_body: object = None,
                      timeout: float | None) -> tuple[int, Any]:
        """``(status, body)``, as :meth:`SGLangHTTP.request <lorapub.adapters.sglang_http.SGLangHTTP.request>`
        sends it; the router takes the API key (its only key) on every route."""
        return await self.client.request(method, path, json_body=json_body, timeout=timeout, admin=False)

    # -- worker management ----------------------------------------------------------
    async def list_workers(self) -> list[RouterWorker]:
        status, body = await self.request("GET", "/workers", timeout=self.admin_timeout)
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"router GET /workers answered {status}: {_router_error(body)[1]}", status=status)
        return [
            RouterWorker(str(w["id"]), normalize_url(w["url"]), bool(w.get("is_healthy", True)), int(w.get("load") or 0))
            for w in body.get("workers", [])
        ]

    async def workers(self) -> list[str]:
        """The URLs the router routes to now."""
        return [w.url for w in await self.list_workers()]

    async def _find(self, url: str) -> RouterWorker | None:
        url = normalize_url(url)
        return next((w for w in await self.list_workers() if w.url == url), None)

    async def add_worker(self, url: str, *, timeout: float = 30.0, poll: float = 0.05) -> None:
        """Put ``url`` into rotation (``POST /workers``) and wait until the router lists it healthy.

        Idempotent: a listed worker is left as it is. The router adds in the background
        after probing the worker (``/health``, ``/server_info``, ``/model_info``); if that does
        not happen within ``timeout``, :class:`EngineError` (the router may still add it later).
        """
        url = normalize_url(url)
        found = await self._find(url)
        if found is None:
            status, body = await self.request("POST", "/workers", json_body={"url": url}, timeout=self.admin_timeout)
            if status not in (200, 201, 202):
                raise EngineError(f"router refused to add {url} ({status}): {_router_error(body)[1]}", status=status)
        deadline = time.monotonic() + timeout  # real time: how long a caller waits for the router (I/O)
        while True:
            found = await self._find(url)
            if found is not None and found.healthy:
                log.info("router: %s is in rotation", url)
                return
            if time.monotonic() >= deadline:  # the deadline above
                raise EngineError(f"router did not list {url} as a healthy worker within {timeout}s")
            await asyncio.sleep(poll)

    async def remove_worker(self, url: str, *, timeout: float = 10.0, poll: float = 0.05) -> None:
        """Take ``url`` out of rotation (``DELETE /workers/{id}``) and wait until the router no longer lists it.

        Idempotent: an unlisted worker is already out. Requests already running on it finish.
        """
        url = normalize_url(url)
        deadline = time.monotonic() + timeout  # real time: how long a caller waits for the router (I/O)
        while True:
            found = await self._find(url)
            if found is None:
                log.info("router: %s is out of rotation", url)
                return
            status, body = await self.request("DELETE", f"/workers/{found.id}", timeout=self.admin_timeout)
            if status not in (200, 202, 204, 404):
                raise EngineError(f"router refused to remove {url} ({status}): {_router_error(body)[1]}", status=status)
            if time.monotonic() >= deadline:  # the deadline above
                raise EngineError(f"router still lists {url} {timeout}s after its removal")
            await asyncio.sleep(poll)

    # -- serving ----------------------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One ``/generate`` through the router, sent once.

        200 -> the worker's answer. A worker's version error -> :class:`VersionMissing`;
        no worker gave an answer (router code ``call_upstream_*``) or no answer from the
        router -> :class:`OutcomeUnknown`; no healthy worker -> :class:`EngineUnavailable`;
        any other error answer -> :class:`EngineError` carrying the router's/worker's text.
        """
        lora_path = payload.get("lora_path")
        status, body = await self.request("POST", "/generate", json_body=dict(payload), timeout=self.request_timeout)
        if status == 200 and isinstance(body, dict):
            return body
        code, message = _router_error(body)
        if code in _NO_ANSWER_CODES:
            raise OutcomeUnknown(f"router /generate ({lora_path}): the worker gave no answer: {message}", code=code)
        if code == "no_available_workers":
            raise EngineUnavailable(f"router /generate ({lora_path}): {message}", status=status)
        if status == 400 and any(m in message for m in MISSING_MARKERS):
            raise VersionMissing(f"the routed worker does not hold {lora_path}: {message}", engine="router")
        raise EngineError(f"router /generate answered {status}: {message}", status=status, code=code)


class RoutedGeneration:
    """What :meth:`RouterRouting.pick` gives a session: ``generate`` through the router."""

    name = "router"

    def __init__(self, router: SGLangRouter) -> None:
        self.router = router

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        if not payload.get("lora_path"):
            raise InvalidInput("lorapub never sends a generation without its bound lora_path")
        return await self.router.generate(payload)


class RouterRouting:
    """The session service's routing when the SGLang router picks the worker.

    ``SessionService(..., router=RouterRouting(router))`` (or ``deployment.sessions.router =
    RouterRouting(router)``): every generation goes to the router's ``/generate`` with the
    session's exact ``lora_path``; the router's policy (``cache_aware``) picks the worker.
    """

    def __init__(self, router: SGLangRouter) -> None:
        self.router = router
        self._target = RoutedGeneration(router)

    def pick(self, session: RoutedSession, holders: frozenset[str] | None = None) -> RoutedGeneration:
        """The router picks the worker. ``holders`` (the engines that hold the session's
        version now, None: unknown) only vetoes: with no holder at all nothing is sent."""
        if holders is not None and not holders:
            binding = getattr(session, "binding", None)
            bound = binding.version if binding else "the bound version"
            raise EngineUnavailable(
                f"no engine holds {bound} right now (being re-provisioned); retry the request later",
                session=getattr(session, "key", None),
            )
        return self._target
