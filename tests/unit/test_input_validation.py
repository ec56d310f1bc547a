"""Bad input is refused at the door with INVALID_INPUT, naming what is wrong, before anything is sent."""

from __future__ import annotations

import pytest

from lorapub.core.identity import SessionKey, VersionKey, check_digest, check_id, lora_name_for
from lorapub.errors import InvalidInput

DIGEST = "ab" * 32


@pytest.mark.parametrize("bad", ["v1\n", "v1\r\n", "\nv1", "v 1", "a/b", "../x", "", "x" * 129, "v1\x00", "é"])
def test_ids_with_newlines_separators_or_other_characters_are_refused(bad):
    with pytest.raises(InvalidInput) as e:
        VersionKey(1, bad)
    assert e.value.code == "INVALID_INPUT" and "version_id" in e.value.message
    with pytest.raises(InvalidInput, match="session_id"):
        SessionKey(1, bad, "n0")
    with pytest.raises(InvalidInput, match="nonce"):
        SessionKey(1, "s0", bad)
    with pytest.raises(InvalidInput):
        check_id("engine name", bad)


def test_a_trailing_newline_never_reaches_a_lora_name():
    with pytest.raises(InvalidInput):
        lora_name_for(VersionKey(1, "v1\n"), DIGEST)
    assert lora_name_for(VersionKey(1, "v1"), DIGEST) == "relax_policy_lora@1-v1-abababababab"


@pytest.mark.parametrize("bad", [DIGEST + "\n", DIGEST.upper(), DIGEST[:-1], None, 7])
def test_digests_must_be_exactly_64_lowercase_hex(bad):
    with pytest.raises(InvalidInput, match="digest"):
        check_digest(bad)
    assert check_digest(DIGEST) == DIGEST


# -- Snapshot: everything is checked at construction, naming the offending key -----------------
import math  # noqa: E402

import numpy as np  # noqa: E402

from lorapub.core.manifest import BucketPlan  # noqa: E402
from lorapub.snapshot import InlineBucketSource, Snapshot  # noqa: E402
from lorapub.testing import lora_snapshot, peft_config, peft_lora_state_dict  # noqa: E402

GOOD = np.ones((2, 2), dtype="float32")


class _Opaque:
    pass


@pytest.mark.parametrize(
    "bad, named",
    [
        (None, "NoneType"),
        ("weights", "str"),
        (b"\x00\x01", "bytes"),
        (_Opaque(), "_Opaque"),
        ([[1.0, 2.0]], "list"),
        (np.array(["a", "b"]), "dtype <U1"),
        (np.array([object(), object()]), "dtype object"),
    ],
    ids=["none", "str", "bytes", "object", "list", "str-array", "object-array"],
)
def test_a_tensor_that_is_not_a_numeric_tensor_is_refused_naming_it(bad, named):
    with pytest.raises(InvalidInput) as e:
        Snapshot({"layer.0.lora_A.weight": GOOD, "layer.0.lora_B.weight": bad}, {"r": 2})
    assert e.value.code == "INVALID_INPUT"
    assert "'layer.0.lora_B.weight'" in e.value.message and named in e.value.message


@pytest.mark.parametrize("bad_name", [0, None, ("a", "b"), b"w", ""])
def test_tensor_names_must_be_non_empty_strings(bad_name):
    with pytest.raises(InvalidInput, match="tensor names must be non-empty strings"):
        Snapshot({"w": GOOD, bad_name: GOOD}, {"r": 2})


@pytest.mark.parametrize(
    "config, named",
    [
        ({"r": 2, "lora_alpha": float("nan")}, "['lora_alpha']"),
        ({"r": 2, "scale": math.inf}, "['scale']"),
        ({"r": 2, "target_modules": ["q_proj", object()]}, "['target_modules'][1]"),
        ({"r": 2, "modules": {"q_proj", "v_proj"}}, "['modules']"),
        ({"r": 2, 7: "seven"}, "key 7"),
        ({"r": 2, "nested": {"deeper": {1: 2}}}, "['nested']['deeper']"),
        ({"r": np.int64(2)}, "['r']"),
    ],
    ids=["nan", "inf", "object-in-list", "set", "int-key", "nested-int-key", "numpy-int"],
)
def test_a_serving_config_that_is_not_plain_json_is_refused_naming_the_key(config, named):
    with pytest.raises(InvalidInput) as e:
        Snapshot({"w": GOOD}, config)
    assert e.value.code == "INVALID_INPUT" and named in e.value.message, e.value.message


def test_a_self_referencing_serving_config_is_refused():
    config: dict = {"r": 2}
    config["self"] = config
    with pytest.raises(InvalidInput, match="refers to itself"):
        Snapshot({"w": GOOD}, config)


def test_torch_and_numpy_mixed_in_one_state_dict_are_refused_up_front():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidInput, match="mixes torch tensors"):
        Snapshot({"a": torch.ones(2), "b": GOOD}, {"r": 2})


def test_torch_tensors_without_data_or_sparse_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidInput, match="'m'.*meta"):
        Snapshot({"m": torch.empty(2, 2, device="meta")}, {"r": 2})
    with pytest.raises(InvalidInput, match="'s'.*layout"):
        Snapshot({"s": torch.eye(2).to_sparse()}, {"r": 2})


@pytest.mark.parametrize("cap", [0, -1, 1.5, "64", None, True, float("nan")])
def test_a_bucket_cap_that_is_not_a_positive_int_is_refused(cap):
    snap = lora_snapshot(1, layers=1, hidden=8, rank=2)
    with pytest.raises(InvalidInput, match="bucket_cap_bytes"):
        snap.plan(cap)
    with pytest.raises(InvalidInput, match="bucket_cap_bytes"):
        BucketPlan.for_manifest(snap.manifest, cap)
    with pytest.raises(InvalidInput, match="Manifest"):
        BucketPlan.for_manifest(snap, 1 << 20)  # the snapshot, not its manifest


def test_bucket_bytes_refuses_a_foreign_plan_or_an_index_out_of_range():
    a, b = lora_snapshot(1, layers=1, hidden=8, rank=2), lora_snapshot(2, layers=1, hidden=8, rank=2)
    plan = a.plan(1 << 20)
    for index in (-1, len(plan), "0", None):
        with pytest.raises(InvalidInput, match="bucket index"):
            a.bucket_bytes(plan, index)
    with pytest.raises(InvalidInput, match="plan made for this snapshot"):
        b.bucket_bytes(plan, 0)
    with pytest.raises(InvalidInput):
        InlineBucketSource(a, "not a plan")


def test_big_endian_arrays_digest_like_the_same_values_in_native_order():
    values = peft_lora_state_dict(3, layers=1, hidden=8, rank=2)
    swapped = {k: v.astype(v.dtype.newbyteorder(">")) for k, v in values.items()}
    assert Snapshot(swapped, peft_config(2)).digest == Snapshot(values, peft_config(2)).digest


def test_tensors_of_any_stride_snapshot_like_their_contiguous_copies():
    """A size-1 dim may keep any stride through ``.contiguous()``; the snapshot's copy is in standard
    strides whatever the source's, so its bytes (and digest) are the values', not the layout's."""
    torch = pytest.importorskip("torch")
    odd = {"a": torch.arange(4.0)[::4], "b": torch.arange(12.0).reshape(3, 4).t(), "c": torch.tensor(True)}
    plain = {k: v.clone(memory_format=torch.contiguous_format).reshape(v.shape) for k, v in odd.items()}
    snap = Snapshot(odd, {"r": 2})
    assert snap.digest == Snapshot(plain, {"r": 2}).digest
    assert all(torch.equal(snap.tensor(k), plain[k]) for k in odd)


def test_numpy_dtypes_safetensors_cannot_store_are_refused():
    np = pytest.importorskip("numpy")
    for dtype in (np.longdouble, np.clongdouble, np.complex128):
        if np.dtype(dtype) == np.float64:
            continue  # a platform whose long double is a double
        with pytest.raises(InvalidInput, match="'x' has dtype"):
            Snapshot({"x": np.zeros(3, dtype=dtype)}, {"r": 2})


# what engine-side staging loads (lorapub.wire.dtypes), and what it refuses though safetensors or the
# framework has it: a snapshot refuses those at once, before a reserve and a begin fail on them
NUMPY_REFUSED = ["uint16", "uint32", "uint64", "complex64", "complex128", "longdouble", "clongdouble"]
NUMPY_ACCEPTED = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", ">f4", ">i8"]
TORCH_REFUSED = ["uint16", "uint32", "uint64", "complex32", "complex64", "complex128", "float8_e4m3fn",
                 "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
TORCH_ACCEPTED = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize("dtype", NUMPY_REFUSED)
def test_a_numpy_dtype_engine_staging_cannot_load_is_refused_naming_tensor_dtype_and_what_is_accepted(dtype):
    if np.dtype(dtype) == np.float64:
        pytest.skip("this platform's long double is a double")
    with pytest.raises(InvalidInput) as e:
        Snapshot({"layer.0.lora_A.weight": GOOD, "layer.0.lora_B.weight": np.zeros((2, 2), dtype=dtype)}, {"r": 2})
    assert e.value.code == "INVALID_INPUT"
    assert "'layer.0.lora_B.weight'" in e.value.message and str(np.dtype(dtype)) in e.value.message
    for name in ("bfloat16", "float32", "int64", "bool"):
        assert name in e.value.message  # says what it accepts


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", TORCH_REFUSED)
def test_a_torch_dtype_engine_staging_cannot_load_is_refused_naming_tensor_dtype_and_what_is_accepted(dtype):
    torch = pytest.importorskip("torch")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        pytest.skip(f"this torch has no {dtype}")
    try:
        t = torch.zeros((2, 2)).to(getattr(torch, dtype))
    except (RuntimeError, TypeError) as e:
        pytest.skip(f"this torch cannot make a {dtype} tensor: {e}")
    with pytest.raises(InvalidInput) as e:
        Snapshot({"layer.0.lora_A.weight": torch.ones(2, 2), "layer.0.lora_B.weight": t}, {"r": 2})
    assert e.value.code == "INVALID_INPUT"
    assert "'layer.0.lora_B.weight'" in e.value.message and dtype in e.value.message
    for name in ("bfloat16", "float32", "int64", "bool"):
        assert name in e.value.message


def test_the_accepted_dtypes_are_exactly_what_engine_staging_loads():
    from lorapub.sglang_patch import prepared_load
    from lorapub.sglang_patch.staging import landing
    from lorapub.wire import safetensors
    from lorapub.wire.dtypes import SAFETENSORS_DTYPES

    assert set(TORCH_ACCEPTED) == set(SAFETENSORS_DTYPES)
    assert landing.SAFETENSORS_DTYPES is SAFETENSORS_DTYPES is safetensors.SAFETENSORS_DTYPES  # one table
    assert prepared_load.reading.SAFETENSORS_CODES == {code: name for name, code in SAFETENSORS_DTYPES.items()}


def test_every_accepted_dtype_is_snapshotted_with_its_name_in_the_manifest():
    from lorapub.wire.dtypes import SAFETENSORS_DTYPES
    from lorapub.wire.safetensors import safetensors_header

    snap = Snapshot({f"n{i:02d}": np.ones((2, 3), dtype=d) for i, d in enumerate(NUMPY_ACCEPTED)}, {"r": 2})
    assert [e.dtype for e in snap.manifest.tensors] == [np.dtype(d).name for d in NUMPY_ACCEPTED]
    assert all(e.dtype in SAFETENSORS_DTYPES for e in snap.manifest.tensors)
    safetensors_header(list(snap.manifest.tensors))  # the engine's header for them: no refusal
    torch = pytest.importorskip("torch")
    snap = Snapshot({f"t{i:02d}": torch.ones(2, 3, dtype=getattr(torch, d)) for i, d in enumerate(TORCH_ACCEPTED)},
                    {"r": 2})
    assert [e.dtype for e in snap.manifest.tensors] == TORCH_ACCEPTED
    safetensors_header(list(snap.manifest.tensors))


# -- Deadlines: every phase deadline is a positive, finite number of seconds ---------------------
from lorapub.runtime.runner import Deadlines  # noqa: E402

DEADLINE_FIELDS = ("begin", "bucket", "end", "cleanup", "commit", "reclaim")


@pytest.mark.parametrize("field", DEADLINE_FIELDS)
@pytest.mark.parametrize(
    "bad", [float("nan"), 0, 0.0, -1, -0.5, math.inf, -math.inf, "30", None, True, False, 10**400, [5]],
    ids=["nan", "zero", "zero-float", "negative", "negative-float", "inf", "-inf", "str", "none", "true",
         "false", "huge-int", "list"],
)
def test_a_deadline_that_is_not_a_positive_finite_number_is_refused_naming_it(field, bad):
    with pytest.raises(InvalidInput) as e:
        Deadlines(**{field: bad})
    assert e.value.code == "INVALID_INPUT"
    assert f"Deadlines.{field}" in e.value.message and repr(bad)[:40] in e.value.message
    deadlines = Deadlines()
    with pytest.raises(InvalidInput, match=f"Deadlines.{field}"):  # set later: checked the same
        setattr(deadlines, field, bad)
    assert getattr(deadlines, field) == getattr(Deadlines(), field)


def test_positive_finite_deadlines_are_kept_as_given():
    d = Deadlines(begin=2, bucket=0.02, end=1e-3, cleanup=np.float64(3.5), commit=1, reclaim=86_400)
    assert (d.begin, d.bucket, d.end, d.cleanup, d.commit, d.reclaim) == (2, 0.02, 1e-3, 3.5, 1, 86_400)
    d.reclaim = 0.5
    assert d.reclaim == 0.5


# -- Deployment arguments: refused at construction, naming the argument ------------------------------------
def _engines():
    from lorapub.testing import MemoryEngine

    return {"e0": MemoryEngine("e0"), "e1": MemoryEngine("e1")}


@pytest.mark.parametrize("capacity", [1, 0, -3])
def test_a_capacity_below_two_is_refused_saying_why(capacity):
    """capacity=1 was accepted, then no second version could ever publish: the default holds the only slot."""
    from lorapub import Deployment
    from lorapub.core.registry import new_registry

    with pytest.raises(InvalidInput) as e:
        Deployment(_engines(), epoch=1, capacity=capacity)
    assert "capacity must be an int >= 2" in e.value.message and f"got {capacity}" in e.value.message
    assert "the default version always holds one slot" in e.value.message and "capacity=2" in e.value.message
    with pytest.raises(InvalidInput, match="capacity must be an int >= 2"):  # a registry made elsewhere too
        new_registry(1, {"e0": "life-1"}, capacity=capacity)


@pytest.mark.parametrize("capacity, max_lag", [(2, 1), (3, 2), (None, 1), (4, 3)])
def test_a_max_lag_the_capacity_cannot_serve_is_refused_saying_which_to_change(capacity, max_lag):
    """capacity 2 with max_lag 1 was accepted: the version one commit behind then kept the slot the next
    needed (within max_lag, it never retires), so every publication waited for sessions to end."""
    from lorapub import Deployment
    from lorapub.core.registry import DEFAULT_CAPACITY, new_registry

    slots = capacity or DEFAULT_CAPACITY
    with pytest.raises(InvalidInput) as e:
        Deployment(_engines(), epoch=1, capacity=capacity, max_lag=max_lag)
    assert f"capacity {slots} cannot serve max_lag={max_lag}" in e.value.message
    assert f"use capacity={max_lag + 2} or more, or max_lag={slots - 2} or less" in e.value.message
    assert e.value.details == {"capacity": slots, "max_lag": max_lag}
    with pytest.raises(InvalidInput, match="cannot serve max_lag"):  # a registry made elsewhere too
        new_registry(1, {"e0": "life-1"}, capacity=slots, max_lag=max_lag)


@pytest.mark.parametrize("capacity, max_lag", [(2, 0), (3, 1), (4, 2), (2, None)])
def test_a_capacity_with_room_for_max_lag_is_kept(capacity, max_lag):
    from lorapub import Deployment

    dep = Deployment(_engines(), epoch=1, capacity=capacity, max_lag=max_lag)
    assert (dep.capacity, dep.max_lag) == (capacity, max_lag)


def test_the_relax_config_refuses_a_capacity_below_two():
    from lorapub.integrations.relax.options import LorapubConfig

    with pytest.raises(ValueError, match="capacity must be an int >= 2"):
        LorapubConfig(capacity=1)
    assert LorapubConfig(capacity=2).capacity == 2


@pytest.mark.parametrize("deadlines", ["x", 30, {"begin": 1}])
def test_deadlines_that_are_not_a_deadlines_value_are_refused_naming_the_type(deadlines):
    from lorapub import Deployment

    with pytest.raises(InvalidInput) as e:  # was a bare AttributeError ('str' object has no attribute 'begin')
        Deployment(_engines(), epoch=1, deadlines=deadlines)
    assert "deadlines must be a lorapub.Deadlines" in e.value.message and type(deadlines).__name__ in e.value.message


@pytest.mark.parametrize("name, bad", [("reclaim_retries", -1), ("reclaim_retries", 1.5), ("reclaim_retries", True),
                                       ("reclaim_backoff", -1), ("reclaim_backoff", math.nan), ("reclaim_backoff", "1")])
def test_reclaim_settings_are_refused_naming_the_argument_and_the_value_given(name, bad):
    from lorapub import Deployment

    with pytest.raises(InvalidInput) as e:  # was 'RetryPolicy.tries must be an int >= 1 … got 0' for -1
        Deployment(_engines(), epoch=1, **{name: bad})
    assert e.value.message.startswith(f"{name} must be") and f"got {bad!r}" in e.value.message
    assert "RetryPolicy" not in e.value.message


@pytest.mark.parametrize("epoch", ["1", "run-7", -1, True, 1.0])
def test_a_local_registry_refuses_an_epoch_that_is_not_an_int(epoch):
    """As Deployment(epoch=) does: a run id string would name every version after it and break later reads
    (lorapub status --store among them)."""
    from lorapub.local_registry import LocalRegistry

    with pytest.raises(InvalidInput) as e:
        LocalRegistry(epoch, {"e0": "e0-life0"})
    assert "epoch=" in e.value.message
