"""The engine the SGLang contract double models, without its HTTP: :class:`DoubleEngine` keeps a
server life (SGLang's own ``LoRARegistry``, loads, unloads, LoRA resolution, a prefix cache, the
steps a load holds, lorapub's engine-side staging) and the faults injected into it; outputs are a
deterministic function of (adapter content, tokens).
See docs/testing.md, "`SGLangDouble`: the SGLang contract double".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from lorapub.core.identity import MANAGED_PREFIX
from lorapub.sglang_patch import provenance
from lorapub.sglang_patch import staging as engine_side
from lorapub.sglang_patch.staging.test_switch import scale_for_test
from lorapub.testing import numeric
from lorapub.testing._sglang_registry import lora_registry_module
from lorapub.testing.sglang_double.auth import sglang_decide, decide_request_auth
from lorapub.wire.codec import json_bytes

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["SGLANG_MAX_LORAS_PER_BATCH", "content_signature", "token_logprob", "next_token", "Fault", "DoubleEngine"]

#: SGLang's default ``--max-loras-per-batch`` (its ``--max-loaded-loras`` is unset by default).
SGLANG_MAX_LORAS_PER_BATCH = 8


def content_signature(path: str) -> str:
    """SHA-256 of the adapter folder's files: every byte read, as a loader reads them (mapped, not
    copied into a buffer of their own first)."""
    h = hashlib.sha256()
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        with open(os.path.join(path, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                h.update(m)
    return h.hexdigest()


def token_logprob(signature: str, prefix: list[int], token: int) -> float:
    """Deterministic stand-in for log p(token | prefix) under one adapter."""
    h = hashlib.sha256(f"{signature}|{len(prefix)}|{prefix[-8:]}|{token}".encode()).digest()
    return -(int.from_bytes(h[:4], "big") % 100000) / 10000.0


def next_token(signature: str, prefix: list[int]) -> int:
    h = hashlib.sha256(f"{signature}|next|{prefix[-8:]}|{len(prefix)}".encode()).digest()
    return int.from_bytes(h[:2], "big") % 1000


def _dir_stat(path: str) -> float | None:
    """The stand-in model of an adapter folder, or None."""
    try:
        from safetensors.numpy import load_file

        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        tensors = {n: t.astype("float64") for n, t in load_file(os.path.join(path, "adapter_model.safetensors")).items()}
    except (OSError, ValueError, TypeError):  # bf16 has no numpy dtype: no numeric model for it here
        return None
    # the test-only scale switch already scaled the folder's tensor (lorapub.sglang_patch.staging.test_switch)
    return numeric.adapter_stat(tensors, config)


class _Float64View(Mapping[str, Any]):
    """Torch tensors read as float64 numpy arrays one at a time, with the test-only scale switch applied as
    :func:`numeric.apply_scale` applies it (to the first name, in sorted order, that holds its substring)."""

    def __init__(self, tensors: Mapping[str, Any], setting: tuple[str, float] | None) -> None:
        self.tensors = tensors
        hit = sorted(n for n in tensors if setting is not None and setting[0] in n)
        self.scaled: str | None
        self.factor: float
        self.scaled, self.factor = (hit[0], setting[1]) if hit and setting is not None else (None, 1.0)

    def __getitem__(self, name: str) -> Any:
        import torch

        values = self.tensors[name].to(dtype=torch.float64).numpy()
        return values * self.factor if name == self.scaled else values

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class Fault:
    def __init__(self, mode: str, count: int, delay: float, status: int) -> None:
        self.mode, self.count, self.delay, self.status = mode, count, delay, status


class DoubleEngine:
    """The engine behind :class:`~lorapub.testing.sglang_double.SGLangDouble`, which adds its HTTP
    server; its options are described there."""

    # Unset unless a test sets them before the first staging call (see ``staging``; read from __dict__).
    stash_root: str | None
    shm_dir: str | None
    stage_idle_s: float | None

    def __init__(
        self,
        name: str,
        *,
        max_loaded_loras: int | None = None,
        max_loras_per_batch: int | None = None,
        context_len: int = 4096,
        managed_prefix: str = MANAGED_PREFIX,
        managed_patch: bool = True,
        decode_delay: float = 0.002,
        load_delay: float = 0.0,
        prefill_per_token: float = 0.0,
        blocking_load: bool = False,
        install_stop: float = 0.0,
        first_use_stop: float = 0.0,
        stock: bool = False,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        served_model_name: str = "lorapub-tiny-qwen3",
    ) -> None:
        self.name = name
        # SGLang's server_args defaults: --max-loras-per-batch 8, --max-loaded-loras unset (no limit);
        # given only max_loaded_loras below 8, the batch slots follow it (SGLang would refuse to start)
        if max_loras_per_batch is None:
            max_loras_per_batch = SGLANG_MAX_LORAS_PER_BATCH if max_loaded_loras is None else min(
                SGLANG_MAX_LORAS_PER_BATCH, max_loaded_loras)
        if max_loaded_loras is not None and max_loaded_loras < max_loras_per_batch:
            raise ValueError(f"max_loaded_loras ({max_loaded_loras}) should be greater than or equal to "
                             f"max_loras_per_batch ({max_loras_per_batch}), as SGLang requires")
        self.max_loaded_loras = max_loaded_loras
        self.max_loras_per_batch = max_loras_per_batch
        self.managed_prefix = managed_prefix  # the names its patch protects (SGLANG_LORAPUB_MANAGED_PREFIX)
        self.context_len = context_len
        self.stock = stock
        self.managed_patch = managed_patch and not stock
        self.served_model_name = served_model_name
        self._api_key, self._admin_api_key = api_key, admin_api_key
        self._decide = sglang_decide() or decide_request_auth
        self.refused: list[tuple[str, str, int]] = []  # (method, path, status) turned away at the door
        self.decode_delay = decode_delay
        self.load_delay = load_delay  # simulated adapter load + GPU preparation time
        self.prefill_per_token = prefill_per_token  # uncached prompt tokens cost prefill time
        self.blocking_load = blocking_load  # a load holds this engine's batches (SGLang's scheduler)
        self.install_stop = install_stop  # every step waits this long once a load is done
        self.first_use_stop = first_use_stop  # ... and this long at an adapter's first step
        self._slot_filled: set[str] = set()  # adapters whose first step ran
        self.faults: dict[str, Fault] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.events: list[tuple[str, str]] = []
        self.generations = 0  # generations that ran to the end
        self.generate_requests = 0  # /generate requests that reached the engine, whatever became of them
        registry = lora_registry_module()
        self._LoRARegistry, self._LoRARef = registry.LoRARegistry, registry.LoRARef
        self._boot()

    # -- process life --------------------------------------------------------
    def _boot(self) -> None:
        self.incarnation = f"{self.name}-{uuid.uuid4().hex[:8]}"
        self.lora_registry = self._LoRARegistry()
        self.ref_cache: dict[str, Any] = {}
        self.pending_unloads: dict[str, str] = {}
        self.update_lock = asyncio.Lock()
        self.loaded: dict[str, str] = {}  # lora_id -> content signature (the "GPU pool")
        self.numeric: dict[str, float] = {}  # lora_id -> its stand-in model (lorapub.testing.numeric)
        self.prefix_cache: dict[str, list[tuple[int, ...]]] = {}
        self.paused = asyncio.Event()
        self.paused.set()
        self.not_loading = asyncio.Event()  # cleared while a blocking load (or a modelled stop) holds the batches
        self.not_loading.set()
        self._holds = 0
        self.abort_gen = 0  # bumped by pause_generation(mode="abort"): running requests end aborted
        self.running_rids: set[str] = set()  # rids of /generate requests running now
        self.aborted_rids: set[str] = set()  # ... of which /abort_request asked these to end
        self.physical_unloads: list[str] = []

    def restart(self) -> None:
        """A crash and restart: every adapter, counter and cache is gone; new incarnation."""
        self._boot()
        self.events.append(("restart", self.incarnation))

    def __repr__(self) -> str:
        return f"SGLangDouble({self.name!r}, url={self.url!r}, stock={self.stock})"  # never the keys

    # -- faults ----------------------------------------------------------------
    def inject(self, op: str, mode: str = "error", count: int = 1, delay: float = 0.0, status: int = 500) -> None:
        """mode: error (definite failure), drop (do it, never answer), hang (never answer), slow."""
        self.faults[op] = Fault(mode, count, delay, status)

    def _fault(self, op: str) -> Fault | None:
        f = self.faults.get(op)
        if f is None or f.count == 0:
            return None
        f.count -= 1
        return f

    # -- loads, unloads and the steps a load holds ---------------------------------
    def _hold_steps(self) -> asyncio.Event:
        """Stop every step until the matching :meth:`_release_steps`; returns this incarnation's gate."""
        self._holds += 1
        self.not_loading.clear()
        return self.not_loading

    def _release_steps(self, gate: asyncio.Event) -> None:
        if gate is not self.not_loading:  # taken before a restart: that incarnation's gate is gone
            return
        self._holds -= 1
        if not self._holds:
            self.not_loading.set()

    async def _stop_steps(self, seconds: float) -> None:
        """No prefill or decode step starts on this engine for ``seconds``."""
        gate = self._hold_steps()
        try:
            await asyncio.sleep(seconds)
        finally:
            self._release_steps(gate)

    async def _load(self, lora_name: str, lora_path: str, pinned: bool, signature: str | None = None,
                    stat: float | None = None) -> dict[str, Any]:
        if lora_name in self.pending_unloads:
            raise ValueError(f"LoRA adapter '{lora_name}' has an incomplete unload.")
        gate = self._hold_steps() if self.blocking_load else None  # callers hold update_lock: one load at a time
        try:
            if signature is None:  # from tensors: the caller computed it
                signature = await asyncio.to_thread(content_signature, lora_path)  # raises on a bad path, like the real loader
            if self.load_delay:
                await asyncio.sleep(self.load_delay)
            if self.install_stop:
                await self._stop_steps(self.install_stop)
            pinned_now = sum(1 for r in self.lora_registry.get_all_adapters().values() if r.pinned)
            if pinned and pinned_now >= self.max_loras_per_batch - 1:  # SGLang's LoRAManager.validate_new_adapter
                raise ValueError(
                    f"Failed to load LoRA adapter {lora_name} as a pinned adapter. It is not allowed to pin all slots "
                    "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
                )
            ref = self._LoRARef(lora_name=lora_name, lora_path=lora_path, pinned=pinned)
            await self.lora_registry.register(ref)  # "already exists" -> ValueError
            self.loaded[ref.lora_id] = signature
            if stat is None and lora_path != "__tensor__":
                stat = await asyncio.to_thread(_dir_stat, lora_path)
            if stat is not None:
                self.numeric[ref.lora_id] = stat
            self.ref_cache[lora_name] = ref
            self.events.append(("load", lora_name))
        finally:
            if gate is not None:
                self._release_steps(gate)
        while self.max_loaded_loras is not None and self.lora_registry.num_registered_loras > self.max_loaded_loras:
            lru = await self.lora_registry.lru_lora_name(exclude_pinned=True)
            if lru is None:
                raise ValueError("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter.")
            await self._unload_locked(lru)
        return {n: r.lora_path for n, r in self.lora_registry.get_all_adapters().items()}

    async def _unload_locked(self, lora_name: str) -> None:
        lora_id = self.pending_unloads.get(lora_name)
        if lora_id is None:
            lora_id = await self.lora_registry.unregister(lora_name)
            self.pending_unloads[lora_name] = lora_id
        await self.lora_registry.wait_for_unload(lora_id)
        f = self.faults.get("unload_slow")
        if f is not None:
            await asyncio.sleep(f.delay)
        self.loaded.pop(lora_id, None)
        self.numeric.pop(lora_id, None)
        self.prefix_cache.pop(lora_id, None)
        self.physical_unloads.append(lora_name)
        self.events.append(("unload", lora_name))
        self.pending_unloads.pop(lora_name)

    @property
    def is_paused(self) -> bool:
        """Whether generation stands paused (a pause without its continue)."""
        return not self.paused.is_set()

    # -- generation --------------------------------------------------------------
    async def _resolve(self, name: str) -> str:
        if name not in self.lora_registry.get_all_adapters():
            if name not in self.ref_cache:
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}")
            if self.managed_patch and name.startswith(self.managed_prefix):
                raise ValueError(f"LoRA adapter {name} is managed and not loaded; implicit reload refused")
            ref = self.ref_cache[name]
            async with self.update_lock:  # the unpatched hazard: a fresh lora_id behind lorapub's back
                try:
                    await self._load(ref.lora_name, ref.lora_path, bool(ref.pinned))
                except OSError as e:  # live SGLang answers 400 when the adapter's files are gone
                    raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
            self.events.append(("implicit_reload", name))
        lora_id: str = await self.lora_registry.acquire(name)  # SGLang's own registry: Any to mypy
        return lora_id

    def _cached_tokens(self, lora_id: str | None, ids: list[int]) -> int:
        best = 0
        for seq in self.prefix_cache.get(lora_id or "<base>", []):
            n = 0
            for a, b in zip(seq, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    # -- lorapub's engine-side staging (its routes, those lorapub's SGLang patch adds, are the server's) --
    # The same code the patched server runs (lorapub.sglang_patch.staging), with this double
    # as its engine: a load from a staged folder or from tensors goes through the double's own load.
    # Set ``stash_root``, ``shm_dir`` or ``stage_idle_s`` (seconds an undriven attempt is kept) on
    # the double before its first staging call to stage elsewhere or age attempts out sooner.
    @property
    def staging(self) -> engine_side.EngineStaging:
        current = self.__dict__.get("_staging")
        if current is None or current.incarnation != self.incarnation:  # a new life stages afresh
            if current is not None:
                current.close()
            current = self.__dict__["_staging"] = engine_side.EngineStaging(
                _DoubleHooks(self), incarnation=self.incarnation,
                stash_root=self.__dict__.get("stash_root"), shm_dir=self.__dict__.get("shm_dir"),
                idle_timeout=self.__dict__.get("stage_idle_s"),  # None: LORAPUB_STAGE_IDLE_S, as the server
                # the numeric gate's test switch, read at each load (a test may set it mid-life)
                before_dir_load=scale_for_test,
            )
            if self.__dict__.get("swap_weights"):  # TEST-ONLY: serve each new version with the last one's weights
                current.swap_weights = True
        return current

    def stamp(self, lora_name: object, lora_id: object) -> dict[str, Any] | None:
        """The provenance stamp lorapub's patch puts in ``meta_info`` (None: no patch, or not managed)."""
        if not self.managed_patch:
            return None
        return provenance.stamp(lora_name, lora_id, self.staging, self.name, self.managed_prefix)

    # -- introspection for tests ----------------------------------------------------
    def refs(self, name: str) -> int | None:
        ref = self.lora_registry.get_all_adapters().get(name)
        if ref is None:
            return None
        count: int = self.lora_registry._counters[ref.lora_id].value()  # SGLang's ConcurrentCounter
        return count

    def registered(self) -> list[str]:
        return list(self.lora_registry.get_all_adapters())


class _DoubleHooks:
    """The double as the engine of :class:`~lorapub.sglang_patch.staging.EngineStaging`."""

    def __init__(self, double: DoubleEngine) -> None:
        self.double = double

    def adapters(self) -> dict[str, dict[str, Any]]:
        return {n: {"lora_id": r.lora_id, "pinned": bool(r.pinned), "lora_path": r.lora_path}
                for n, r in self.double.lora_registry.get_all_adapters().items()}

    def max_loaded_loras(self) -> int | None:
        return self.double.max_loaded_loras

    def managed_prefix(self) -> str:
        return self.double.managed_prefix

    async def _load(self, lora_name: str, lora_path: str, signature: str | None, stat: float | None = None) -> str | None:
        try:
            async with self.double.update_lock:
                await self.double._load(lora_name, lora_path, True, signature, stat)
        except (ValueError, OSError) as e:
            return str(e)
        return None

    async def load_dir(self, lora_name: str, path: str) -> str | None:
        return await self._load(lora_name, path, None)

    async def load_tensors(self, lora_name: str, tensors: dict[str, Any], config: dict[str, Any],
                           checksums: dict[str, str]) -> str | None:
        def signature() -> str:  # what SGLang's ranks check (expected_checksums), then the content
            import torch

            h = hashlib.sha256()
            for name in sorted(tensors):
                raw = tensors[name].reshape(-1).view(torch.uint8).numpy()
                got = hashlib.sha256(raw).hexdigest()
                if got != checksums.get(name):
                    raise ValueError(f"[LORA-CHECK] adapter sync MISMATCH: {name}")
                # the content's identity from each tensor's checked digest: one pass over the bytes
                h.update(name.encode() + b"\0" + got.encode())
            h.update(json_bytes(config))
            return h.hexdigest()

        def stat() -> float:
            # the stand-in model reads each tensor once: one float64 tensor at a time, never a float64 copy of
            # the whole adapter (4 times a bf16 adapter's bytes in fresh pages, which made this load the
            # slowest part of a same-host publication)
            return numeric.adapter_stat(_Float64View(tensors, numeric.scale_setting()), config)

        try:
            sig = await asyncio.to_thread(signature)
        except ValueError as e:
            return str(e)
        return await self._load(lora_name, "__tensor__", sig, await asyncio.to_thread(stat))
