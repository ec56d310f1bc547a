"""The public types print what an operator needs to tell them apart, never an address or a key."""

from __future__ import annotations

import re

from lorapub import Deployment
from lorapub.testing import MemoryEngine, lora_snapshot


def test_a_snapshot_prints_its_digest_tensors_size_and_framework():
    snapshot = lora_snapshot(3)
    text = repr(snapshot)
    assert text.startswith(f"<Snapshot {snapshot.digest[:12]} {len(snapshot.tensor_names)} tensors ")
    assert re.search(r" [0-9.]+ (kB|MB) numpy>$", text), text
    assert "0x" not in text


async def test_a_deployment_prints_its_epoch_life_engines_and_settings_through_its_life():
    dep = Deployment({"e1": MemoryEngine("e1", max_loaded=5), "e0": MemoryEngine("e0", max_loaded=5)}, epoch=7, capacity=4, max_lag=2,
                     reconcile_interval=None)
    assert repr(dep) == "<Deployment epoch=7 not started engines=['e0', 'e1'] capacity=4 max_lag=2>"
    await dep.start()
    assert " started " in repr(dep)
    session = dep.session("s1")
    assert repr(session).startswith("<Session 's1' OPEN")
    await dep.close()
    assert " closed " in repr(dep) and "0x" not in repr(dep)
