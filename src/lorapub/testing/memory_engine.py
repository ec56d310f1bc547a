"""An in-process :class:`~lorapub.ports.EngineAdmin` with faults, for fast model-based tests: it
keeps what live SGLang (with lorapub's patch and engine-side staging) was seen to do, without
HTTP, and fails on demand (:meth:`MemoryEngine.fail_next`) or at random (``rate``).
See docs/testing.md, "Faults: `MemoryEngine` and `FaultyRegistry`".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown, VersionMissing
from lorapub.ports import Clock, EngineLimits, HeldAdapter, Inventory, StagedAttempt
from lorapub.clock import SystemClock
from lorapub.testing import numeric
from lorapub.wire.codec import manifest_digest
from lorapub.wire.refusal import Refused
from lorapub.wire.safetensors import safetensors_layout, verify_spans

__all__ = ["FAULTS", "OPS", "MemoryEngine", "MemoryUnderTest"]

FAULTS = ("request", "reply", "error", "stall", "restart")
OPS = ("incarnation", "begin", "receive_bucket", "end", "cleanup", "reclaim", "generate")
T = TypeVar("T")


class MemoryEngine:
    """An in-process engine that behaves as live SGLang was seen to, with injectable faults
    (see the module docs); it passes :func:`~lorapub.testing.check_engine_admin`."""

    def __init__(
        self, name: str, *, max_loaded: int = 3, max_per_batch: int | None = None, rate: float = 0.0,
        seed: int | None = None, generate_seconds: float = 0.0, stage_idle_s: float = 600.0,
        clock: Clock | None = None, scale_tensor: str | None = None,
    ) -> None:
        self.name = name
        # test-only: scale one tensor at load ("<substring>=<factor>"; default: lorapub.testing.numeric.SCALE_ENV)
        self.scale_tensor = scale_tensor
        self.stage_idle_s = stage_idle_s  # the engine staging's LORAPUB_STAGE_IDLE_S default
        self.clock = clock or SystemClock()
        self.aged: list[AttemptToken] = []  # attempts dropped because nobody drove them (all lives)
        self.max_loaded = max_loaded
        self.max_per_batch = max_loaded if max_per_batch is None else max_per_batch
        self.rate = rate
        self.generate_seconds = generate_seconds
        self._rng = random.Random(seed)
        self._planned: list[tuple[str | None, str]] = []
        self.life = 0
        self.unloads: dict[str, int] = {}  # lora_name -> physical unloads (all lives)
        self.generations: list[tuple[str, str]] = []  # (incarnation, lora_name) that ran
        self.injected: list[tuple[str, str]] = []
        self.requests = 0  # generation requests that reached the engine
        self.stamps = True  # provenance stamps in meta_info, as lorapub's patch (False: stock SGLang)
        self.swap_weights = False  # TEST-ONLY: a new version is served with the previous one's weights
        self._boot()

    # -- lifecycle -------------------------------------------------------------------
    def _boot(self) -> None:
        self.incarnation_id = f"{self.name}-life{self.life}"
        self.loaded: dict[str, str] = {}  # lora_name -> digest (pinned)
        self.numeric: dict[str, float] = {}  # lora_name -> its stand-in model (lorapub.testing.numeric)
        self.unregistered: set[str] = set()  # reclaim began: new requests refused
        self.refs: dict[str, int] = {}
        self.stashes: dict[AttemptToken, tuple[SendBegin, dict[int, bytes]]] = {}
        self.refused: set[AttemptToken] = set()
        self.driven: dict[AttemptToken, float] = {}  # stash -> when a call last drove it
        self.ended: set[AttemptToken] = set()  # stashes whose end loaded their adapter
        self._dead: asyncio.Event | None = None  # set when this life ends (created lazily, in a loop)

    async def close(self) -> None:
        """Nothing to close: it holds no connection (EngineAdmin's lifecycle)."""

    async def release(self) -> None:
        """Nothing to release: it holds no connection (EngineAdmin's lifecycle)."""

    def restart(self) -> None:
        """A crash and restart: every adapter, stash and running request is gone."""
        self.life += 1
        if self._dead is not None:
            self._dead.set()  # running requests of the old life end with no answer
        self._boot()

    def fail_next(self, op: str | None = None, fault: str = "reply", count: int = 1) -> None:
        if fault not in FAULTS or (op is not None and op not in OPS):
            raise ValueError(f"fault in {FAULTS}, op in {OPS}")
        self._planned.extend([(op, fault)] * count)

    def clear_faults(self) -> None:
        """Drop the planned faults that have not fired yet."""
        self._planned.clear()

    def serves(self, lora_name: str) -> bool:
        return lora_name in self.loaded and lora_name not in self.unregistered

    # -- faults ------------------------------------------------------------------------
    def _fault(self, op: str) -> str | None:
        for i, (kind, fault) in enumerate(self._planned):
            if kind is None or kind == op:
                del self._planned[i]
                return fault
        if self.rate and op != "generate" and self._rng.random() < self.rate:
            return self._rng.choice(FAULTS)
        return None

    def _age(self) -> None:
        """Drop and tombstone the stashes nobody drove for ``stage_idle_s`` (never unloading: one whose
        end loaded the adapter still loaded is kept)."""
        now = self.clock.monotonic()
        for token, (request, _) in list(self.stashes.items()):
            if now - self.driven.get(token, now) < self.stage_idle_s:
                continue
            if token in self.ended and self.loaded.get(request.lora_name) == request.digest:
                continue
            del self.stashes[token]
            self.driven.pop(token, None)
            self.ended.discard(token)
            self.refused.add(token)
            self.aged.append(token)

    def _drive(self, token: AttemptToken) -> None:
        if token in self.stashes:
            self.driven[token] = self.clock.monotonic()

    async def _call(self, op: str, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        self._age()
        fault = self._fault(op)
        if fault is not None:
            self.injected.append((op, fault))
        if fault == "restart":
            self.restart()
        elif fault == "request":
            raise OutcomeUnknown(f"{self.name} {op}: injected lost request")
        elif fault == "error":
            raise EngineError(f"{self.name} {op}: injected refusal")
        elif fault == "stall":
            await asyncio.Event().wait()  # until the caller's deadline cancels us
        result = await fn(*args)
        if fault == "reply":
            raise OutcomeUnknown(f"{self.name} {op}: injected lost reply")
        return result

    # -- EngineAdmin ---------------------------------------------------------------------
    async def incarnation(self) -> str:
        return await self._call("incarnation", self._incarnation)

    async def _incarnation(self) -> str:
        return self.incarnation_id

    async def limits(self) -> EngineLimits:
        return EngineLimits(self.max_loaded, self.max_per_batch)

    async def inventory(self) -> Inventory:
        return await self._call("incarnation", self._inventory)

    async def _inventory(self) -> Inventory:
        adapters = {name: HeldAdapter(name, self.refs.get(name, 0)) for name in self.loaded}
        # as the patched server's state route: an attempt whose end loaded its adapter is not "staged"
        staged = tuple(StagedAttempt(t, req.lora_name) for t, (req, _) in self.stashes.items() if t not in self.ended)
        return Inventory(self.incarnation_id, adapters, staged, stamps=self.stamps)

    async def begin(self, request: SendBegin) -> str:
        return await self._call("begin", self._begin, request)

    async def _begin(self, request: SendBegin) -> str:
        if request.token in self.refused:
            raise EngineError(f"{self.name}: attempt {request.token} was cleaned up; late begin refused")
        if request.incarnation != self.incarnation_id:
            raise EngineError(f"{self.name}: begin for life {request.incarnation}, engine is {self.incarnation_id}")
        if request.token in self.stashes:
            self._drive(request.token)
            return self.incarnation_id
        if request.lora_name in self.loaded:
            raise EngineError(f"{self.name}: {request.lora_name} is already loaded")
        if len(self.loaded) >= min(self.max_loaded, self.max_per_batch - 1):  # every adapter is pinned
            raise EngineError(f"{self.name}: no free LoRA slot ({len(self.loaded)} of {self.max_loaded} loaded)")
        self.stashes[request.token] = (request, {})
        self._drive(request.token)
        return self.incarnation_id

    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        return await self._call("receive_bucket", self._receive, token, index, payload)

    async def _receive(self, token: AttemptToken, index: int, payload: bytes) -> str:
        if token in self.refused or token not in self.stashes:
            raise EngineError(f"{self.name}: no live stash for {token}")
        self.stashes[token][1].setdefault(index, bytes(payload))  # a duplicate stores nothing new
        self._drive(token)
        return self.incarnation_id

    async def end(self, token: AttemptToken) -> ReadyLocal:
        return await self._call("end", self._end, token)

    async def _end(self, token: AttemptToken) -> ReadyLocal:
        if token in self.refused or token not in self.stashes:
            raise EngineError(f"{self.name}: no live stash for {token}")
        request, buckets = self.stashes[token]
        self._drive(token)
        if sorted(buckets) != list(range(len(request.plan))):
            raise EngineError(f"{self.name}: buckets {sorted(buckets)} of {len(request.plan)} arrived")
        self._verify(request, buckets)
        if request.lora_name not in self.loaded:
            previous = list(self.loaded.items())
            swapped = self.swap_weights and previous and previous[-1][1] != request.digest
            self.loaded[request.lora_name] = previous[-1][1] if swapped else request.digest
            # the numbers follow the weights it really serves (the previous version's, when swapped)
            self.numeric[request.lora_name] = (self.numeric[previous[-1][0]] if swapped and previous[-1][0] in self.numeric
                                               else self._stat(request, buckets))
        self.ended.add(token)
        lora_id = hashlib.sha256(f"{self.incarnation_id}/{request.lora_name}".encode()).hexdigest()[:16]
        return ReadyLocal(self.name, token, request.digest, self.incarnation_id, lora_id)

    def _verify(self, request: SendBegin, buckets: dict[int, bytes]) -> None:
        """What the patched SGLang server checks before a load (:mod:`lorapub.sglang_patch.staging`):
        the plan describes the digest, and every tensor of every bucket (a safetensors blob, as
        :meth:`~lorapub.Snapshot.bucket_bytes` makes it) matches its SHA-256 in the plan."""
        try:
            if manifest_digest(request.plan) != request.digest:
                raise Refused(400, "STAGE_DIGEST", f"the plan does not describe {request.digest[:12]}")
            for bucket in request.plan.buckets:
                blob = memoryview(buckets[bucket.index])
                verify_spans(blob, safetensors_layout(blob, bucket), bucket)
        except Refused as e:
            raise EngineError(f"{self.name}: {request.lora_name} refused: {e.message}", engine=self.name) from None

    def _stat(self, request: SendBegin, buckets: dict[int, bytes]) -> float:
        """What the loaded adapter computes with (the test-only scale switch applied)."""
        tensors: dict[str, Any] = {}
        for bucket in request.plan.buckets:
            tensors.update(numeric.blob_tensors(buckets[bucket.index], bucket))
        tensors = numeric.apply_scale(tensors, numeric.scale_setting(self.scale_tensor))
        return numeric.adapter_stat(tensors, json.loads(request.plan.serving_config_json))

    def drift(self, lora_name: str, factor: float) -> None:
        """Test aid: the loaded adapter computes differently from now on (what the canary catches)."""
        self.numeric[lora_name] *= factor

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        return await self._call("cleanup", self._cleanup, token, lora_name)

    async def _cleanup(self, token: AttemptToken, lora_name: str) -> str:
        self.refused.add(token)
        self.driven.pop(token, None)
        self.ended.discard(token)
        request = self.stashes.pop(token, (None,))[0]
        # Unload only what this attempt loaded (a re-provisioning attempt shares the name).
        if request is not None and self.loaded.get(lora_name) == request.digest and lora_name not in self.unregistered:
            await self._unload(lora_name)
        return self.incarnation_id

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        return await self._call("reclaim", self._unload, lora_name)

    async def _unload(self, lora_name: str) -> None:
        if lora_name not in self.loaded:
            return  # an earlier unload whose reply was lost, or never loaded here
        self.unregistered.add(lora_name)
        life = self.life
        while self.refs.get(lora_name, 0) > 0:
            await asyncio.sleep(0.001)
            if self.life != life:
                return  # the restart dropped it anyway
        self.numeric.pop(lora_name, None)
        if self.loaded.pop(lora_name, None) is not None:
            self.unloads[lora_name] = self.unloads.get(lora_name, 0) + 1
        self.unregistered.discard(lora_name)

    async def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        name = payload.get("lora_path")
        if not name:
            raise InvalidInput("lorapub never sends a generation without its bound lora_path")
        fault = self._fault("generate")
        if fault is not None:
            self.injected.append(("generate", fault))
        if fault == "restart":
            self.restart()
        elif fault == "request":
            raise OutcomeUnknown(f"{self.name} generate: injected lost request")
        elif fault == "error":
            raise EngineError(f"{self.name} generate: injected refusal")
        self.requests += 1
        if not self.serves(name):
            raise VersionMissing(f"{self.name} does not hold {name}", engine=self.name)
        life = self.incarnation_id
        if self._dead is None:
            self._dead = asyncio.Event()
        dead = self._dead
        self.refs[name] = self.refs.get(name, 0) + 1
        seconds = self.generate_seconds or payload.get("sampling_params", {}).get("max_new_tokens", 0) / 1000
        try:
            if seconds:
                try:
                    async with asyncio.timeout(seconds):
                        await dead.wait()
                except TimeoutError:
                    pass
            if dead.is_set():
                raise OutcomeUnknown(f"{self.name} restarted while running the request")
        finally:
            if self.incarnation_id == life:
                self.refs[name] -= 1
        self.generations.append((life, name))
        if fault in ("reply", "stall"):
            raise OutcomeUnknown(f"{self.name} generate: injected lost reply")
        meta: dict[str, Any] = {"lora_path": name, "engine": self.name, "incarnation": life}
        if self.stamps and life == self.incarnation_id and name in self.loaded:
            lora_id = hashlib.sha256(f"{life}/{name}".encode()).hexdigest()[:16]
            meta["lorapub"] = {"lora_name": name, "digest": self.loaded[name], "engine": self.name,
                               "incarnation": life, "lora_id": lora_id}
        ids = payload.get("input_ids")
        if payload.get("return_logprob") and isinstance(ids, list) and name in self.numeric:
            # SGLang's shape: (logprob, token_id, None) per input token from logprob_start_len; the first has none
            scores = [None, *numeric.model_logprobs(self.numeric[name], ids)]
            meta["input_token_logprobs"] = [(lp, int(t), None) for lp, t in zip(scores, ids)]
        return {"text": "ok", "meta_info": meta}


class MemoryUnderTest:
    """:class:`MemoryEngine` as :func:`~lorapub.testing.check_engine_admin` drives it."""

    def __init__(self, name: str = "e0") -> None:
        self.admin = self.engine = MemoryEngine(name)

    @classmethod
    async def start(cls, name: str = "e0") -> "MemoryUnderTest":
        return cls(name)

    async def served(self) -> set[str]:
        return {n for n in self.engine.loaded if self.engine.serves(n)}

    def physical_unloads(self, lora_name: str) -> int:
        return self.engine.unloads.get(lora_name, 0)

    def native_refs(self, lora_name: str) -> int:
        return self.engine.refs.get(lora_name, 0)

    def generate_requests(self) -> int:
        return self.engine.requests

    def generation(self, lora_name: str, *, long: bool = False) -> dict[str, Any]:
        return {"input_ids": [1, 2, 3], "lora_path": lora_name,
                "sampling_params": {"max_new_tokens": 300 if long else 4, "temperature": 0}}

    def fail_next(self, op: str) -> None:
        self.engine.fail_next("end" if op == "load" else op, "error")

    def drop_next_reply(self, op: str) -> None:
        self.engine.fail_next("end" if op == "load" else op, "reply")

    def restart(self) -> None:
        self.engine.restart()

    async def close(self) -> None:
        pass
