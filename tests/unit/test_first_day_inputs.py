"""What a new user gets wrong on the first day is refused at once, typed, saying what to do."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lorapub import Deployment, InvalidInput, LorapubError, Snapshot
from lorapub.testing import MemoryEngine, peft_config

GOOD = np.ones((2, 2), dtype=np.float32)


async def test_an_unreachable_engine_is_named_with_its_url():
    from lorapub.adapters.sglang_wire import SGLangWireEngine

    engine = SGLangWireEngine("e0", "http://127.0.0.1:9")  # nothing listens there
    try:
        with pytest.raises(LorapubError, match=r"http://127\.0\.0\.1:9") as e:
            await Deployment({"e0": engine}, epoch=1).start()
        assert "e0" in e.value.message
    finally:
        await engine.close()


@pytest.mark.parametrize("epoch", ["run-7", "7", 1.0, None])
def test_an_epoch_that_is_not_an_int_is_refused_saying_what_it_is_for(epoch):
    with pytest.raises(InvalidInput, match=r"epoch=.*an int") as e:
        Deployment({"e0": MemoryEngine("e0")}, epoch=epoch)
    assert e.value.code == "INVALID_INPUT" and repr(epoch) in e.value.message


def test_an_empty_serving_config_is_refused():
    with pytest.raises(InvalidInput, match="serving_config is empty.*adapter_config") as e:
        Snapshot({"w": GOOD}, {})
    assert e.value.code == "INVALID_INPUT"
    Snapshot({"w": GOOD}, peft_config(2))  # a real one is taken


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_tensors_with_values_that_are_not_finite_are_refused_naming_the_tensor(kind, value):
    bad = np.full((2, 2), value, dtype=np.float32)
    partly = np.ones((2, 2), dtype=np.float32)
    partly[1, 1] = value
    for tensor in (bad, partly):
        if kind == "torch":
            torch = pytest.importorskip("torch")
            tensors = {"a.lora_A.weight": torch.ones(2, 2), "a.lora_B.weight": torch.from_numpy(tensor)}
        else:
            tensors = {"a.lora_A.weight": GOOD, "a.lora_B.weight": tensor}
        with pytest.raises(InvalidInput, match="'a.lora_B.weight'.*(NaN|infinit)") as e:
            Snapshot(tensors, peft_config(2))
        assert e.value.code == "INVALID_INPUT"


def test_integer_and_bool_tensors_have_no_finiteness_to_check():
    Snapshot({"i": np.arange(4, dtype=np.int64), "b": np.array([True, False])}, peft_config(2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_torch_tensor_not_finite_anywhere_is_refused_in_every_float_format(dtype, value, monkeypatch):
    """Checked on the bits a chunk at a time (never on torch's intra-op pool): a bad value past the first
    chunk, in any of the formats a trainer keeps its adapter in, is found."""
    torch = pytest.importorskip("torch")
    from lorapub import snapshot

    monkeypatch.setattr(snapshot, "_CHUNK", 7)  # many chunks, and a last one shorter than the rest
    good = torch.linspace(-3e4, 3e4, 40).to(getattr(torch, dtype))  # large, small, zero, negative: all finite
    Snapshot({"a.lora_A.weight": good}, peft_config(2))
    for at in (0, 6, 7, 23, 39):
        bad = good.clone()
        bad[at] = value
        with pytest.raises(InvalidInput, match=r"'a.lora_A.weight'.*\(1 (NaN|infinite) of 40\)"):
            Snapshot({"a.lora_A.weight": bad}, peft_config(2))


def test_every_floating_format_the_dtype_table_admits_has_its_exponent_mask():
    """The finiteness check reads the bits of every floating format a snapshot accepts."""
    np = pytest.importorskip("numpy")
    from lorapub import snapshot
    from lorapub.wire.dtypes import SAFETENSORS_DTYPES

    floating = {name for name, code in SAFETENSORS_DTYPES.items() if code.startswith(("F", "BF"))}
    assert set(snapshot._EXPONENTS) == floating
    for name, (kind, mask) in snapshot._EXPONENTS.items():
        width = np.dtype(kind).itemsize
        assert width == {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[name] and mask < 1 << (8 * width)


def test_a_snapshot_of_cpu_tensors_copies_and_checks_them_off_torchs_intra_op_pool(monkeypatch):
    """Its copy and finiteness check run in numpy: torch's pool has a thread per core, and on a host the
    servers keep busy each tensor waited for the slowest of them (docs/sglang-patch.md). The frozen
    copy still equals the source, is its own memory, and keeps standard strides for a strided source."""
    torch = pytest.importorskip("torch")
    source = torch.randn(6, 4).to(torch.bfloat16)
    strided = torch.randn(4, 6).t()  # not contiguous: torch's own copy, into standard strides
    grad = torch.randn(3, 3, requires_grad=True)

    def refuse(*args, **kwargs):
        raise AssertionError("torch's pool was used for a contiguous CPU tensor")

    monkeypatch.setattr(torch, "isfinite", refuse)
    snap = Snapshot({"a.lora_A.weight": source, "g.lora_A.weight": grad}, peft_config(2))
    frozen = snap.tensor("a.lora_A.weight")
    assert torch.equal(frozen, source) and frozen.data_ptr() != source.data_ptr()
    source.mul_(2)  # the trainer steps on
    assert not torch.equal(frozen, source)
    assert torch.equal(snap.tensor("g.lora_A.weight"), grad.detach())
    monkeypatch.undo()
    copied = Snapshot({"s.lora_A.weight": strided}, peft_config(2)).tensor("s.lora_A.weight")
    assert copied.is_contiguous() and torch.equal(copied, strided)
