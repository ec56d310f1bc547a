"""``end`` reports where it spent its time typed (lorapub.ports.EndTimings, ReportsEndTimings): the
publication report carries each engine's phases under the names the benchmarks read."""

from __future__ import annotations

from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.ports import EndTimings, ReportsEndTimings
from lorapub.runtime.deployment import Deployment
from lorapub.testing import MemoryEngine, SGLangDouble, lora_snapshot
from tests.e2e.conftest import FAST


def test_end_timings_are_named_as_the_report_names_them():
    t = EndTimings({"verify_wait": 0.25, "load": 0.5}, stage=1.0, probe=0.125, state=0.0625)
    assert t.phases() == {"end.verify_wait": 0.25, "end.load": 0.5, "end.stage": 1.0, "end.probe": 0.125,
                          "end.state": 0.0625}
    assert list(t.phases()) == ["end.verify_wait", "end.load", "end.stage", "end.probe", "end.state"]
    assert EndTimings(stage=1.0).phases() == {"end.stage": 1.0}


async def test_the_wire_engine_reports_every_end_phase_once():
    double = await SGLangDouble("e0").start()
    engine = SGLangWireEngine("e0", double.url)
    assert isinstance(engine, ReportsEndTimings) and not isinstance(MemoryEngine("m"), ReportsEndTimings)
    dep = await Deployment({"e0": engine}, epoch=1, deadlines=FAST).start()
    try:
        report = await dep.publish(lora_snapshot(1), "A")
        phases = report.engine_phases["e0"]
        for name in ("end.verify_wait", "end.load", "end.stage", "end.probe", "end.state"):
            assert isinstance(phases[name], float) and phases[name] >= 0, name
        assert engine.end_timings(report.receipt.token) is None  # handed over once, to the report
    finally:
        await dep.close()
        await double.stop()


async def test_the_probe_and_the_state_check_overlap():
    """#44 item 3: ``end`` reads the engine's state while its exact-version probe runs (a probe that
    waits for the state read to start would hang a sequential end), and a failed probe is the error
    raised even though the state read succeeded beside it."""
    import asyncio

    import pytest

    from lorapub import EngineError

    double = await SGLangDouble("e0").start()
    engine = SGLangWireEngine("e0", double.url)
    state_started = asyncio.Event()
    read_state, probe = engine.client.state_reply, engine._probe

    async def state_reply():
        state_started.set()
        return await read_state()

    async def waiting_probe(name):
        await asyncio.wait_for(state_started.wait(), 30)  # only an overlapping end gets past this
        await probe(name)

    engine.client.state_reply = state_reply
    engine._probe = waiting_probe
    dep = await Deployment({"e0": engine}, epoch=1, deadlines=FAST).start()
    try:
        report = await dep.publish(lora_snapshot(1), "A")
        assert report.engine_phases["e0"]["end.state"] >= 0

        async def failing_probe(name):
            await asyncio.wait_for(state_started.wait(), 30)
            raise EngineError("e0: exact-version probe failed (injected)", engine="e0")

        state_started.clear()
        engine._probe = failing_probe
        with pytest.raises(Exception) as caught:
            await dep.publish(lora_snapshot(2), "B")
        assert "exact-version probe failed (injected)" in repr(caught.value.__cause__ or caught.value) or \
            "exact-version probe failed (injected)" in str(caught.value), repr(caught.value)
    finally:
        await dep.close()
        await double.stop()
