"""The engine-side staging (what the engine adapter's buckets land in) verifies numpy snapshots with
numpy alone and bfloat16 ones through torch, and loads them as a PEFT folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.snapshot import Snapshot
from lorapub.testing import peft_config

#: Stages a numpy snapshot in the engine-side staging as lorapub's engine adapter sends it (each
#: bucket streamed raw from the snapshot), ends it with a folder load, and says whether torch was imported.
NUMPY_STAGING = """
import asyncio, os, sys
from lorapub.adapters.sglang_wire import RawBucket
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.sglang_patch import staging as es
from lorapub.testing import lora_snapshot
from lorapub.wire.codec import plan_to_json, token_params, token_to_json

class Hooks:
    loaded = {}
    def adapters(self):
        return {n: {"lora_id": "id-" + n, "pinned": True, "lora_path": p} for n, p in self.loaded.items()}
    def max_loaded_loras(self):
        return 3
    async def load_dir(self, lora_name, path):
        self.loaded[lora_name] = path
        assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
        return None

async def chunks(bucket):
    for view in bucket.views():
        yield bytes(view)

async def main(root):
    snap = lora_snapshot(3, layers=2, hidden=8, rank=2)
    key = VersionKey(1, "A")
    token, plan = AttemptToken(key, 1), snap.plan(256)
    staging = es.EngineStaging(Hooks(), incarnation="life0", stash_root=root)
    body = {"token": token_to_json(token), "incarnation": "life0", "lora_name": lora_name_for(key, snap.digest),
            "digest": snap.digest, "plan": plan_to_json(plan), "transport": {"kind": "http"}, "load": "dir"}
    assert (await staging.begin(body))[0] == 200
    for b in plan.buckets:
        params = {**token_params(token), "index": str(b.index), "incarnation": "life0", "format": "raw"}
        status, answer = await staging.receive(params, chunks(RawBucket(snap, b)), b.nbytes)
        assert status == 200, answer
    status, receipt = await staging.end({"token": body["token"], "incarnation": "life0"})
    assert status == 200 and receipt["digest"] == snap.digest, receipt
    print("torch" in sys.modules)

asyncio.run(main(sys.argv[1]))
"""


async def test_a_bfloat16_snapshot_verifies_through_torch_and_loads_as_a_folder(tmp_path):
    torch = pytest.importorskip("torch")
    from lorapub.adapters.sglang_wire import SGLangWireEngine
    from lorapub.testing import SGLangDouble

    g = torch.Generator().manual_seed(0)
    tensors = {f"base_model.model.layers.0.q_proj.lora_{ab}.weight": torch.randn((2, 8), generator=g).to(torch.bfloat16)
               for ab in "AB"}
    snap = Snapshot(tensors, peft_config(2))
    double = SGLangDouble("e0")
    double.stash_root = str(tmp_path / "disk")
    await double.start()
    engine = SGLangWireEngine("e0", double.url)
    try:
        token = AttemptToken(VersionKey(1, "A"), 1)
        plan = snap.plan(256)
        name = lora_name_for(token.version, snap.digest)
        inc = await engine.begin(SendBegin("e0", await engine.incarnation(), token, name, snap.digest, plan))
        for i in range(len(plan.buckets)):
            assert await engine.receive_bucket(token, i, snap.bucket_bytes(plan, i)) == inc
        ready = await engine.end(token)
        assert ready.digest == snap.digest
        path = double.lora_registry.get_all_adapters()[name].lora_path
        assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]
    finally:
        await engine.close()
        await double.stop()


def test_a_numpy_snapshot_verifies_without_importing_torch(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), root])}
    out = subprocess.run([sys.executable, "-c", NUMPY_STAGING, str(tmp_path)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
