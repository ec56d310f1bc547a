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
from lorapub.core.identity import AttemptToken, VersionKey, check_id
from lorapub.errors import EngineError, InvalidInput
from lorapub.runtime.snapshot import Snapshot, load_safetensors

__all__ = ["Staging"]


def _read_buckets(paths: list[str]) -> list[dict[str, Any]]:
    """Each bucket file's tensors: numpy arrays where numpy holds every dtype (torch is then never
    imported: a CPU-only install without torch stages and loads), else all of them through
    :func:`~lorapub.runtime.snapshot.load_safetensors` (bfloat16 has no numpy dtype; one kind per snapshot)."""
    from safetensors.numpy import load_file

    try:
        return [load_file(path) for path in paths]
    except TypeError:  # "data type 'bfloat16' not understood"
        return [load_safetensors(path) for path in paths]


class Staging:
    """Paths come only from checked values: the stash of an attempt is named from its version
    key (a checked epoch and id) and its sequence number, a bucket file from its plan index;
    every path is also checked to resolve inside ``stash_root``."""

    def __init__(self, engine: str, stash_root: str) -> None:
        if isinstance(stash_root, os.PathLike):
            stash_root = os.fspath(stash_root)
        if not isinstance(stash_root, str) or not stash_root or "\x00" in stash_root:
            raise InvalidInput(f"stash_root must be a directory path, got {stash_root!r}")
        self.engine = engine
        self.stash_root = stash_root
        self._plans: dict[AttemptToken, tuple[SendBegin, str]] = {}
        self._tombstones: set[AttemptToken] = set()
        self._locks: dict[AttemptToken, asyncio.Lock] = {}

    def _inside(self, *parts: str) -> str:
        root = os.path.realpath(self.stash_root)
        path = os.path.realpath(os.path.join(root, *parts))
        if os.path.commonpath([root, path]) != root or path == root:
            raise EngineError(f"{self.engine}: {os.path.join(*parts)!r} would leave the stash {root}; refused")
        return path

    def stash(self, token: AttemptToken) -> str:
        if not isinstance(token, AttemptToken) or not isinstance(token.version, VersionKey):
            raise EngineError(f"{self.engine}: {token!r} is not an attempt token")
        # re-checked here: a token that arrived without its constructor (unpickled) is checked too
        check_id("version_id", token.version.version_id)
        if not isinstance(token.seq, int) or isinstance(token.seq, bool) or token.seq < 0:
            raise EngineError(f"{self.engine}: attempt sequence {token.seq!r} is not a non-negative int")
        if not isinstance(token.version.deployment_epoch, int) or isinstance(token.version.deployment_epoch, bool):
            raise EngineError(f"{self.engine}: epoch {token.version.deployment_epoch!r} is not an int")
        return self._inside(f"{token.version.deployment_epoch}-{token.version.version_id}-a{token.seq}")

    def bucket_path(self, token: AttemptToken, index: object) -> str:
        found = self._plans.get(token)
        count = len(found[0].plan.buckets) if found else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0 or (count is not None and index >= count):
            raise EngineError(f"{self.engine}: bucket index {index!r} is not in the plan of {token}")
        return os.path.join(self.stash(token), f"bucket-{index:05d}.safetensors")

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

    def remove_named(self, lora_name: str) -> list[AttemptToken]:
        """Remove the stash of every attempt that staged ``lora_name`` (its version was reclaimed:
        nothing loads from it again); they stay refused. Returns their tokens."""
        gone = [t for t, (request, _) in self._plans.items() if request.lora_name == lora_name]
        for token in gone:
            self._tombstones.add(token)
            self._plans.pop(token, None)
            shutil.rmtree(self.stash(token), ignore_errors=True)
        return gone

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
        path = self.bucket_path(token, index)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise EngineError(f"{self.engine}: bucket {index} of {token} is a {type(payload).__name__}, not bytes")
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
        try:
            paths = []
            for bucket in request.plan.buckets:
                path = self.bucket_path(request.token, bucket.index)
                if not os.path.exists(path):
                    raise EngineError(f"{self.engine}: bucket {bucket.index} of {request.token} never arrived")
                paths.append(path)
            for bucket, got in zip(request.plan.buckets, _read_buckets(paths)):
                if sorted(got) != sorted(bucket.tensor_names):
                    raise EngineError(f"{self.engine}: bucket {bucket.index} holds {sorted(got)}")
                tensors.update(got)
            with open(os.path.join(stash, "adapter_config.json")) as f:
                config = json.load(f)
            snapshot = Snapshot(tensors, config)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - unreadable bytes or config, a bad snapshot: a definite no
            raise EngineError(f"{self.engine}: the staged adapter of {request.token} does not verify: {e}") from None
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
