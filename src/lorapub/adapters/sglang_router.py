"""lorapub behind the SGLang router (``sglang-router``, the SGLang Model Gateway), as Relax and Miles deploy it.

What goes where:

* **generations** go through the router: :class:`RouterRouting` is the session service's
  routing object; ``pick(session)`` gives a :class:`RoutedGeneration` whose ``generate``
  POSTs the router's ``/generate`` once, with the session's exact bound ``lora_path``;
* **publication, cleanup and reclaim** go to every worker directly, by its URL: one
  :class:`~lorapub.adapters.sglang_wire.SGLangWireEngine` per worker the router lists
  (:meth:`WorkerWatcher.discover`), staging inside the worker; the deployment's transport
  (``Deployment(engines, transport=...)``) says how the bytes get there;
* **rotation**: :class:`WorkerWatcher` polls the router's worker list and each worker's
  incarnation (the state route of lorapub's SGLang patch) and reports joins, leaves and
  restarts as typed events. A restarted, new or unreachable worker is taken out of the
  router (``remove_worker``), re-provisioned by an injected ``heal(name)`` and only then
  put back (``add_worker``); a failed heal keeps it out and is retried with backoff.

The router must run with ``--disable-retries`` (by default it resends a generation that
got a 5xx to another worker) and ``--disable-circuit-breaker`` (by default ten 4xx answers,
e.g. a session's version error, take a healthy worker out of rotation for a minute); see
:data:`REQUIRED_ROUTER_FLAGS` and docs/router.md.

Router facts this module relies on (sglang-router 0.3.2): ``GET /workers`` lists
``{"workers": [{"id", "url", "is_healthy", "load", ...}], "total", "stats"}``;
``POST /workers {"url": ...}`` and ``DELETE /workers/{id}`` answer 202 and act in the
background (``id`` is a UUID, never the URL); the router re-serialises a ``/generate``
body (known fields only, ``lora_path`` unchanged) and passes a worker's answer through
with its status; its own failures are ``{"error": {"type", "code", "message"}}`` with
``code`` ``call_upstream_request_error`` when the worker gave no answer (refused,
dropped mid-request or timed out: it cannot tell which) and ``no_available_workers``
(503) when no worker is healthy.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import urlsplit

import aiohttp
import attrs

from lorapub.adapters.sglang_http import _MISSING_MARKERS, OwnedHTTPSession, _message
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.errors import EngineError, EngineUnavailable, InvalidInput, OutcomeUnknown, VersionMissing

__all__ = [
    "ROUTER_VERSION", "REQUIRED_ROUTER_FLAGS", "router_command", "normalize_url", "engine_name", "RouterWorker",
    "SGLangRouter", "RoutedGeneration", "RouterRouting", "WorkerJoined", "WorkerLeft", "WorkerRestarted",
    "WorkerUnreachable", "WorkerQuarantined", "WorkerHealed", "HealFailed", "WorkerReadmitted", "WorkerEvent",
    "WorkerStatus", "Heal", "reconcile_heal", "WorkerWatcher",
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


def _router_error(body: Any) -> tuple[str | None, str]:
    """(the router's own error code or None, the message) of an error answer."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return (code if isinstance(code, str) else None), _message(body)
    return None, _message(body)


@attrs.frozen
class RouterWorker:
    """One entry of the router's ``GET /workers``."""

    id: str
    url: str
    healthy: bool
    load: int


class SGLangRouter(OwnedHTTPSession):
    """The SGLang router's HTTP API: worker management and ``/generate``.

    Admin calls (list/add/remove) time out after ``admin_timeout``; a generation after
    ``request_timeout`` (None: never, the router's own ``--request-timeout-secs`` bounds it).
    A request with no (complete) answer is :class:`OutcomeUnknown`; nothing is resent here.
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
        self.base_url = normalize_url(base_url)
        self._use_http(http)
        self.request_timeout = request_timeout
        self.admin_timeout = admin_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def request(self, method: str, path: str, *, json_body=None, timeout: float | None) -> tuple[int, Any]:
        try:
            t = aiohttp.ClientTimeout(total=timeout)
            async with self.http.request(
                method, self.base_url + path, json=json_body, headers=self._headers, timeout=t
            ) as r:
                text = await r.text()
                try:
                    body = json.loads(text) if text else None
                except ValueError:
                    body = text
                return r.status, body
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:  # no (complete) answer: it may have run
            raise OutcomeUnknown(f"router {method} {path}: no answer ({type(e).__name__})") from None

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
        deadline = time.monotonic() + timeout
        while True:
            found = await self._find(url)
            if found is not None and found.healthy:
                log.info("router: %s is in rotation", url)
                return
            if time.monotonic() >= deadline:
                raise EngineError(f"router did not list {url} as a healthy worker within {timeout}s")
            await asyncio.sleep(poll)

    async def remove_worker(self, url: str, *, timeout: float = 10.0, poll: float = 0.05) -> None:
        """Take ``url`` out of rotation (``DELETE /workers/{id}``) and wait until the router no longer lists it.

        Idempotent: an unlisted worker is already out. Requests already running on it finish.
        """
        url = normalize_url(url)
        deadline = time.monotonic() + timeout
        while True:
            found = await self._find(url)
            if found is None:
                log.info("router: %s is out of rotation", url)
                return
            status, body = await self.request("DELETE", f"/workers/{found.id}", timeout=self.admin_timeout)
            if status not in (200, 202, 204, 404):
                raise EngineError(f"router refused to remove {url} ({status}): {_router_error(body)[1]}", status=status)
            if time.monotonic() >= deadline:
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
        if status == 400 and any(m in message for m in _MISSING_MARKERS):
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

    def pick(self, session: Any, holders: frozenset[str] | None = None) -> RoutedGeneration:
        """The router picks the worker. ``holders`` (the engines that hold the session's
        version now, None: unknown) only vetoes: with no holder at all nothing is sent."""
        if holders is not None and not holders:
            bound = session.binding.version if getattr(session, "binding", None) else "the bound version"
            raise EngineUnavailable(
                f"no engine holds {bound} right now (being re-provisioned); retry the request later",
                session=getattr(session, "key", None),
            )
        return self._target


# -- watching the router's workers --------------------------------------------------------
@attrs.frozen
class WorkerJoined:
    """A URL appeared in the router's list (``initial``: it was there when watching began)."""

    name: str
    url: str
    incarnation: str | None
    initial: bool


@attrs.frozen
class WorkerLeft:
    """A URL the watcher did not remove vanished from the router's list."""

    name: str
    url: str


@attrs.frozen
class WorkerRestarted:
    name: str
    url: str
    old_incarnation: str
    new_incarnation: str


@attrs.frozen
class WorkerUnreachable:
    """The worker's state route failed ``probe_failures`` times in a row."""

    name: str
    url: str
    error: str


@attrs.frozen
class WorkerQuarantined:
    """Taken out of the router until it is healed (``reason``: restarted, joined, unreachable)."""

    name: str
    url: str
    reason: str


@attrs.frozen
class WorkerHealed:
    name: str
    url: str
    incarnation: str


@attrs.frozen
class HealFailed:
    """One handshake attempt failed; the worker stays out and is retried after ``retry_in`` s."""

    name: str
    url: str
    error: str
    attempt: int
    retry_in: float


@attrs.frozen
class WorkerReadmitted:
    """Healed and back in the router's rotation."""

    name: str
    url: str
    incarnation: str


WorkerEvent = (
    WorkerJoined | WorkerLeft | WorkerRestarted | WorkerUnreachable | WorkerQuarantined | WorkerHealed
    | HealFailed | WorkerReadmitted
)


@attrs.define
class WorkerStatus:
    """What the watcher knows of one worker.

    ``state``: ``serving`` (in rotation, incarnation known), ``quarantined`` (out of the
    router, the handshake is running or waiting to retry), ``left`` (gone from the router
    by someone else's hand).
    """

    name: str
    url: str
    incarnation: str | None = None
    state: str = "serving"
    heal_attempts: int = 0
    last_error: str | None = None
    probe_failures: int = 0


Heal = Callable[[str], Awaitable[Any]]


def reconcile_heal(deployment: Any) -> Heal:
    """``heal(name)`` for a :class:`~lorapub.Deployment`: the deployment's own re-provisioning.

    One reconciliation pass (``deployment.reconcile()``) registers the worker's current
    incarnation with the registry (its old life's READYs, stashes and holdings are void)
    and loads, pinned and directly on the worker, every version sessions may still use
    from the frozen copy this process keeps. The heal succeeds only if the worker is then
    routable (holds every such version); otherwise :class:`EngineUnavailable` with the
    deployment's health report, and the watcher keeps the worker out and retries.
    """

    async def heal(name: str) -> None:
        health = await deployment.reconcile()
        fleet = health.fleet
        if fleet is None or name not in fleet.engines or name not in fleet.routable:
            lost = sorted(str(key) for engine, key in (fleet.missing if fleet else ()) if engine == name)
            raise EngineUnavailable(
                f"{name} does not hold every version sessions may use yet (missing: {', '.join(lost) or '-'}; "
                f"health: {health.describe()})",
                engine=name,
            )

    return heal


class WorkerWatcher:
    """Watches the router's workers; runs the re-provisioning handshake.

    ``heal(name)`` must leave the worker holding every version sessions still need (the
    deployment's re-provisioning); it is awaited with the worker out of rotation. The
    handshake, per worker, one at a time: ``remove_worker(url)`` -> wait until the worker
    answers -> ``await heal(name)`` -> the incarnation must not have changed meanwhile ->
    ``add_worker(url)``. Any failure: :class:`HealFailed`, the worker stays out, retried
    after ``backoff * 2**(attempt-1)`` s (at most ``max_backoff``).

    Build with :meth:`discover` (the first listing: engines for the deployment, no
    handshake for workers already serving), then :meth:`start` the polling loop, or drive
    :meth:`poll_once` yourself.
    """

    def __init__(
        self,
        router: SGLangRouter,
        *,
        heal: Heal | None = None,
        on_event: Callable[[WorkerEvent], Any] | None = None,
        names: Mapping[str, str] | None = None,
        interval: float = 1.0,
        probe_failures: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        engine_factory: Callable[[str, str], SGLangWireEngine] | None = None,
        probe_timeout: float = 5.0,
        request_timeout: float | None = None,
    ) -> None:
        self.router = router
        self.heal = heal
        self.on_event = on_event
        self.names = {normalize_url(u): n for u, n in (names or {}).items()}
        self.interval = interval
        self.probe_failures = probe_failures
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._factory = engine_factory or self._default_factory(probe_timeout, request_timeout)
        self.engines: dict[str, SGLangWireEngine] = {}  # name -> engine, every worker ever seen
        self.workers: dict[str, WorkerStatus] = {}  # url -> status
        self.events: list[WorkerEvent] = []
        self._handshakes: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._discovered = False
        self.last_error: str | None = None  # the last failure to list the router's workers

    @staticmethod
    def _default_factory(probe_timeout: float, request_timeout: float | None):
        # the bytes' way is the deployment's transport, which it hands to these engines
        return lambda name, url: SGLangWireEngine(name, url, probe_timeout=probe_timeout, request_timeout=request_timeout)

    # -- names and engines ------------------------------------------------------------
    def name_of(self, url: str) -> str:
        url = normalize_url(url)
        return self.names.get(url) or engine_name(url)

    def engine(self, url: str) -> SGLangWireEngine:
        url = normalize_url(url)
        name = self.name_of(url)
        found = self.engines.get(name)
        if found is None:
            found = self.engines[name] = self._factory(name, url)
        return found

    def status(self) -> dict[str, WorkerStatus]:
        """name -> :class:`WorkerStatus` (copies)."""
        return {s.name: attrs.evolve(s) for s in self.workers.values()}

    def in_rotation(self) -> list[str]:
        """Names of the workers the watcher believes serve now."""
        return [s.name for s in self.workers.values() if s.state == "serving"]

    # -- events -----------------------------------------------------------------------
    async def _emit(self, event: WorkerEvent) -> None:
        self.events.append(event)
        log.info("router worker event: %s", event)
        if self.on_event is None:
            return
        try:
            result = self.on_event(event)
            if inspect.isawaitable(result):
                await result
        except Exception:  # a broken callback never stops the watcher
            log.exception("worker event callback failed on %s", event)

    # -- polling ----------------------------------------------------------------------
    async def discover(self) -> dict[str, SGLangWireEngine]:
        """The first listing: an engine per worker and its incarnation, no handshake. Returns ``engines``."""
        if not self._discovered:
            await self.poll_once()
        return self.engines

    async def start(self) -> "WorkerWatcher":
        await self.discover()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("router worker poll failed")

    async def poll_once(self) -> None:
        """One look at the router's list and at every serving worker's incarnation."""
        initial = not self._discovered
        try:
            listed = set(await self.router.workers())
        except (EngineError, OutcomeUnknown) as e:
            self.last_error = e.message
            log.warning("cannot list the router's workers: %s", e.message)
            if initial:
                raise
            return
        self.last_error = None
        self._discovered = True
        # Decided on this one listing, before any await: a handshake that re-adds a worker
        # meanwhile must not read as a leave, nor our own removal as one.
        joined = [u for u in sorted(listed) if u not in self.workers or self.workers[u].state == "left"]
        left = [s for u, s in self.workers.items() if s.state == "serving" and u not in listed]
        for status in left:
            status.state = "left"
        for url in joined:
            await self._joined(url, initial)
        for status in left:
            await self._emit(WorkerLeft(status.name, status.url))
        serving = [s for s in self.workers.values() if s.state == "serving" and s.url in listed]
        await asyncio.gather(*(self._probe(s) for s in serving))

    async def _joined(self, url: str, initial: bool) -> None:
        engine = self.engine(url)
        status = self.workers.get(url)
        if status is None:
            status = self.workers[url] = WorkerStatus(engine.name, url)
        status.state = "serving"
        try:
            incarnation: str | None = await engine.incarnation()
        except (EngineError, OutcomeUnknown) as e:
            incarnation, status.last_error = None, e.message
        await self._emit(WorkerJoined(status.name, url, incarnation, initial))
        status.incarnation = incarnation
        if not initial:  # in rotation before anyone made sure it holds the versions sessions need
            await self._quarantine(status, "joined")
        elif incarnation is None:
            await self._emit(WorkerUnreachable(status.name, url, status.last_error or "no answer"))
            await self._quarantine(status, "unreachable")

    async def _probe(self, status: WorkerStatus) -> None:
        if status.url in self._handshakes:
            return
        try:
            incarnation = await self.engine(status.url).incarnation()
        except (EngineError, OutcomeUnknown) as e:
            status.probe_failures += 1
            status.last_error = e.message
            if status.probe_failures >= self.probe_failures:
                await self._emit(WorkerUnreachable(status.name, status.url, e.message))
                await self._quarantine(status, "unreachable")
            return
        status.probe_failures = 0
        if status.incarnation is not None and incarnation != status.incarnation:
            await self._emit(WorkerRestarted(status.name, status.url, status.incarnation, incarnation))
            status.incarnation = incarnation
            await self._quarantine(status, "restarted")
        else:
            status.incarnation = incarnation

    # -- the handshake ------------------------------------------------------------------
    async def _quarantine(self, status: WorkerStatus, reason: str) -> None:
        status.state = "quarantined"
        status.heal_attempts = 0
        if status.url not in self._handshakes:
            task = asyncio.get_running_loop().create_task(self._handshake(status, reason))
            self._handshakes[status.url] = task
            task.add_done_callback(lambda _t, url=status.url: self._handshakes.pop(url, None))

    async def admit(self, url: str) -> None:
        """Bring a new worker in the safe way: heal it first, then add it to the router."""
        url = normalize_url(url)
        status = self.workers.get(url)
        if status is None:
            status = self.workers[url] = WorkerStatus(self.engine(url).name, url, state="quarantined")
        await self._quarantine(status, "admitted")
        task = self._handshakes.get(url)
        if task is not None:
            await asyncio.shield(task)

    async def _handshake(self, status: WorkerStatus, reason: str) -> None:
        engine = self.engine(status.url)
        attempt = 0
        await self._emit(WorkerQuarantined(status.name, status.url, reason))
        while True:
            attempt += 1
            status.heal_attempts = attempt
            try:
                await self.router.remove_worker(status.url)
                incarnation = await engine.incarnation()
                if self.heal is None:
                    raise InvalidInput("no heal callable: a worker cannot be re-provisioned")
                await self.heal(status.name)
                after = await engine.incarnation()
                if after != incarnation:
                    raise EngineError(f"{status.name} restarted during its heal ({incarnation} -> {after})")
                status.incarnation = after
                await self._emit(WorkerHealed(status.name, status.url, after))
                await self.router.add_worker(status.url)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever heal raises, the worker stays out
                message = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
                status.last_error = message
                retry_in = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
                log.warning("%s stays out of rotation: handshake attempt %d failed: %s", status.name, attempt, message)
                await self._emit(HealFailed(status.name, status.url, message, attempt, retry_in))
                await asyncio.sleep(retry_in)
                continue
            status.state = "serving"
            status.probe_failures = 0
            status.last_error = None
            await self._emit(WorkerReadmitted(status.name, status.url, status.incarnation))
            return

    async def settle(self) -> None:
        """Wait for every running handshake (tests)."""
        while self._handshakes:
            await asyncio.gather(*list(self._handshakes.values()), return_exceptions=True)

    async def close(self) -> None:
        """Stop polling and every handshake; close the engines' HTTP clients."""
        tasks = [t for t in [self._loop_task, *self._handshakes.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in self.engines.values():
            await engine.close()
