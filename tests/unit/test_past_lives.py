"""A turn an engine served in its previous life is attested: a past life of the engine is a life of
the engine (docs/provenance.md, "Stamp"). The record of past lives is bounded."""

from __future__ import annotations

import pytest

from lorapub import ProvenanceMismatch
from lorapub.runtime.deployment import Deployment
from lorapub.testing import MemoryEngine, lora_snapshot

TURN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


async def test_a_turn_served_by_the_engines_previous_life_is_attested():
    e0 = MemoryEngine("e0")
    dep = await Deployment({"e0": e0}, epoch=1, reconcile_interval=3600).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s")
        real = e0.generate

        async def answer_travels_back_across_a_restart(payload):
            out = await real(payload)  # served and stamped by this life
            e0.restart()  # ... and while the answer travels back, the engine restarts
            await dep.reconcile()  # and this process learns its new life
            return out

        e0.generate = answer_travels_back_across_a_restart
        out = await s.generate(TURN)
        assert out["lorapub"]["stamp"]["incarnation"] != e0.incarnation_id  # a past life's stamp, accepted
    finally:
        await dep.close()


async def test_a_life_the_engine_never_had_is_still_a_mismatch():
    e0 = MemoryEngine("e0")
    dep = await Deployment({"e0": e0}, epoch=1, reconcile_interval=3600).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s")
        real = e0.generate

        async def forged(payload):
            out = await real(payload)
            out["meta_info"]["lorapub"] = dict(out["meta_info"]["lorapub"], incarnation="e0-never")
            return out

        e0.generate = forged
        with pytest.raises(ProvenanceMismatch, match="not a life of e0"):
            await s.generate(TURN)
    finally:
        await dep.close()


async def test_a_registry_that_does_not_answer_the_recheck_changes_no_verdict():
    """The recheck reads the registry's record of lives; a lost reply there attests nothing and
    refuses nothing more: a forged life is still PROVENANCE_MISMATCH, never an unknown outcome."""
    from lorapub.core.commands import ReadFleet
    from lorapub.local_registry import LocalRegistry
    from lorapub.testing import FaultyRegistry

    e0 = MemoryEngine("e0")
    registry = FaultyRegistry(LocalRegistry(1, {"e0": await e0.incarnation()}))
    dep = await Deployment({"e0": e0}, epoch=1, registry=registry, reconcile_interval=None).start()
    try:
        await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s")
        real = e0.generate

        async def forged(payload):
            out = await real(payload)
            out["meta_info"]["lorapub"] = dict(out["meta_info"]["lorapub"], incarnation="e0-never")
            return out

        e0.generate = forged
        registry.fail_next(ReadFleet, "request", count=5)
        with pytest.raises(ProvenanceMismatch, match="not a life of e0"):
            await s.generate(TURN)
    finally:
        registry.clear_faults()
        await dep.close()
