"""The publisher-side staging verifies numpy snapshots with numpy alone and bfloat16 ones through torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lorapub.adapters.staging import Staging
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.runtime.snapshot import Snapshot
from lorapub.testing import peft_config


def stage(tmp_path, snap: Snapshot) -> tuple[Staging, SendBegin]:
    staging = Staging("e0", str(tmp_path))
    token = AttemptToken(VersionKey(1, "A"), 1)
    plan = snap.plan(256)
    request = SendBegin("e0", "life0", token, lora_name_for(token.version, snap.digest), snap.digest, plan)
    staging.prepare(request, "life0")
    for i in range(len(plan.buckets)):
        staging.store_bucket(token, i, snap.bucket_bytes(plan, i))
    return staging, request


def test_a_bfloat16_snapshot_verifies_through_torch(tmp_path):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    tensors = {f"base_model.model.layers.0.q_proj.lora_{ab}.weight": torch.randn((2, 8), generator=g).to(torch.bfloat16)
               for ab in "AB"}
    staging, request = stage(tmp_path, Snapshot(tensors, peft_config(2)))
    path = staging.assemble(request)
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_numpy_snapshot_verifies_without_importing_torch(tmp_path):
    code = (
        "import sys\n"
        "from lorapub.testing import lora_snapshot\n"
        "from tests.unit.test_staging_frameworks import stage\n"
        "import pathlib\n"
        f"staging, request = stage(pathlib.Path({str(tmp_path)!r}), lora_snapshot(3, layers=2, hidden=8, rank=2))\n"
        "staging.assemble(request)\n"
        "print('torch' in sys.modules)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), root])}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
