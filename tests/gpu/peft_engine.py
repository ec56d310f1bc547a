"""A real-numerics engine for the acceptance runs: a HF Qwen3 with PEFT adapters on one device.

It implements lorapub's EngineAdmin port the way SGLang's contract does: fresh
``lora_id`` per load, native per-request refcount, reclaim waits for refs 0 and
unloads once, a prefix KV cache keyed by ``lora_id`` (``key_includes_lora=False``
is the broken cache, kept as a negative control), no implicit reload, version
errors for a missing exact name. Requests run one at a time (one model, one
active adapter), which is all the numerics need.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import uuid
from typing import Any, Mapping

import torch

from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.errors import EngineError, VersionMissing
from lorapub.snapshot import Snapshot, load_safetensors


class PeftEngine:
    def __init__(self, name: str, base_dir: str, stash_dir: str, *, device: str, dtype=torch.bfloat16,
                 score_ids: list[int], key_includes_lora: bool = True) -> None:
        from transformers import Qwen3ForCausalLM

        self.name = name
        self.device = device
        self.model = Qwen3ForCausalLM.from_pretrained(base_dir, torch_dtype=dtype).to(device).eval()
        self.stash = os.path.join(stash_dir, name)
        self.score_ids = torch.tensor(score_ids, device=device)
        self.key_includes_lora = key_includes_lora
        self._incarnation = f"{name}-{uuid.uuid4().hex[:8]}"
        self.adapters: dict[str, str] = {}  # lora_name -> lora_id
        self.refs: dict[str, int] = {}
        self.unregistered: set[str] = set()
        self._zero = asyncio.Condition()
        self.kv: dict[tuple, Any] = {}  # (namespace, prefix tuple) -> DynamicCache of that prefix
        self.plans: dict[Any, SendBegin] = {}
        self.tombstones: set = set()
        self.fail_end = 0
        self.end_delay = 0.0
        self.unloads: list[str] = []
        self.lock = asyncio.Lock()

    async def incarnation(self) -> str:
        return self._incarnation

    # -- publication -------------------------------------------------------------------
    async def begin(self, request: SendBegin) -> str:
        if request.token in self.tombstones:
            raise EngineError(f"{self.name}: {request.token} was cleaned")
        if request.incarnation != self._incarnation:
            raise EngineError(f"{self.name}: wrong incarnation")
        if len(self.adapters) >= 3:
            raise EngineError(f"{self.name}: no free slot")
        d = os.path.join(self.stash, str(request.token))
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            f.write(request.plan.serving_config_json)
        self.plans[request.token] = request
        return self._incarnation

    async def receive_bucket(self, token, index: int, payload: bytes) -> str:
        if token in self.tombstones or token not in self.plans:
            raise EngineError(f"{self.name}: {token} is not live")
        path = os.path.join(self.stash, str(token), f"bucket-{index:05d}.safetensors")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(payload)
        return self._incarnation

    async def end(self, token) -> ReadyLocal:
        if token in self.tombstones or token not in self.plans:
            raise EngineError(f"{self.name}: {token} is not live")
        if self.end_delay:
            await asyncio.sleep(self.end_delay)
        if self.fail_end:
            self.fail_end -= 1
            raise EngineError(f"{self.name}: injected end failure")
        request = self.plans[token]
        d = os.path.join(self.stash, str(token))
        tensors = {}
        for bucket in request.plan.buckets:
            tensors.update(load_safetensors(os.path.join(d, f"bucket-{bucket.index:05d}.safetensors")))
        snapshot = Snapshot(tensors, json.loads(request.plan.serving_config_json))
        if snapshot.digest != request.digest:
            raise EngineError(f"{self.name}: manifest mismatch")
        adapter_dir = snapshot.save_peft_dir(os.path.join(d, "adapter"))
        async with self.lock:
            self.add_adapter(adapter_dir, request.lora_name)
        self.adapters[request.lora_name] = uuid.uuid4().hex
        self.refs[self.adapters[request.lora_name]] = 0
        return ReadyLocal(self.name, token, request.digest, self._incarnation, self.adapters[request.lora_name])

    def add_adapter(self, adapter_dir: str, name: str) -> None:
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            self.model.load_adapter(adapter_dir, adapter_name=name)
        else:
            self.model = PeftModel.from_pretrained(self.model, adapter_dir, adapter_name=name).eval()

    async def _unload(self, lora_name: str) -> None:
        lora_id = self.adapters.get(lora_name)
        if lora_id is None:
            return
        self.unregistered.add(lora_name)  # no new acquire
        async with self._zero:
            await self._zero.wait_for(lambda: self.refs[lora_id] == 0)  # native wait_for_unload
        async with self.lock:
            self.model.delete_adapter(lora_name)
        del self.adapters[lora_name]
        self.unloads.append(lora_name)
        self.kv = {k: v for k, v in self.kv.items() if k[0] != lora_id}

    async def cleanup(self, token, lora_name: str) -> str:
        self.tombstones.add(token)
        self.plans.pop(token, None)
        await self._unload(lora_name)
        shutil.rmtree(os.path.join(self.stash, str(token)), ignore_errors=True)
        return self._incarnation

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        await self._unload(lora_name)

    # -- serving -------------------------------------------------------------------------
    def _lookup(self, namespace: str, ids: list[int]):
        """Longest stored prefix of ``ids[:-1]`` in this namespace (whole entries, like radix nodes)."""
        best, cache = 0, None
        for (ns, seq), value in self.kv.items():
            if ns == namespace and best < len(seq) <= len(ids) - 1 and tuple(ids[: len(seq)]) == seq:
                best, cache = len(seq), value
        return best, cache

    @torch.no_grad()
    def _run(self, lora_name: str, lora_id: str, ids: list[int], max_new: int) -> dict:
        self.model.set_adapter(lora_name)
        namespace = lora_id if self.key_includes_lora else "<any>"
        cached, cache = self._lookup(namespace, ids)
        past = copy.deepcopy(cache) if cache is not None else None
        if cached < len(ids) - 1:  # prefill what the cache lacks, then keep that prefix's KV
            out = self.model(input_ids=torch.tensor([ids[cached:-1]], device=self.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
            self.kv[(namespace, tuple(ids[:-1]))] = copy.deepcopy(past)
        out = self.model(input_ids=torch.tensor([ids[-1:]], device=self.device), past_key_values=past, use_cache=True)
        logp = torch.log_softmax(out.logits[0, -1].float(), -1)
        scores = logp[self.score_ids].tolist()
        past, generated, gen_logprobs = out.past_key_values, [], []
        for _ in range(max_new):
            tok = int(torch.argmax(logp))
            generated.append(tok)
            gen_logprobs.append(float(logp[tok]))
            out = self.model(input_ids=torch.tensor([[tok]], device=self.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
        return {"output_ids": generated, "meta_info": {"lora_id": lora_id, "cached_tokens": cached,
                                                         "scores": scores, "output_token_logprobs": gen_logprobs}}

    async def generate(self, payload: Mapping[str, Any]) -> dict:
        name = payload.get("lora_path")
        if name not in self.adapters or name in self.unregistered:
            raise VersionMissing(f"{self.name} does not hold {name}; no fallback, no reload")
        lora_id = self.adapters[name]
        self.refs[lora_id] += 1  # acquire
        try:
            async with self.lock:
                return self._run(name, lora_id, list(payload["input_ids"]),
                                 int((payload.get("sampling_params") or {}).get("max_new_tokens", 4)))
        finally:
            async with self._zero:  # release exactly once
                self.refs[lora_id] -= 1
                self._zero.notify_all()
