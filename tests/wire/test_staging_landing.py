"""Where the engine-side staging puts a bucket's bytes (lorapub.sglang_patch.staging).

* a ``dir`` load receives every bucket straight into the adapter's safetensors file on the engine's
  disk and verifies it there: once the last bucket is checked the file is complete, and ``end`` adds
  only the config before the load;
* a ``tensors`` load over same-host IPC hands SGLang the publisher's shared-memory pages themselves
  (no engine-side copy), as a storage torch shares by file descriptor;
* bytes that do not verify are refused and never loaded, whatever the landing.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import uuid

import pytest

from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.snapshot import Snapshot
from lorapub.sglang_patch import staging as es
from lorapub.wire.codec import json_bytes, plan_to_json, token_params, token_to_json
from lorapub.wire.safetensors import safetensors_header

torch = pytest.importorskip("torch")

from tests.sglang_patch.test_engine_staging import bf16_snapshot  # noqa: E402
LIFE = "life-1"


class Hooks:
    """A minimal engine: loads are recorded (a dir load reads the folder back, as a loader would)."""

    def __init__(self) -> None:
        self.loaded: dict[str, dict] = {}
        self.folders: dict[str, dict[str, bytes]] = {}
        self.tensors: dict[str, dict] = {}

    def adapters(self):
        return {n: {"lora_id": f"id-{n}", "pinned": True, "lora_path": a["path"]} for n, a in self.loaded.items()}

    def max_loaded_loras(self):
        return 3

    async def load_dir(self, lora_name, path):
        self.folders[lora_name] = {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}
        self.loaded[lora_name] = {"path": path}
        return None

    async def load_tensors(self, lora_name, tensors, config, checksums):
        import torch.multiprocessing  # noqa: F401 - torch's reductions, as SGLang's serializer uses them
        from multiprocessing.reduction import ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(tensors)  # shareable with SGLang's scheduler, as SGLang sends it
        self.tensors[lora_name] = {n: t.clone() for n, t in tensors.items()}
        self.loaded[lora_name] = {"path": "__tensor__"}
        return None


def snapshot(seed: int) -> Snapshot:
    return bf16_snapshot(seed, layers=3, hidden=64)  # several 1 KiB buckets


def begin_body(snap: Snapshot, load: str, kind: str = "http"):
    key = VersionKey(1, "A")
    token = AttemptToken(key, 1)
    plan = snap.plan(1024)
    body = {"token": token_to_json(token), "incarnation": LIFE, "lora_name": lora_name_for(key, snap.digest),
            "digest": snap.digest, "plan": plan_to_json(plan), "transport": {"kind": kind}, "load": load}
    return token, plan, body


def raw(snap: Snapshot, bucket) -> bytes:
    from lorapub.adapters.sglang_wire import RawBucket

    return b"".join(bytes(v) for v in RawBucket(snap, bucket).views())


def params(token, index: int, fmt: str = "raw") -> dict:
    return {**token_params(token), "index": str(index), "incarnation": LIFE, "format": fmt}


async def chunks_of(*parts):
    for p in parts:
        yield p


async def test_a_dir_load_receives_each_bucket_into_the_adapters_file_and_end_only_adds_the_config(tmp_path):
    hooks = Hooks()
    staging = es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"))
    snap = snapshot(1)
    token, plan, body = begin_body(snap, "dir")
    assert len(plan.buckets) > 2
    assert (await staging.begin(body))[0] == 200
    attempt = staging._stashes[token]
    file = attempt.peft[0]
    entries = [e for b in plan.buckets for e in b.entries]
    header = safetensors_header(entries)
    for b in plan.buckets:
        blob = raw(snap, b)
        status, answer = await staging.receive(params(token, b.index), chunks_of(blob[:5], blob[5:]), len(blob))
        assert status == 200, answer
        assert attempt.buckets[b.index][0].in_file  # received into the file itself, not a buffer beside it
    await asyncio.gather(*attempt.verifying.values())
    # before end: the file is the complete safetensors file, the config not written yet
    with open(file, "rb") as f:
        assert f.read() == header + b"".join(raw(snap, b) for b in plan.buckets)
    assert not os.path.exists(os.path.join(os.path.dirname(file), "adapter_config.json"))
    status, receipt = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200, receipt
    folder = hooks.folders[body["lora_name"]]
    assert json.loads(folder["adapter_config.json"]) == snap.serving_config
    safetensors_torch = pytest.importorskip("safetensors.torch")
    loaded = safetensors_torch.load(folder["adapter_model.safetensors"])
    assert sorted(loaded) == snap.tensor_names and all(torch.equal(loaded[n], snap.tensor(n)) for n in loaded)
    assert staging.report()["bytes"] == 0
    # cleanup removes the folder; a late bucket recreates nothing
    assert (await staging.cleanup({"token": body["token"]}))[0] == 200
    assert not os.path.exists(staging.folder_of(token))
    blob = raw(snap, plan.buckets[0])
    assert (await staging.receive(params(token, 0), chunks_of(blob), len(blob)))[0] == 409
    assert not os.path.exists(staging.folder_of(token))


async def test_a_dir_load_of_safetensors_blobs_lands_in_the_file_once_verified(tmp_path):
    hooks = Hooks()
    staging = es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"))
    snap = snapshot(2)
    token, plan, body = begin_body(snap, "dir")
    assert (await staging.begin(body))[0] == 200
    for b in plan.buckets:
        blob = snap.bucket_bytes(plan, b.index)
        status, answer = await staging.receive(params(token, b.index, "safetensors"), chunks_of(blob), len(blob))
        assert status == 200, answer
    status, receipt = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200, receipt
    safetensors_torch = pytest.importorskip("safetensors.torch")
    loaded = safetensors_torch.load(hooks.folders[body["lora_name"]]["adapter_model.safetensors"])
    assert all(torch.equal(loaded[n], snap.tensor(n)) for n in snap.tensor_names)


@pytest.mark.parametrize("load", ["dir", "tensors"])
async def test_bytes_that_do_not_verify_in_their_landing_are_refused_and_never_loaded(tmp_path, load):
    hooks = Hooks()
    staging = es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"))
    snap = snapshot(3)
    token, plan, body = begin_body(snap, load)
    assert (await staging.begin(body))[0] == 200
    for b in plan.buckets:
        blob = bytearray(raw(snap, b))
        if b.index == 1:
            blob[-1] ^= 0xFF
        assert (await staging.receive(params(token, b.index), chunks_of(bytes(blob)), len(blob)))[0] == 200
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 400 and answer["error"]["code"] == "STAGE_DIGEST", answer
    assert hooks.loaded == {}


async def test_a_tensor_load_over_shared_memory_hands_sglang_the_publishers_pages(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    hooks = Hooks()
    staging = es.EngineStaging(hooks, incarnation=LIFE, stash_root=str(tmp_path / "disk"), shm_dir=str(shm))
    snap = snapshot(4)
    token, plan, body = begin_body(snap, "tensors", kind="shm")
    assert (await staging.begin(body))[0] == 200
    names = []
    for b in plan.buckets:
        name = f"lorapub-{uuid.uuid4().hex}-b{b.index}.bucket"
        (shm / name).write_bytes(raw(snap, b))
        names.append(name)
        status, answer = await staging.receive(params(token, b.index, "shm"), chunks_of(json_bytes({"name": name})))
        assert status == 200, answer
    attempt = staging._stashes[token]
    await asyncio.gather(*attempt.verifying.values())
    buf = attempt.buckets[0][0]
    assert buf.tensor is not None and buf.tensor.is_shared()
    # no copy: a byte changed in the publisher's file shows in the engine's bucket (changed back here)
    first = raw(snap, plan.buckets[0])
    with open(shm / names[0], "r+b") as f:
        f.write(bytes([first[0] ^ 0xFF]))
        f.flush()
        assert buf.view[0] == first[0] ^ 0xFF
        f.seek(0)
        f.write(first[:1])
    for name in names:
        os.unlink(shm / name)  # the publisher removes its file once every engine read it
    assert bytes(buf.view) == first  # still mapped after the file was removed
    status, receipt = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200, receipt
    got = hooks.tensors[body["lora_name"]]
    assert sorted(got) == snap.tensor_names and all(torch.equal(got[n], snap.tensor(n)) for n in got)
    assert os.listdir(shm) == []
