"""Adapter bytes into a patched SGLang server, staged and verified **inside the engine**:
:class:`SGLangWireEngine`, lorapub's :class:`~lorapub.ports.EngineAdmin` for SGLang, drives the
staging routes of lorapub's SGLang patch; the bytes travel the deployment's
:class:`~lorapub.ports.Transport` (:class:`HTTPBytes`, :class:`SameHostIPC`, :class:`SharedDir`,
:class:`TorchDistributed`, importable from here as from :mod:`lorapub.adapters.transports`).
See docs/design.md, "Publication on an engine".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Mapping, TypeVar, Unpack

import aiohttp

from lorapub.adapters.body_sender import shared_sender
from lorapub.adapters.sglang_http import ClientOptions, EngineState, SGLangHTTP, _status_text
from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown
from lorapub.ports import EndTimings, EngineLimits, HeldAdapter, Inventory, StagedAttempt, Transport
from lorapub.wire.codec import json_or_text
from lorapub.wire.messages import (
    BeginBody,
    BucketParams,
    CleanupBody,
    CleanupReply,
    EndBody,
    EndReply,
    ReleaseBody,
    ReleaseReply,
    StageReply,
)
from lorapub.wire.refusal import Refused
from lorapub.wire.routes import BEGIN_ROUTE, BUCKET_ROUTE, CLEANUP_ROUTE, END_ROUTE, RECLAIM_HEADER, RELEASE_ROUTE

from lorapub.adapters.transports import (  # the transports, importable from here as before
    HTTPBytes,
    RawBucket,
    SameHostIPC,
    SharedDir,
    ShmBucket,
    ShmBucketSource,
    TorchBucketSource,
    TorchDistributed,
    WireBucketSource,
)

logger = logging.getLogger(__name__)
_Reply = TypeVar("_Reply")

# -- the engine adapter ----------------------------------------------------------------------------------
#: The transport of an engine no deployment gave one (buckets as HTTP bodies).
DEFAULT_TRANSPORT = HTTPBytes()


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class SGLangWireEngine:
    """A patched SGLang server (0.5.17 or 0.5.23) whose staging runs inside it: lorapub's one
    SGLang engine adapter.

    Its buckets travel its deployment's transport: ``Deployment(engines, transport=...)`` hands it
    to every engine (:meth:`use_transport`); an engine no deployment gave one sends them as HTTP
    bodies (:data:`DEFAULT_TRANSPORT`). ``load_timeout`` bounds ``end`` (verification and the
    engine's load) and ``cleanup`` (which waits for an in-flight ``end``); ``transfer_timeout`` one
    bucket's request. The other options are :class:`~lorapub.adapters.sglang_http.SGLangHTTP`'s;
    every staging route is admin-level and carries the admin key.

    It requires lorapub's SGLang patch: its state route gives the incarnation, and managed adapters
    are neither implicitly reloaded nor unloadable without a reclaim id.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        transfer_timeout: float | None = None,
        load_timeout: float | None = 600.0,
        **client: Unpack[ClientOptions],
    ) -> None:
        self.client = SGLangHTTP(name, base_url, **client)
        self.name = self.client.name
        self._transport: Transport | None = None  # the one its deployment gave it
        self.transfer_timeout = transfer_timeout  # one bucket's request (None: the runner's deadline bounds it)
        self.load_timeout = load_timeout  # end (verify + the engine's load) and cleanup (waits for it)
        self._lives: dict[AttemptToken, str] = {}
        #: where each recent ``end`` spent its time: the engine's last SHA-256 checks and load, the
        #: exact-version probe, the state check (:meth:`end_timings` hands each over once)
        self._end_timings: dict[AttemptToken, EndTimings] = {}

    def __repr__(self) -> str:
        return f"SGLangWireEngine({self.client!r}, transport={self.transport!r})"

    @property
    def transport(self) -> Transport:
        """How this engine's buckets travel: its deployment's transport, else :data:`DEFAULT_TRANSPORT`."""
        return self._transport if self._transport is not None else DEFAULT_TRANSPORT

    def can_use_transport(self, transport: Transport) -> bool:
        """:meth:`use_transport` would take ``transport``: none given yet, or an equal one."""
        return self._transport is None or self._transport == transport

    def use_transport(self, transport: Transport) -> None:
        """Send buckets ``transport``'s way (what a deployment does with its transport). An engine
        given another transport before (by another deployment) refuses: :class:`InvalidInput` naming it."""
        if not isinstance(transport, Transport):
            raise InvalidInput(f"{self.name}: a transport is a lorapub.ports.Transport (HTTPBytes, SameHostIPC, "
                               f"SharedDir, TorchDistributed), got {transport!r}")
        if self._transport is None:
            self._transport = transport
        elif not self.can_use_transport(transport):
            raise InvalidInput(f"engine {self.name} already sends buckets {self._transport!r}; it cannot also send "
                               f"them {transport!r} (one transport per engine adapter: build another for this deployment)")

    # -- the patched server: state, limits, the exact-version probe, the reclaim-authorised unload --------
    @property
    def base_url(self) -> str:
        return self.client.base_url

    @property
    def require_patch(self) -> bool:
        return self.client.require_patch

    @require_patch.setter
    def require_patch(self, value: bool) -> None:
        self.client.require_patch = value

    async def close(self) -> None:
        await self.client.close()

    async def release(self) -> None:
        """Close the client's own connections; the adapter stays usable (see OwnedHTTPSession.release)."""
        await self.client.release()

    async def state(self) -> EngineState:
        return await self.client.state()

    async def incarnation(self) -> str:
        return (await self.client.state_reply()).incarnation

    async def inventory(self) -> Inventory:
        """The state route, as lorapub reads it: the managed adapters with their native refs,
        and what the engine-side staging holds."""
        state = await self.client.state_reply()
        adapters = {name: HeldAdapter(name, a.refs, a.lora_id, a.pinned) for name, a in state.adapters.items()}
        attempts = state.staging.attempts.values() if state.staging is not None else ()
        staged = tuple(StagedAttempt(a.token, a.lora_name, a.idle_s) for a in attempts if not a.loaded)
        return Inventory(state.incarnation, adapters, staged, state.managed_prefix, stamps=state.stamps)

    async def limits(self) -> EngineLimits:
        """SGLang's ``--max-loaded-loras`` / ``--max-loras-per-batch``, from its ``/server_info``
        (``/get_server_info`` on servers that predate it); the state route's ``max_loaded_loras``
        where neither answers."""
        for path in ("/server_info", "/get_server_info"):
            status, body = await self.client.request("GET", path, timeout=self.client.probe_timeout, admin=False)
            if status == 200 and isinstance(body, dict):
                return EngineLimits(_int_or_none(body.get("max_loaded_loras")), _int_or_none(body.get("max_loras_per_batch")))
            if status not in (404, 405):
                raise self.client.refusal(path, status, body)
        return EngineLimits(_int_or_none((await self.client.state_reply()).max_loaded_loras), None)

    async def _probe(self, lora_name: str) -> None:
        status, body = await self.client.request(
            "POST", "/generate",
            json_body={"input_ids": [1, 2, 3], "lora_path": lora_name, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            timeout=self.client.probe_timeout, admin=False,
        )
        if status != 200:
            raise EngineError(f"{self.name}: exact-version probe of {lora_name} failed: {_status_text(status, body)}")
        self.client.json_object("/generate", status, body)

    async def _unload(self, lora_name: str, reclaim_id: str) -> None:
        status, body = await self.client.request(
            "POST", "/unload_lora_adapter", json_body={"lora_name": lora_name},
            headers={RECLAIM_HEADER: reclaim_id}, timeout=None,
        )
        if status == 200:
            return
        if status in (401, 403):  # refused at the door: nothing was looked at
            raise self.client.refusal("/unload_lora_adapter", status, body)
        # "does not exist": an earlier unload whose reply was lost, or never loaded. Check, don't assume.
        state = await self.client.state_reply()
        if lora_name not in state.adapters and lora_name not in state.pending_unloads:
            return
        raise EngineError(f"{self.name}: unload of {lora_name} failed: {_status_text(status, body)}")

    # -- serving ----------------------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(payload, Mapping) or not payload.get("lora_path"):
            raise InvalidInput("lorapub never sends a generation without its bound lora_path")
        return await self.client.generate(payload)

    # -- the staging routes of lorapub's SGLang patch ---------------------------------------------
    async def _stage(self, path: str, body: dict[str, Any], decode: Callable[[object], _Reply],
                     timeout: float | None = None) -> _Reply:
        status, reply = await self.client.request("POST", path, json_body=body,
                                                  timeout=timeout if timeout is not None else self.client.probe_timeout)
        return self._decoded(path, decode, self._staged(path, status, reply))

    def _decoded(self, path: str, decode: Callable[[object], _Reply], reply: dict[str, Any]) -> _Reply:
        """A staging route's 200 reply as its typed value (:mod:`lorapub.wire.messages`); a malformed one is
        a definite :class:`EngineError`."""
        try:
            return decode(reply)
        except Refused as e:
            raise EngineError(f"{self.name} {path} answered {e.message}", engine=self.name) from None

    def _staged(self, path: str, status: int, reply: object) -> dict[str, Any]:
        if status == 404 and self.client.require_patch:
            raise EngineError(f"{self.name} lacks lorapub's engine-side staging ({path} is missing): update its "
                              "SGLang patch", engine=self.name, status=status)
        if status != 200:
            raise self.client.refusal(path, status, reply)
        return self.client.json_object(path, status, reply)

    # -- publication ------------------------------------------------------------------------------
    async def begin(self, request: SendBegin) -> str:
        body = BeginBody(request.token, request.incarnation, request.lora_name, request.digest, request.plan,
                         self.transport.begin_options(request, self.name), self.transport.load)
        incarnation = (await self._stage(BEGIN_ROUTE, body.to_json(), StageReply.from_json)).incarnation
        self._lives[request.token] = incarnation
        return incarnation

    async def _life(self, token: AttemptToken) -> str:
        return self._lives.get(token) or await self.incarnation()

    async def receive_bucket(self, token: AttemptToken, index: int, payload: Any) -> str:
        life = await self._life(token)
        post = await self.transport.bucket_request(token, index, payload, self.name)
        params = BucketParams(token, index, life, post.format).to_params()
        headers = {**self.client._authorization(True), "Content-Type": post.content_type}
        if post.length is not None:
            headers["Content-Length"] = str(post.length)
        stored, why = False, None
        try:
            url = self.base_url + BUCKET_ROUTE
            if post.sender is not None and self._bodies_off_loop(post.sender):
                status, raw = await shared_sender().post(url, params=params, headers=headers, body=post.body,
                                                         timeout=self.transfer_timeout)
            else:
                t = aiohttp.ClientTimeout(total=self.transfer_timeout)
                async with self.client.http.post(url, params=params, data=post.body, headers=headers, timeout=t) as r:
                    status, raw = r.status, await r.read()
            text = raw.decode("utf-8", errors="replace")
            reply = self._staged(BUCKET_ROUTE, status, json_or_text(text))
            incarnation = self._decoded(BUCKET_ROUTE, StageReply.from_json, reply).incarnation
            stored = True
            return incarnation
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            why = f"{self.name} did not answer bucket {index}"
            raise OutcomeUnknown(f"{self.name} {BUCKET_ROUTE}: no answer from {self.base_url} ({type(e).__name__})",
                                 engine=self.name, url=self.base_url) from None
        except EngineError as e:
            why = f"{self.name} refused bucket {index}: {e.message}"
            raise
        finally:
            if post.settle is not None:
                post.settle(stored, why)

    def _bodies_off_loop(self, sender: str) -> bool:
        self.client.http  # noqa: B018 - a closed engine refuses here, before anything is sent
        return sender == "thread" or (sender == "auto" and self.client.owns_http)

    async def end(self, token: AttemptToken) -> ReadyLocal:
        inc = await self._life(token)
        t0 = time.monotonic()
        receipt = (await self._stage(END_ROUTE, EndBody(token, inc).to_json(), EndReply.from_json,
                                     self.load_timeout)).receipt
        t1 = time.monotonic()
        name, digest = receipt.lora_name, receipt.digest
        if receipt.incarnation != inc:
            raise EngineError(f"{self.name} {END_ROUTE} answered a receipt of another life: {receipt}",
                              engine=self.name)
        # The exact-version probe and the state check overlap: both only read the engine, and a restart
        # between them fails the probe (a new life holds nothing) or shows in the state's incarnation.
        state_read = asyncio.ensure_future(_timed(self.client.state_reply()))
        try:
            await self._probe(name)
            t2 = time.monotonic()
            state, state_s = await state_read
        finally:
            if not state_read.done():
                state_read.cancel()
            elif not state_read.cancelled():
                state_read.exception()  # retrieved: the probe's error is the one raised
        self._end_timings[token] = EndTimings({"verify_wait": receipt.verify_wait, "load": receipt.load_s},
                                              stage=t1 - t0, probe=t2 - t1, state=state_s)
        while len(self._end_timings) > 16:  # a few recent ones, for reports
            self._end_timings.pop(next(iter(self._end_timings)))
        if state.incarnation != inc:
            raise EngineError(f"{self.name} restarted during end ({inc} -> {state.incarnation})")
        entry = state.adapters.get(name)
        if entry is None or not entry.pinned or entry.lora_id != receipt.lora_id:
            raise EngineError(f"{self.name}: {name} is not loaded pinned from this attempt")
        self._lives.pop(token, None)
        return ReadyLocal(self.name, token, digest, inc, entry.lora_id)

    def end_timings(self, token: AttemptToken) -> EndTimings | None:
        """Where ``end`` of ``token`` spent its time (:class:`~lorapub.ports.ReportsEndTimings`), handed
        over once; None when it is not kept (an ``end`` that failed, or one of the 16 most recent no more)."""
        return self._end_timings.pop(token, None)

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        # The engine tombstones the attempt first and waits for its in-flight operation, so nothing
        # of it can be loaded after this answer; then the exact name is unloaded if this attempt
        # loaded it (another attempt of the same version — a re-provisioning — may hold that name).
        reply = await self._stage(CLEANUP_ROUTE, CleanupBody(token).to_json(), CleanupReply.from_json,
                                  self.load_timeout)
        if reply.must_unload or await self._left_behind(lora_name):  # (a staging that does not say: unloaded to be safe)
            await self._unload(lora_name, f"cleanup-{token}")
        self._lives.pop(token, None)
        return await self.incarnation()

    async def _left_behind(self, lora_name: str) -> bool:
        """The engine holds ``lora_name`` though no attempt staged there claims it: the load of the
        attempt just cleaned up, which ended after the cleanup tombstoned it (the staging then
        answers ``loaded: null`` for a load that did happen). A name another attempt holds or is
        loading (a re-provisioning of the same version) is that attempt's, and stays."""
        state = await self.client.state_reply()
        if lora_name not in state.adapters:
            return False
        attempts = state.staging.attempts.values() if state.staging is not None else ()
        return not any(a.lora_name == lora_name for a in attempts)

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        await self._unload(lora_name, reclaim_id)
        await self._stage(RELEASE_ROUTE, ReleaseBody(lora_name).to_json(), ReleaseReply.from_json)  # it frees what it kept



async def _timed(aw: Awaitable[_Reply]) -> tuple[_Reply, float]:
    """``aw``'s result and the seconds it took."""
    t0 = time.monotonic()
    return await aw, time.monotonic() - t0

__all__ = ["DEFAULT_TRANSPORT", "HTTPBytes", "RawBucket", "SGLangWireEngine", "SameHostIPC", "SharedDir", "ShmBucket",
           "ShmBucketSource", "TorchBucketSource", "TorchDistributed", "WireBucketSource"]
