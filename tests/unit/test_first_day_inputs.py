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
