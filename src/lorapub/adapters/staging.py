"""The engine-side staging protocol, for any engine adapter.

An attempt stages its buckets in a stash directory of its own:
``begin`` fixes the plan and writes the serving config, ``receive_bucket``
stores each bucket once (a duplicate stores nothing), ``end`` verifies every
bucket and the whole manifest digest before anything is loaded, ``cleanup``
tombstones the attempt (begin/receive/end of it are refused from then on) and
removes the stash. One operation per attempt runs at a time, so a cleanup
waits for an in-flight ``end`` instead of racing it.

Adapters (the SGLang HTTP one, or any engine that loads from a directory) add only what
their engine does with the verified directory: load it, probe it, unload it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from typing import Any

from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken
from lorapub.errors import EngineError
from lorapub.runtime.snapshot import Snapshot, load_safetensors


class Staging:
    def __init__(self, engine: str, stash_root: str) -> None:
        self.engine = engine
        self.stash_root = stash_root
        self._plans: dict[AttemptToken, tuple[SendBegin, str]] = {}
        self._tombstones: set[AttemptToken] = set()
        self._locks: dict[AttemptToken, asyncio.Lock] = {}

    def stash(self, token: AttemptToken) -> str:
        return os.path.join(self.stash_root, f"{token.version}-a{token.seq}")

    def lock(self, token: AttemptToken) -> asyncio.Lock:
        """One operation per attempt at a time (else a load could land after its cleanup)."""
        return self._locks.setdefault(token, asyncio.Lock())

    def refused(self, token: AttemptToken) -> bool:
        return token in self._tombstones

    def begun(self, token: AttemptToken) -> bool:
        return token in self._plans

    def live(self, token: AttemptToken) -> tuple[SendBegin, str]:
        """The begin request and incarnation of a live attempt; a definite no otherwise."""
        if token in self._tombstones:
            raise EngineError(f"{self.engine}: attempt {token} was cleaned up; refusing to recreate it")
        found = self._plans.get(token)
        if found is None:
            raise EngineError(f"{self.engine}: attempt {token} was never begun here")
        return found

    def prepare(self, request: SendBegin, incarnation: str) -> None:
        """A fresh stash with the serving config; the attempt is live from now on."""
        if request.token in self._tombstones:
            raise EngineError(f"{self.engine}: attempt {request.token} was cleaned up; late begin refused")
        stash = self.stash(request.token)
        shutil.rmtree(stash, ignore_errors=True)
        os.makedirs(stash)
        with open(os.path.join(stash, "adapter_config.json"), "w") as f:
            f.write(request.plan.serving_config_json)
        self._plans[request.token] = (request, incarnation)

    def store_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        """Store bucket ``index`` once (write-then-rename); returns the attempt's incarnation."""
        _, inc = self.live(token)
        path = os.path.join(self.stash(token), f"bucket-{index:05d}.safetensors")
        if not os.path.exists(path):  # a duplicate receive stores nothing twice
            tmp = path + ".part"
            with open(tmp, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
        return inc

    def assemble(self, request: SendBegin) -> str:
        """Verify every bucket and the whole manifest, then write the PEFT dir an engine loads."""
        stash = self.stash(request.token)
        tensors: dict[str, Any] = {}
        for bucket in request.plan.buckets:
            path = os.path.join(stash, f"bucket-{bucket.index:05d}.safetensors")
            if not os.path.exists(path):
                raise EngineError(f"{self.engine}: bucket {bucket.index} of {request.token} never arrived")
            got = load_safetensors(path)
            if sorted(got) != sorted(bucket.tensor_names):
                raise EngineError(f"{self.engine}: bucket {bucket.index} holds {sorted(got)}")
            tensors.update(got)
        with open(os.path.join(stash, "adapter_config.json")) as f:
            config = json.load(f)
        snapshot = Snapshot(tensors, config)
        if snapshot.digest != request.digest:
            raise EngineError(f"{self.engine}: manifest digest {snapshot.digest[:12]} != {request.digest[:12]}")
        return snapshot.save_peft_dir(os.path.join(stash, "adapter"))

    def refuse(self, token: AttemptToken) -> None:
        """Tombstone the attempt: begin/receive/end of it are refused from now on."""
        self._tombstones.add(token)

    def forget(self, token: AttemptToken) -> None:
        """Forget the attempt's plan (it is refused from now on anyway)."""
        self._plans.pop(token, None)

    def remove(self, token: AttemptToken) -> None:
        """Remove the stash (after the engine dropped any load of it)."""
        shutil.rmtree(self.stash(token), ignore_errors=True)
