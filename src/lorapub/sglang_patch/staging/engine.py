"""The engine-side staging of one server life: :class:`EngineStaging` drives the pure machine
(:mod:`lorapub.core.staging.machine`) and runs the effects it answers with.
See docs/design.md, "The staging machine".
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Protocol

import attrs

from lorapub.core.identity import MANAGED_PREFIX, AttemptToken
from lorapub.core.manifest import Bucket
from lorapub.sglang_patch.env import env_number
from lorapub.core.staging import machine
from lorapub.core.staging import messages as m
from lorapub.sglang_patch.staging import claims, collective, landing, swap
from lorapub.sglang_patch.staging.buffers import Buffer, verify_and_keep
from lorapub.sglang_patch.staging.landing import Stash
from lorapub.sglang_patch.staging.receivers import (
    begin_request,
    bucket_request,
    drain,
    read_control,
    receive_bytes,
    refusal_of,
)
from lorapub.wire.codec import manifest_digest
from lorapub.wire.messages import (
    AttemptReport,
    BeginSent,
    BucketSent,
    CleanupBody,
    CleanupReply,
    EndBody,
    EndReply,
    ReleaseBody,
    ReleaseReply,
    StageReply,
    StagingReport,
)
from lorapub.wire.refusal import Refused, refuse

__all__ = ["DEFAULT_IDLE_S", "IDLE_ENV", "EngineHooks", "EngineStaging", "idle_timeout_setting", "managed_prefix_of"]

#: Seconds an attempt may go undriven before the engine frees and tombstones it (see the package docs).
IDLE_ENV = "LORAPUB_STAGE_IDLE_S"
DEFAULT_IDLE_S = 600.0
logger = logging.getLogger("lorapub.sglang_patch.staging")
_now = time.monotonic


def idle_timeout_setting() -> float:
    """``LORAPUB_STAGE_IDLE_S`` in seconds (``inf``: never); the default when unset, or when not a
    positive number (logged)."""
    seconds = env_number(IDLE_ENV, float, lambda s: s > 0, "a positive number of seconds",
                         f"using {DEFAULT_IDLE_S:g}", logger)
    return DEFAULT_IDLE_S if seconds is None else seconds


class StagingObserver(Protocol):
    """What sees each command the machine handles (lorapub's engine series, sglang_patch.metrics)."""

    def observe(self, before: machine.StagingState, command: Any, out: machine.Outcome) -> None: ...


class _Reply(Protocol):
    """A staging route's answer (:mod:`lorapub.wire.messages`)."""

    def to_json(self) -> dict[str, Any]: ...


class EngineHooks(Protocol):
    """The engine around the staging (SGLang's TokenizerManager, or the contract double)."""

    def adapters(self) -> Mapping[str, Mapping[str, Any]]:
        """Registered adapters: name -> {"lora_id", "pinned", "lora_path"} (and "refs", the requests in
        flight on it, where the engine counts them)."""

    def max_loaded_loras(self) -> int | None: ...

    # optional: def managed_prefix(self) -> str — the names the engine protects (MANAGED_PREFIX if absent)

    async def load_dir(self, lora_name: str, path: str) -> str | None:
        """Load the PEFT directory ``path`` pinned under ``lora_name``; None, or the engine's error text."""

    async def load_tensors(self, lora_name: str, tensors: dict[str, Any], config: dict[str, Any],
                           checksums: dict[str, str]) -> str | None:
        """Load named torch tensors pinned under ``lora_name``; None, or the engine's error text."""


def managed_prefix_of(hooks: Any) -> str:
    """The names the engine protects (its patch's managed prefix)."""
    prefix = getattr(hooks, "managed_prefix", None)
    return prefix() if callable(prefix) else MANAGED_PREFIX


def _raise(reply: Any) -> Any:
    """The reply, or the refusal it is raised."""
    if isinstance(reply, m.Refusal):
        raise Refused.of(reply)
    return reply


class EngineStaging:
    """The engine-side staging of one server life. ``hooks`` is the engine; ``stash_root`` the
    engine's own folder for ``dir`` loads; ``shm_dir`` the only folder ``shm`` buckets are read from;
    ``max_stash_bytes`` bounds what staged attempts may hold and have reserved at once (None: no
    bound); ``idle_timeout`` the seconds an attempt may go undriven before it is aged out (None:
    ``LORAPUB_STAGE_IDLE_S``, default 600; ``math.inf``: never).

    Each route is a few machine commands: an admission, the steps taken under the attempt's lock,
    what the I/O did, and ``Leave``. Between them this class only moves bytes (landings, checks,
    folders, groups) and calls the engine (:class:`EngineHooks`); every decision (refusals,
    duplicates, tombstones, the byte budget, aging, what a cleanup answers) is the machine's."""

    def __init__(self, hooks: EngineHooks, *, incarnation: str, stash_root: str | None = None,
                 shm_dir: str | None = None, max_stash_bytes: int | None = None,
                 idle_timeout: float | None = None, before_dir_load: Callable[[str], object] | None = None) -> None:
        self.hooks = hooks
        #: run (in a thread) on a ``dir`` load's verified folder just before it is loaded: a test's hook (the
        #: numeric READY gate's scale switch, given by the server glue or the double); None in production
        self.before_dir_load = before_dir_load
        self.incarnation = incarnation
        root = stash_root or os.environ.get("LORAPUB_ENGINE_STASH") or os.path.join(
            tempfile.gettempdir(), "lorapub-engine-stash")
        self.stash_root = os.path.join(root, re.sub(r"[^A-Za-z0-9_.-]", "_", incarnation))
        self.shm_dir = os.path.realpath(shm_dir or os.environ.get("LORAPUB_SHM_DIR") or "/dev/shm")
        if max_stash_bytes is None and os.environ.get("LORAPUB_MAX_STASH_BYTES"):
            max_stash_bytes = int(os.environ["LORAPUB_MAX_STASH_BYTES"])
        self.max_stash_bytes = max_stash_bytes
        if idle_timeout is None:
            idle_timeout = idle_timeout_setting()
        elif isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        self.idle_timeout = float(idle_timeout)
        self._state = machine.new_state(incarnation, max_stash_bytes, self.idle_timeout)
        #: lorapub's engine series (:mod:`lorapub.sglang_patch.metrics`) shown each command; None: none
        self.metrics: StagingObserver | None = None
        self._stashes: dict[AttemptToken, Stash] = {}  # the I/O side of every attempt the machine stages
        #: bytes the machine decides on: (buffer, its tensors' spans)
        self._landed: dict[tuple[AttemptToken, int], tuple[Buffer, list[tuple[int, int]]]] = {}
        self.collectives = 0  # broadcasts this life joined (a duplicate receive joins none)
        #: name -> digest of what this life loaded under that name (the provenance stamps read it)
        self.digests: dict[str, str] = {}
        #: TEST-ONLY (LORAPUB_TEST_SWAP_WEIGHTS): load each new version with the previous one's weights
        self.swap_weights = swap.enabled()
        self._swap: swap.Kept | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next sweep, on the loop the routes run on
        self._timer_loop: asyncio.AbstractEventLoop | None = None
        self._sweeping: asyncio.Task[list[str]] | None = None
        self._pid = os.getpid()
        tag = claims.claim_tag()
        # Closes the claim's descriptor (its lock goes with it); also when a staging is never closed.
        self._claim = claims.take_claim(self, root, self.stash_root, tag)
        if self._claim is not None:
            claims.sweep_ended_lives(root, tag)

    @property
    def state(self) -> machine.StagingState:
        """The machine's state now (read-only: every change is a command)."""
        return self._state

    @property
    def aged_out(self) -> int:
        """Attempts freed because nobody drove them for ``idle_timeout``."""
        return self._state.aged_out

    # -- the machine and its effects ------------------------------------------------------------------
    def _handle(self, command: Any) -> machine.Outcome:
        """Send the machine ``command`` and keep the state it answers (the metrics, if any, see both)."""
        before = self._state
        out = machine.handle(before, command)
        self._state = out.state
        if self.metrics is not None:
            self.metrics.observe(before, command, out)
        return out

    def _do(self, command: Any) -> tuple[Any, list[m.Effect]]:
        """Send the machine ``command``; run the bookkeeping effects it answers with now. Answers the
        reply and the effects left for the operation that sent it (landing bytes, a collective, the
        load, a folder)."""
        out = self._handle(command)
        return out.reply, self._run(out.effects)

    def _run(self, effects: Iterable[m.Effect]) -> list[m.Effect]:
        later: list[m.Effect] = []
        for effect in effects:
            if isinstance(effect, m.Verify):
                self._verify(effect.token, effect.index)
            elif isinstance(effect, m.CloseBuffer):
                buf, _ = self._landed.pop((effect.token, effect.index))
                buf.close()
            elif isinstance(effect, m.ReleaseBytes):
                landing.release_buckets(self._stashes[effect.token])
            elif isinstance(effect, m.DropGroup):
                collective.drop_group(self._stashes[effect.token], effect.abort)
            elif isinstance(effect, m.Free):
                self._free(effect.token, effect.abort)
            elif isinstance(effect, m.JoinGroup):
                collective.start_join(self._stashes[effect.token])
            else:
                later.append(effect)
        return later

    def _verify(self, token: AttemptToken, index: int) -> None:
        """Keep the bucket and check every tensor's SHA-256 beside the next bucket's transfer (off the
        event loop); a ``dir`` load's bucket that did not arrive in the adapter's file (a safetensors
        blob, or the publisher's shared-memory pages mapped here) is copied there, tensor by tensor,
        and the copy is what is checked. ``end`` waits for every check and copy before anything is
        loaded."""
        buf, spans = self._landed.pop((token, index))
        stash = self._stashes[token]
        stash.buckets[index] = (buf, spans)
        bucket = stash.plan.buckets[index]
        into = None if stash.peft is None or buf.in_file else (stash.peft[0], stash.peft[1][index])
        check = asyncio.ensure_future(asyncio.to_thread(verify_and_keep, buf.view, spans, bucket, into))
        check.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here; end raises it
        stash.verifying[index] = check

    def _free(self, token: AttemptToken, abort: str | None) -> None:
        stash = self._stashes.pop(token, None)
        if stash is not None:
            landing.release_buckets(stash)
            collective.drop_group(stash, abort)
        folder = stash.folder if stash is not None and stash.folder is not None else self.folder_of(token)
        shutil.rmtree(folder, ignore_errors=True)

    def folder_of(self, token: AttemptToken) -> str:
        version = token.version
        return os.path.join(self.stash_root, f"{version.deployment_epoch}-{version.version_id}-a{token.seq}")

    async def _answer(self, work: Awaitable[_Reply]) -> tuple[int, dict[str, Any]]:
        try:
            return 200, (await work).to_json()
        except Refused as e:
            return e.status, e.to_json()
        finally:
            self._arm()  # a sweep is due while anything is staged

    # -- introspection (the state route reports it) ---------------------------------------------------
    def report(self) -> dict[str, Any]:
        """:meth:`staging_report` as JSON (the diff form of the patch puts it in its state route's answer)."""
        return self.staging_report().to_json()

    def staging_report(self) -> StagingReport:
        """What this staging holds, as the state route reports it: every staged attempt (keyed by its
        token's text) with its phase, buckets, bytes and idle seconds; ``reserved``: the bytes attempts
        still receiving will hold (the budget counts them too)."""
        self._arm()
        now, state = _now(), self._state
        attempts = {}
        for a in state.attempts.values():
            stash = self._stashes.get(a.token)
            attempts[str(a.token)] = AttemptReport(
                a.token, a.lora_name, "loaded" if a.receipt is not None else "failed" if a.failed else "receiving",
                tuple(sorted(a.held)), len(a.sizes), a.held_bytes, a.receipt is not None,
                stash is not None and stash.folder is not None, a.transport, a.load,
                round(max(0.0, now - a.last_driven), 3), a.driving > 0)
        return StagingReport(attempts, state.held_bytes, state.reserved_bytes, len(state.tombstones), self.collectives,
                             self.idle_timeout, state.aged_out)

    def close(self) -> None:
        """Free every stash of this life (the server is going away). Only in the process that made
        it: a forked child that exits must not free its parent's live stash."""
        if os.getpid() != self._pid:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            out = self._handle(m.Close())
            for effect in out.effects:
                try:
                    self._run([effect])
                except Exception as e:  # noqa: BLE001 - the folder and the claim go whatever one attempt does
                    logger.warning("lorapub: freeing %s at close failed: %s", effect.token, e)
        finally:
            shutil.rmtree(self.stash_root, ignore_errors=True)
            if self._claim is not None:
                claims.release_claim(self.stash_root, self._claim)
                self._claim = None

    # -- aging --------------------------------------------------------------------------------------------
    async def sweep(self) -> list[str]:
        """Age out every attempt nobody has driven for ``idle_timeout``: tombstoned and freed as a
        cleanup would. An attempt whose ``end`` loaded the adapter registered under its name now is
        kept (aging never unloads). Answers the tokens aged out."""
        now = _now()
        idle = machine.idle_attempts(self._state, now)
        if not idle:
            return []
        adapters = self._adapter_ids() if any(a.receipt is not None for a in idle) else None
        aged, _ = self._do(m.Sweep(now, adapters))
        for a in aged:
            logger.warning("lorapub: staged attempt %s (%s) aged out after %.0f s undriven; %s freed",
                           a.token, a.lora_name, a.idle, "its folder" if a.loaded else "its stash")
        return [str(a.token) for a in aged]

    def _adapter_ids(self) -> dict[str, Any] | None:
        """The engine's registered adapters: name -> lora_id (None: unknown)."""
        try:
            return {name: entry.get("lora_id") for name, entry in self.hooks.adapters().items()}
        except Exception as e:  # noqa: BLE001 - unknown: every loaded attempt is kept
            logger.warning("lorapub: the staging cannot read the engine's adapters: %s", e)
            return None

    @property
    def _sweep_every(self) -> float:
        return min(60.0, max(0.01, self.idle_timeout / 4))

    @property
    def aging_armed(self) -> bool:
        """The aging timer is set (an attempt is staged, so it will be swept if nobody drives it)."""
        return self._timer is not None

    def _arm(self) -> None:
        """Make sure a sweep is due on the running event loop (a cheap timer; none without attempts,
        none once closed). Called by every route."""
        if self._state.closed or math.isinf(self.idle_timeout) or not self._state.attempts:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._timer is not None:
            if self._timer_loop is loop:
                return
            self._timer.cancel()  # a loop this staging was used on before: sweep on this one
        self._timer_loop = loop
        self._timer = loop.call_later(self._sweep_every, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._state.closed:
            return
        if self._sweeping is None or self._sweeping.done():
            self._sweeping = asyncio.ensure_future(self.sweep())
            self._sweeping.add_done_callback(self._swept)
        self._arm()

    @staticmethod
    def _swept(task: asyncio.Task[list[str]]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("lorapub: staging sweep failed: %r", task.exception())

    # -- begin --------------------------------------------------------------------------------------------
    async def begin(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._answer(self._begin(body))

    async def _begin(self, body: Any) -> StageReply:
        sent = BeginSent.from_json(body)  # no JSON object, or no token: refused now
        token = sent.token
        # Age out what nobody drives first: a vanished publisher's stash never blocks this begin (its
        # capacity check). Nothing after this awaits, so what it checks still holds when it acts.
        await self.sweep()
        request = begin_request(sent, managed_prefix_of(self.hooks))
        adapters = self.hooks.adapters() if request.problem is None else {}
        limit = self.hooks.max_loaded_loras() if request.problem is None else None
        out = self._handle(m.Begin(
            token, sent.incarnation, sent.digest, sent.lora_name, request.sizes, request.load,
            request.kind, request.problem, request.late_problem, frozenset(adapters), limit, _now()))
        if _raise(out.reply).duplicate:  # the same answer, nothing set up twice
            return StageReply(self.incarnation, duplicate=True)
        if request.body is None:  # only a begin with a problem has none, and the machine refused it above
            raise machine.ProtocolError(f"begin of {token} accepted without a bucket plan")
        begun = request.body
        stash = self._stashes[token] = Stash(token, begun.plan, begun.transport, begun.load)
        for effect in self._run(out.effects):
            if isinstance(effect, m.PrepareFolder):
                try:
                    landing.prepare_peft_file(stash, self.folder_of(token), request.header)
                except OSError as e:
                    self._do(m.Abandon(token))
                    raise refuse(f"the engine cannot write {begun.lora_name}'s folder: {e}", "STAGE_DISK") from None
        return StageReply(self.incarnation, duplicate=False)

    # -- receive ------------------------------------------------------------------------------------------
    async def receive(self, params: Mapping[str, str], chunks: AsyncIterator[bytes] | None,
                      length: int | None = None) -> tuple[int, dict[str, Any]]:
        """A bucket: ``params`` carry the token (epoch, version_id, seq), ``index``, ``incarnation`` and
        ``format``; ``chunks`` is the body (the bytes, or for shm/torch a small JSON object)."""
        status, body = await self._answer(self._receive(params, chunks, length))
        if status != 200 and chunks is not None:
            await drain(chunks)  # the caller's stream is read to its end whatever the answer
        return status, body

    async def _receive(self, params: Mapping[str, str], chunks: AsyncIterator[bytes] | None,
                       length: int | None) -> StageReply:
        sent = BucketSent.from_params(params)  # no token: refused now
        token = sent.token
        bucket, problem = bucket_request(sent)
        _raise(self._do(m.Receive(token, sent.incarnation, problem, _now()))[0])
        try:  # its idle time starts again when this ends
            if bucket is None:  # only parameters with a problem have none, and the machine refused them above
                raise machine.ProtocolError(f"bucket of {token} admitted without its index and format")
            return await self._receive_into(self._stashes[token], bucket.index, bucket.format, chunks, length)
        finally:
            self._do(m.Leave(token, _now()))

    async def _receive_into(self, stash: Stash, index: int, fmt: str, chunks: AsyncIterator[bytes] | None,
                            length: int | None) -> StageReply:
        token = stash.token
        async with stash.lock:
            reply, later = self._do(m.Arrive(token, index, fmt, length, _now()))
            if isinstance(_raise(reply), m.Accepted):  # a duplicate: nothing stored twice, no second collective
                if chunks is not None:
                    await drain(chunks)
                return StageReply(self.incarnation, duplicate=True)
            bucket = stash.plan.buckets[index]
            if isinstance(reply, m.Join):  # a duplicate while the first runs: its outcome, never a second collective
                await read_control(chunks)
                running, duplicate = stash.inflight[index], True
            elif isinstance(later[0], m.Collect):  # the collective runs outside the lock: a cleanup never waits for it
                try:
                    control = await read_control(chunks)
                except BaseException:
                    self._do(m.Lost(token, index, _now()))
                    raise
                running = stash.inflight[index] = asyncio.ensure_future(self._collect(stash, bucket, control))
                duplicate = False
            else:
                try:
                    buf, spans = await receive_bytes(stash, bucket, fmt, chunks, length, self.shm_dir)
                except BaseException:
                    self._do(m.Lost(token, index, _now()))
                    raise
                return self._store(token, index, buf, spans)
        answer = await asyncio.shield(running)  # it runs on even if this caller goes away
        return attrs.evolve(answer, duplicate=True) if duplicate else answer

    def _store(self, token: AttemptToken, index: int, buf: Buffer, spans: list[tuple[int, int]]) -> StageReply:
        self._landed[(token, index)] = (buf, spans)  # kept and checked, or closed (cleaned up meanwhile)
        _raise(self._do(m.Stored(token, index, buf.nbytes, _now()))[0])
        return StageReply(self.incarnation, duplicate=False)

    async def _collect(self, stash: Stash, bucket: Bucket, control: Mapping[str, Any]) -> StageReply:
        token, index = stash.token, bucket.index
        try:
            try:
                ranks = collective.ranks_of(stash, bucket, control)
                group = stash.group
                if group is None:  # ranks_of refuses an attempt without its group
                    raise refuse(f"attempt {token} has no process group here (it failed or ended)", "STAGE_FAILED")
            except BaseException:
                self._do(m.Lost(token, index, _now()))
                raise
            self.collectives += 1
            try:
                buf, spans = await asyncio.to_thread(collective.receive, stash, group, bucket, ranks, landing.landing)
            except Refused as e:  # a failed collective fails the attempt here for good
                self._do(m.CollectFailed(token, index, e.message, _now()))
                raise
            except Exception as e:  # noqa: BLE001
                reason = f"collective for bucket {index} failed: {type(e).__name__}: {e}"
                self._do(m.CollectFailed(token, index, reason, _now()))
                raise Refused(409, "STAGE_COLLECTIVE", reason) from None
            except BaseException:
                self._do(m.Lost(token, index, _now()))
                raise
            return self._store(token, index, buf, spans)
        finally:
            stash.inflight.pop(index, None)

    # -- end ------------------------------------------------------------------------------------------------
    async def end(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        return await self._answer(self._end(body))

    async def _end(self, body: Any) -> EndReply:
        sent = EndBody.from_json(body)
        token = sent.token
        _raise(self._do(m.End(token, sent.incarnation, _now()))[0])
        try:
            return await self._end_of(self._stashes[token])
        finally:
            self._do(m.Leave(token, _now()))

    async def _end_of(self, stash: Stash) -> EndReply:
        token = stash.token
        async with stash.lock:
            reply, _ = self._do(m.Finish(token, _now()))
            if isinstance(_raise(reply), m.Receipted):  # a duplicate end: the same receipt, nothing loaded twice
                return EndReply(reply.receipt, duplicate=True)
            fails = False
            try:
                started = _now()
                fails = True  # every tensor's SHA-256, checked as its bucket arrived
                await asyncio.gather(*stash.verifying.values())
                fails = False
                receipt = await self._load(stash, started)
            except Refused as e:
                self._do(m.LoadFailed(token, refusal_of(e), fails))
                raise
            except BaseException:
                self._do(m.LoadFailed(token))
                raise
            reply, _ = self._do(m.Loaded(token, receipt))  # the staged bytes go: the engine holds the adapter
            return EndReply(_raise(reply).receipt, duplicate=False)

    async def _load(self, stash: Stash, started: float) -> m.Receipt:
        """The fresh, pinned load through the engine (``dir``: the folder on the engine's own disk, its
        config added now; ``tensors``: SGLang's tensor load, over its IPC, never touching disk)."""
        attempt = self._state.attempts[stash.token]
        name, digest = attempt.lora_name, attempt.digest
        verified = _now()
        if manifest_digest(stash.plan) != digest:
            raise Refused(400, "STAGE_DIGEST", f"the staged manifest does not hash to {digest[:12]}")
        if name in self.hooks.adapters():
            raise refuse(f"{name} is already loaded (not by this attempt)")
        loaded = digest
        if stash.load == "dir":  # the tensors are in the folder already (received and verified there)
            path = await asyncio.to_thread(landing.finish_peft_dir, stash)
            if self.swap_weights:
                path, loaded, self._swap = await asyncio.to_thread(swap.dir_load, self._swap, path, digest, self.stash_root)
            if self.before_dir_load is not None:  # a test's hook (docs/provenance.md): never in production
                await asyncio.to_thread(self.before_dir_load, path)
            error = await self.hooks.load_dir(name, path)
        else:
            path = "__tensor__"
            checksums = {e.name: e.sha256 for b in stash.plan.buckets for e in b.entries}
            config = json.loads(stash.plan.serving_config_json)
            tensors = landing.tensors(stash)
            if self.swap_weights:
                (tensors, config, checksums), loaded, self._swap = swap.tensor_load(
                    self._swap, (tensors, config, checksums), digest)
            error = await self.hooks.load_tensors(name, tensors, config, checksums)
        if error is not None:
            raise refuse(f"load of {name} failed: {error}", "STAGE_LOAD")
        entry = self.hooks.adapters().get(name)
        if entry is None or not entry.get("pinned"):
            raise refuse(f"{name} is not registered pinned after its load", "STAGE_LOAD")
        self.digests[name] = loaded  # what was really loaded under this name (the stamps say it)
        return m.Receipt(self.incarnation, name, digest, entry.get("lora_id"), entry.get("lora_path", path), stash.load,
                         verified - started, _now() - verified)

    # -- cleanup / release --------------------------------------------------------------------------------
    async def cleanup(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Tombstone the attempt (always, whatever life it names: a tombstone only refuses), wait for
        its in-flight operation (an end's load too), free its stash. Answers what it loaded (the
        caller unloads it)."""
        return await self._answer(self._cleanup(body))

    async def _cleanup(self, body: Any) -> CleanupReply:
        token = CleanupBody.from_json(body).token
        reply, _ = self._do(m.Cleanup(token, _now()))  # from now on begin / bucket / end of it are refused
        if isinstance(reply, m.Wait):
            try:
                async with self._stashes[token].lock:
                    reply, _ = self._do(m.Discard(token))
            finally:
                self._do(m.Leave(token, _now()))
        return CleanupReply(self.incarnation, reply.loaded)

    async def release(self, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """After ``lora_name`` was unloaded (reclaimed): free what its attempt still keeps here."""
        return await self._answer(self._release(body))

    async def _release(self, body: Any) -> ReleaseReply:
        name = ReleaseBody.from_json(body).lora_name
        reply, _ = self._do(m.Release(name, name in self.hooks.adapters(), _now()))
        tokens = _raise(reply).tokens
        freed: list[str] = []
        try:
            for token in tokens:
                stash = self._stashes.get(token)
                if stash is None:  # freed meanwhile: tombstoned all the same
                    reply, _ = self._do(m.Forget(token))
                else:
                    async with stash.lock:  # an end that loaded the name meanwhile keeps its attempt
                        reply, _ = self._do(m.Forget(token, self._adapter_ids()))
                if isinstance(reply, m.Freed):
                    freed.append(str(reply.token))
        finally:
            for token in tokens:
                self._do(m.Leave(token, _now()))
        return ReleaseReply(self.incarnation, tuple(freed))
