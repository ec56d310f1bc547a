"""SGLang over its HTTP API (aiohttp): HTTP only. :class:`SGLangHTTP` is the client both SGLang
adapters (:mod:`.sglang_wire`, :mod:`.sglang_overwrite`) and the router's client
(:mod:`.sglang_router`) send through: the keys, the JSON checks, a lost reply as OutcomeUnknown
and a refusal as EngineError.
See docs/embedding.md, "SGLang's keys, and which call carries which".
"""

from __future__ import annotations

import asyncio
import http as _http
import json
import logging
import math
import re
from typing import Any, Mapping, NotRequired, TypedDict, cast
from urllib.parse import urlsplit

import aiohttp

from lorapub.core.identity import check_id
from lorapub.errors import EngineClosed, EngineError, InvalidInput, OutcomeUnknown, VersionMissing
from lorapub.wire.codec import json_or_text
from lorapub.wire.messages import StateReply
from lorapub.wire.refusal import Refused
from lorapub.wire.routes import STATE_ROUTE

__all__ = [
    "SERVER_KEEP_ALIVE_S", "IDLE_CONNECTION_S", "MAX_ENGINE_TEXT", "ClientOptions", "OwnedHTTPSession", "SGLangHTTP",
]

logger = logging.getLogger(__name__)
#: SGLang's HTTP server closes a connection idle this long (its SGLANG_TIMEOUT_KEEP_ALIVE default).
SERVER_KEEP_ALIVE_S = 5.0
#: How long an idle connection of an adapter's own session stays open: well below the server's.
IDLE_CONNECTION_S = 2.0

MISSING_MARKERS = ("not loaded", "never been loaded", "implicit reload refused", "does not exist",
                    "Failed to implicitly load")  # the last: live SGLang when a reload finds its files gone
#: Engine text kept in an error message; a traceback or an HTML page is cut here.
MAX_ENGINE_TEXT = 500


def _clip(text: str, limit: int = MAX_ENGINE_TEXT) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def engine_message(body: object) -> str:
    """The engine's own words: SGLang answers ``{"error": {"message": …}}``, ``{"error": "…"}``
    (its auth middleware), ``{"message": …}`` (OpenAI routes), ``{"error_message": …}`` (LoRA
    admin), ``{"detail": …}`` (request validation), or plain text (``/flush_cache``)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _clip(str(err["message"]))
        if isinstance(err, str) and err:
            return _clip(err)
        for key in ("message", "error_message", "detail"):
            value = body.get(key)
            if value:
                return _clip(value if isinstance(value, str) else json.dumps(value, default=str))
        return _clip(json.dumps(body, default=str))
    if isinstance(body, str):
        return _clip(body)
    return "" if body is None else _clip(json.dumps(body, default=str))


def _status_text(status: int, body: object) -> str:
    said = engine_message(body)
    if said:
        return f"{status}: {said}"
    try:
        phrase = _http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "(unknown status)"
    return f"{status} {phrase} (empty body)"


def _check_key(kind: str, key: object) -> str | None:
    if key is None:
        return None
    # SGLang compares keys with secrets.compare_digest, which refuses non-ASCII strings, and HTTP
    # strips a header value's outer blanks: such a key could never match.
    if not isinstance(key, str) or not key or key != key.strip() or not all(" " <= c <= "~" for c in key):
        raise InvalidInput(f"{kind} must be a non-empty string of printable ASCII without outer blanks")
    return key


def _check_timeout(kind: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidInput(f"{kind} must be a positive number of seconds or None, got {value!r}")
    return float(value)


def _check_url(base_url: object) -> str:
    if not isinstance(base_url, str):
        raise InvalidInput(f"base_url must be a string like http://host:port, got {type(base_url).__name__}")
    try:
        parts = urlsplit(base_url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise InvalidInput(f"base_url {base_url!r} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise InvalidInput(f"base_url must be http(s)://host[:port][/prefix], got {base_url!r}")
    return base_url.rstrip("/")


def _json_text(body: object, what: str) -> str:
    try:
        return json.dumps(body, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{what} is not JSON ({e}); nothing was sent") from None


class ClientOptions(TypedDict, total=False):
    """The options of :class:`SGLangHTTP` an engine adapter passes on to its client."""

    http: aiohttp.ClientSession | None
    request_timeout: float | None
    probe_timeout: float | None
    require_patch: bool
    api_key: str | None
    admin_api_key: str | None


class EngineState(TypedDict):
    """The state route's answer (lorapub's SGLang patch: ``lorapub.sglang_patch.routes.state_of``), as
    :meth:`SGLangHTTP.state` checks it: ``incarnation`` always; the rest as the patch's release sends it.
    Each adapter's entry and the staging report are the engine's JSON, read field by field."""

    incarnation: str
    adapters: NotRequired[dict[str, dict[str, Any]]]
    pending_unloads: NotRequired[dict[str, Any]]
    max_loaded_loras: NotRequired[int | None]
    managed_patch: NotRequired[bool]
    managed_prefix: NotRequired[str | None]
    stamps: NotRequired[bool]
    staging: NotRequired[dict[str, Any] | None]
    sglang: NotRequired[str]
    patch: NotRequired[str]


class OwnedHTTPSession:
    """An aiohttp session given by the caller (never closed here) or made lazily and owned."""

    _http: aiohttp.ClientSession | None
    _own_http: bool
    _closed: bool = False

    def _use_http(self, http: aiohttp.ClientSession | None) -> None:
        self._http = http
        self._own_http = http is None
        connector = getattr(http, "connector", None)
        if connector is None:
            return
        limit = getattr(connector, "limit", 0) or getattr(connector, "limit_per_host", 0)
        if limit:
            logger.warning(
                "%s: the aiohttp session it was given holds at most %d connections; generations and admin calls "
                "share them, so with more generations in flight an admin call waits for one to end (and the old "
                "path's pause can wait forever). Give it a session with aiohttp.TCPConnector(limit=0), or none.",
                type(self).__name__, limit)
        idle = getattr(connector, "_keepalive_timeout", None)  # aiohttp's own attribute (default 15 s)
        if not isinstance(idle, (int, float)) or idle >= SERVER_KEEP_ALIVE_S:
            logger.warning(
                "%s: the aiohttp session it was given keeps idle connections %s s; SGLang's server closes them "
                "after %g s, and a request sent on one it is closing gets no answer (an unknown outcome). "
                "Give it a session with aiohttp.TCPConnector(keepalive_timeout=%g), or none.",
                type(self).__name__, idle, SERVER_KEEP_ALIVE_S, IDLE_CONNECTION_S)

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EngineClosed(f"{self!r} was closed; nothing was sent")
        if self._http is None or self._http.closed:
            # No connection cap (aiohttp's default is 100): a rollout keeps hundreds of generations open
            # on one engine, and an admin call must never queue behind them. Idle connections close
            # before the server closes them (SGLang's uvicorn after 5 s, SGLANG_TIMEOUT_KEEP_ALIVE):
            # a request sent on a connection the server is closing gets no answer, an unknown outcome.
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S))
            self._own_http = True  # made here (also after a caller closed theirs): closed here
        return self._http

    @property
    def current_http(self) -> aiohttp.ClientSession | None:
        """The aiohttp session in use now, if any (reading it never makes one, unlike :attr:`http`)."""
        return self._http

    @property
    def owns_http(self) -> bool:
        """Whether the session is lorapub's own (False: the caller's, with the caller's settings)."""
        return self._own_http

    async def close(self) -> None:
        self._closed = True
        if self._own_http and self._http is not None:
            await self._http.close()

    async def release(self) -> None:
        """Close the connections of lorapub's own session but stay usable (the next call opens a new
        session): what a refused ``Deployment.start()`` does, so that a retry of it leaks nothing."""
        if self._own_http and self._http is not None and not self._http.closed:
            await self._http.close()


class SGLangHTTP(OwnedHTTPSession):
    """One SGLang server's HTTP API. A request with no (complete) answer is :class:`OutcomeUnknown`.

    A generation is sent once: a timeout or a dropped connection is :class:`OutcomeUnknown` and is
    never resent here. An engine's definite answer other than success is :class:`EngineError`
    carrying the engine's own words (clipped to :data:`MAX_ENGINE_TEXT` characters); so is a 200
    whose body is not the JSON a route answers.

    ``api_key`` and ``admin_api_key`` are the server's ``--api-key`` and ``--admin-api-key``.
    They are sent as ``Authorization: Bearer <key>`` following SGLang's own rules: generation
    and ``/v1/models`` (its NORMAL routes) with the API key; the admin routes (load, unload,
    pause, continue, flush, lorapub's state route: ADMIN_OPTIONAL) with the admin key, or with
    the API key when no admin key is given (a server launched with ``--api-key`` alone accepts
    that key there). Keys never appear in ``repr``, messages or logs.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        http: aiohttp.ClientSession | None = None,
        request_timeout: float | None = None,
        probe_timeout: float | None = 30.0,
        require_patch: bool = True,
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        self.name = check_id("engine name", name)
        self.base_url = _check_url(base_url)
        if http is not None and not isinstance(http, aiohttp.ClientSession):
            raise InvalidInput(f"http must be an aiohttp.ClientSession or None, got {type(http).__name__}")
        self._use_http(http)
        self.request_timeout = _check_timeout("request_timeout", request_timeout)
        self.probe_timeout = _check_timeout("probe_timeout", probe_timeout)
        self.require_patch = bool(require_patch)
        self._api_key = _check_key("api_key", api_key)
        self._admin_api_key = _check_key("admin_api_key", admin_api_key)

    def __repr__(self) -> str:
        keys = [k for k, v in (("api_key", self._api_key), ("admin_api_key", self._admin_api_key)) if v]
        return f"{type(self).__name__}({self.name!r}, {self.base_url!r}, keys={'+'.join(keys) or 'none'})"

    def _authorization(self, admin: bool) -> dict[str, str]:
        key = (self._admin_api_key or self._api_key) if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def request(
        self, method: str, path: str, *, json_body: object = None, headers: Mapping[str, str] | None = None,
        timeout: float | None = None, admin: bool = True,
    ) -> tuple[int, Any]:
        """``(status, body)``: the body parsed as JSON, or its text when it is not JSON.

        ``admin`` picks the key (see the class); a body that is not JSON is refused before sending.
        """
        data = None if json_body is None else _json_text(json_body, f"the body for {path}")
        sent = {**(headers or {}), **self._authorization(admin)}
        if data is not None:
            sent["Content-Type"] = "application/json"
        try:
            t = aiohttp.ClientTimeout(total=timeout)
            async with self.http.request(method, self.base_url + path, data=data, headers=sent, timeout=t) as r:
                text = (await r.read()).decode("utf-8", errors="replace")
                return r.status, json_or_text(text)
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:  # no (complete) answer: it may have run
            hint = ("; is the engine running, and does this address reach it?"
                    if isinstance(e, aiohttp.ClientConnectorError) else "")
            raise OutcomeUnknown(f"{self.name} {path}: no answer from {self.base_url} ({type(e).__name__}){hint}",
                                 engine=self.name, url=self.base_url) from None

    def refusal(self, path: str, status: int, body: object) -> EngineError:
        """The definite "no" of an engine, with its own words (clipped)."""
        return EngineError(f"{self.name} {path} answered {_status_text(status, body)}", engine=self.name, status=status)

    def json_object(self, path: str, status: int, body: object) -> dict[str, Any]:
        """``body`` when it is a JSON object; a 200 with anything else is a definite :class:`EngineError`."""
        if isinstance(body, dict):
            return body
        what = "an empty body" if body is None else (
            f"a non-JSON body {_clip(body, 200)!r}" if isinstance(body, str) else f"JSON {type(body).__name__}"
        )
        raise EngineError(
            f"{self.name} {path} answered {status} with {what} where a JSON object was expected",
            engine=self.name, status=status,
        )

    async def state(self) -> EngineState:
        """The state route of lorapub's SGLang patch: incarnation, adapters, refs, pending unloads."""
        return cast(EngineState, (await self._state())[1])  # decoded (checked) by StateReply

    async def state_reply(self) -> StateReply:
        """The state route's answer as its typed value (:class:`~lorapub.wire.messages.StateReply`)."""
        return (await self._state())[0]

    async def _state(self) -> tuple[StateReply, dict[str, Any]]:
        status, body = await self.request("GET", STATE_ROUTE, timeout=self.probe_timeout)
        if status == 404 and self.require_patch:
            raise EngineError(f"{self.name} lacks lorapub's SGLang patch ({STATE_ROUTE} is missing)", engine=self.name)
        if status != 200:
            raise self.refusal(STATE_ROUTE, status, body)
        body = self.json_object(STATE_ROUTE, status, body)
        try:
            reply = StateReply.from_json(body)
        except Refused as e:
            raise EngineError(f"{self.name} {STATE_ROUTE} answered a malformed state ({e.message}): {engine_message(body)}",
                              engine=self.name) from None
        if self.require_patch and not reply.managed_patch:
            raise EngineError(f"{self.name} runs without lorapub's managed-adapter patch (implicit reload possible)")
        return reply, body

    async def admin(self, path: str, body: Mapping[str, Any] | None = None, *, expect_json: bool = True) -> Any:
        """POST an admin route with the admin key; anything but 200 is a definite :class:`EngineError`,
        and so is a 200 that is not the JSON object the route answers (unless ``expect_json=False``)."""
        status, reply = await self.request("POST", path, json_body=dict(body or {}), timeout=self.probe_timeout)
        if status != 200:
            raise self.refusal(path, status, reply)
        if not expect_json:
            return reply
        reply = self.json_object(path, status, reply)
        if reply.get("success") is False:
            raise self.refusal(path, status, reply)
        return reply

    async def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models`` (stock SGLang, API key): the base model and every loaded LoRA adapter."""
        status, body = await self.request("GET", "/v1/models", timeout=self.probe_timeout, admin=False)
        if status != 200:
            raise self.refusal("/v1/models", status, body)
        cards = self.json_object("/v1/models", status, body).get("data")
        if not isinstance(cards, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in cards):
            raise EngineError(f"{self.name} /v1/models answered no model list: {engine_message(body)}", engine=self.name)
        return cards

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One ``/generate`` with the API key, sent once; a missing adapter is :class:`VersionMissing`."""
        if not isinstance(payload, Mapping):
            raise InvalidInput(f"a generation payload is a mapping, got {type(payload).__name__}")
        try:
            status, body = await self.request(
                "POST", "/generate", json_body=dict(payload), timeout=self.request_timeout, admin=False
            )
        except OutcomeUnknown as e:
            raise OutcomeUnknown(f"{e.message}: the request may or may not have run there; lorapub never sends it "
                                 "twice on its own: send the turn again only where running it twice is harmless to "
                                 "your rollout (the session keeps its version)") from None
        if status == 200:
            return self.json_object("/generate", status, body)
        message = engine_message(body)
        if status == 400 and any(m in message for m in MISSING_MARKERS):
            raise VersionMissing(f"{self.name} does not hold {payload.get('lora_path')}: {message}", engine=self.name)
        refused = self.refusal("/generate", status, body)
        raise EngineError(f"{refused.message}; the engine refused the request, so it did not run: send the turn again "
                          "(the session keeps its version), or look at that engine if it keeps refusing",
                          engine=self.name, status=status)


def __getattr__(name: str) -> object:
    if name == "SGLangOverwriteAdmin":  # moved to its own module; this path keeps working
        import warnings

        from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin

        warnings.warn("lorapub.adapters.sglang_http.SGLangOverwriteAdmin moved: import it from "
                      "lorapub.adapters.sglang_overwrite", DeprecationWarning, stacklevel=2)
        return SGLangOverwriteAdmin
    if name == "SGLangAdminBase":  # merged into its one child
        raise ImportError(
            "SGLangAdminBase was merged into its one subclass: use lorapub.adapters.sglang_wire.SGLangWireEngine "
            "(lorapub's one engine adapter of a patched SGLang server: the state route, the exact-version probe, "
            "the reclaim-authorised unload and generation are its own methods now)",
            name=name,
        )
    if name == "SGLangEngine":  # retired: the publisher-side stash it staged in is gone
        raise ImportError(
            "SGLangEngine was retired (its staging ran in the publisher, in a stash_dir the engine had to read): "
            "use lorapub.adapters.sglang_wire.SGLangWireEngine(name, url), which stages inside the engine, and "
            "name how buckets travel once on the deployment: Deployment(engines, transport=HTTPBytes() | "
            "SameHostIPC() | SharedDir(path) | TorchDistributed(...)) (docs/design.md, \"Publication on an engine\")",
            name=name,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
