"""Properties of the frozen snapshot, its canonical manifest and the bucket plan."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lorapub.core.manifest import BucketPlan
from lorapub.snapshot import Snapshot

shapes = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=8)


def make(shape_list, seed=0):
    rng = np.random.default_rng(seed)
    return {f"w{i:02d}": rng.standard_normal(s).astype("float32") for i, s in enumerate(shape_list)}


@given(shape_list=shapes, cap=st.integers(1, 400))
def test_plan_keeps_order_covers_everything_and_respects_the_cap(shape_list, cap):
    snap = Snapshot(make(shape_list), {"r": 2})
    plan = BucketPlan.for_manifest(snap.manifest, cap)
    names = [n for b in plan.buckets for n in b.tensor_names]
    assert names == [t.name for t in snap.manifest.tensors]  # fixed order, each tensor once
    assert [b.index for b in plan.buckets] == list(range(len(plan)))
    for b in plan.buckets:
        assert b.nbytes <= cap or len(b.entries) == 1  # only a lone oversized tensor exceeds the cap
    assert plan.digest == snap.digest


@given(shape_list=shapes, seed=st.integers(0, 5))
def test_digest_is_canonical_and_content_addressed(shape_list, seed):
    tensors = make(shape_list, seed)
    a = Snapshot(tensors, {"r": 2, "alpha": 4})
    b = Snapshot(dict(reversed(list(tensors.items()))), {"alpha": 4, "r": 2})  # order of keys is irrelevant
    assert a.digest == b.digest
    changed = dict(tensors)
    first = next(iter(changed))
    changed[first] = changed[first] + 1.0
    assert Snapshot(changed, {"r": 2, "alpha": 4}).digest != a.digest
    assert Snapshot(tensors, {"r": 4, "alpha": 4}).digest != a.digest  # serving config is content too


def test_snapshot_is_frozen_against_live_training():
    live = make([(3, 3)])
    snap = Snapshot(live, {"r": 2})
    before = snap.digest
    live["w00"] += 5.0  # the trainer keeps stepping after the snapshot point
    assert Snapshot(live, {"r": 2}).digest != before
    assert snap.digest == before and not np.array_equal(snap.tensor("w00"), live["w00"])
    payload = snap.bucket_bytes(snap.plan(1 << 20), 0)
    from safetensors.numpy import load

    assert np.array_equal(load(payload)["w00"], snap.tensor("w00"))


def test_torch_and_numpy_snapshots_agree():
    import pytest

    torch = pytest.importorskip("torch")
    arrays = make([(2, 5), (4,)])
    assert Snapshot({k: torch.from_numpy(v) for k, v in arrays.items()}, {"r": 1}).digest == Snapshot(arrays, {"r": 1}).digest
