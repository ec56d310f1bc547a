"""Engine-attested provenance over the SGLang double (its real LoRA registry, lorapub's staging):
every turn's stamp is checked against the binding; a version served with another version's weights
under the right name is caught on its first turn. See docs/provenance.md, "Stamp"."""

import pytest

from lorapub import ProvenanceMismatch
from lorapub.events import ProvenanceMismatched
from lorapub.runtime.deployment import Deployment
from lorapub.testing.fixtures import lora_snapshot

from tests.e2e.conftest import FAST

TURN = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}}


async def test_every_turn_carries_the_engines_stamp(deployment, doubles):
    a = await deployment.publish(lora_snapshot(1), "A")
    s = deployment.session("s")
    out = await s.generate(TURN)
    stamp = out["lorapub"]["stamp"]
    assert out["meta_info"]["lorapub"]["lora_name"] == a.lora_name
    assert stamp["lora_name"] == a.lora_name and stamp["digest"] == s.binding.digest
    held = doubles[stamp["engine"]]
    assert stamp["incarnation"] == held.incarnation
    assert stamp["lora_id"] == held.lora_registry.get_all_adapters()[a.lora_name].lora_id
    await s.close()


async def test_a_missing_stamp_from_a_stamping_engine_is_a_mismatch(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    seen = []
    deployment.sessions.events = seen.append  # the service's observer
    for d in doubles.values():
        d.stamp = lambda name, lora_id: None  # a silent fallback: the response carries no stamp
    s = deployment.session("s")
    with pytest.raises(ProvenanceMismatch) as e:
        await s.generate(TURN)
    assert e.value.code == "PROVENANCE_MISMATCH" and e.value.details["stamp"] is None
    assert e.value.details["expected"]["lora_name"] == s.binding.lora_name
    assert any(isinstance(ev, ProvenanceMismatched) for ev in seen)
    await s.close()


async def test_a_forged_stamp_is_a_mismatch(deployment, doubles):
    await deployment.publish(lora_snapshot(1), "A")
    for d in doubles.values():
        real = type(d).stamp.__get__(d)
        d.stamp = lambda name, lora_id, real=real: dict(real(name, lora_id), incarnation="another-life")
    s = deployment.session("s")
    with pytest.raises(ProvenanceMismatch, match="life"):
        await s.generate(TURN)
    await s.close()


@pytest.mark.parametrize("load", ["dir", "tensors"])
async def test_other_weights_under_the_right_name_are_caught_on_the_first_turn(tmp_path, shared_dir, load):
    """The test-only switch: the staging loads B with A's weights and records what it loaded."""
    from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine
    from lorapub.testing import SGLangDouble

    d = SGLangDouble("e0")
    d.stash_root, d.shm_dir, d.swap_weights = str(tmp_path / "disk"), str(shared_dir), True
    await d.start()
    engine = SGLangWireEngine("e0", d.url)
    transport = HTTPBytes(load=load)
    dep = await Deployment({"e0": engine}, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10,
                           transport=transport).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        old = dep.session("old")
        assert (await old.generate(TURN))["lorapub"]["stamp"]["digest"] == old.binding.digest
        b = await dep.publish(lora_snapshot(2), "B")
        new = dep.session("new")
        with pytest.raises(ProvenanceMismatch, match="other weights") as e:
            await new.generate(TURN)
        assert new.binding.lora_name == b.lora_name and new.requests == 1
        assert e.value.details["stamp"]["digest"] == old.binding.digest  # what was really loaded
        await old.close()
        await new.close()
    finally:
        await dep.close()
        await engine.close()
        await d.stop()


async def test_an_engine_that_does_not_stamp_is_noted_not_failed():
    """Stock SGLang (no stamps): its turns are unattested, never failed; health notes it, healthy still."""
    from lorapub.testing import MemoryEngine

    stock, patched = MemoryEngine("stock"), MemoryEngine("patched")
    stock.stamps = False
    dep = await Deployment({"stock": stock, "patched": patched}, epoch=1, deadlines=FAST).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        stamps = []
        for i in range(4):
            async with dep.session(f"s{i}") as s:
                stamp = (await s.generate(TURN))["lorapub"]["stamp"]
                stamps.append((s.engine.name, stamp))
        assert {name for name, st in stamps if st is None} == {"stock"}
        assert {name for name, st in stamps if st is not None} == {"patched"}
        await dep.settle()
        health = await dep.reconcile()
        assert health.healthy and any(n.startswith("stock:") and "unattested" in n for n in health.notes)
        assert not any(n.startswith("patched:") for n in health.notes)
        status = await dep.status()  # status says it too
        assert status.healthy and any(n.startswith("stock:") for n in status.notes)
        # and the patched engine serving the wrong weights is still caught
        patched.loaded = {name: "0" * 64 for name in patched.loaded}
        with pytest.raises(ProvenanceMismatch):
            for i in range(4):
                async with dep.session(f"t{i}") as s:
                    await s.generate(TURN)
    finally:
        await dep.close()
