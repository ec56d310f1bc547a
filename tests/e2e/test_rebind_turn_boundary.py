"""A rebind happens at a turn boundary: while a request of a session still runs on its version, a
new turn of that session is not sent on another one (it waits for the running ones to end, then
rebinds). Every result says what held when its request was sent (version, lag, rebinds), not
what holds when it returns.

The engines hold the marked requests until the test releases them: the interleavings are exact.
"""

from __future__ import annotations

import asyncio

import pytest

from lorapub import BindingStale, Deployment
from lorapub.testing import MemoryEngine, lora_snapshot
from tests.e2e.conftest import FAST
from tests.helpers.waiting import until

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
HELD = {"input_ids": [7, 7, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


class HeldEngine(MemoryEngine):
    """Answers every HELD request only once ``release`` is set (it is running until then, as far as
    its session can tell); logs each request's start and end."""

    def __init__(self, name: str, log: list, release: asyncio.Event, **kw) -> None:
        super().__init__(name, **kw)
        self.log, self.release = log, release

    async def generate(self, payload):
        self.log.append(("start", payload["lora_path"]))
        try:
            out = await super().generate(payload)
            if list(payload["input_ids"]) == HELD["input_ids"]:
                await self.release.wait()
            return out
        finally:
            self.log.append(("end", payload["lora_path"]))


async def deployment(**options) -> tuple[Deployment, list, asyncio.Event]:
    log: list = []
    release = asyncio.Event()
    engines = {n: HeldEngine(n, log, release, max_loaded=5, max_per_batch=5) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, capacity=4, deadlines=FAST, reconcile_interval=None,
                           decision_log=False, **options).start()
    return dep, log, release


def fields(out) -> tuple[str, int, int]:
    return out["lorapub"]["version_id"], out["lorapub"]["lag"], out["lorapub"]["rebinds"]


def running_versions(log: list) -> list[set[str]]:
    """The set of adapters with a request running after each logged event."""
    running: dict[str, int] = {}
    seen = []
    for what, name in log:
        running[name] = running.get(name, 0) + (1 if what == "start" else -1)
        seen.append({n for n, count in running.items() if count})
    return seen


async def test_a_rebind_waits_for_the_sessions_running_request_which_keeps_the_fields_it_was_sent_with():
    dep, log, release = await deployment(max_lag=1, on_stale="rebind")
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    assert fields(await s.generate(GEN)) == ("A", 0, 0)
    running = asyncio.ensure_future(s.generate(HELD))
    await until(lambda: log[-1:] == [("start", s.binding.lora_name)], what="the held request sent on A")
    await dep.publish(lora_snapshot(2), "B")
    await dep.publish(lora_snapshot(3), "C")  # A is 2 behind: retiring
    turn = asyncio.ensure_future(s.generate(GEN))
    await asyncio.sleep(0.05)  # time for a wrong send to happen (none may: the assertion holds at any speed)
    assert not turn.done() and log[-1] == ("start", s.binding.lora_name)  # nothing sent on another version
    release.set()
    assert fields(await running) == ("A", 0, 0)  # as when it was sent, not as when it returned
    assert fields(await turn) == ("C", 0, 1)
    assert [(v.version_id, first) for v, first in s.provenance] == [("A", 0), ("C", 2)]
    assert all(len(names) <= 1 for names in running_versions(log))  # never two versions at once
    await s.close()
    await dep.close()


async def test_a_turn_beside_a_running_one_is_sent_at_once_while_its_version_is_within_max_lag():
    dep, log, release = await deployment(max_lag=1, on_stale="rebind")
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    running = asyncio.ensure_future(s.generate(HELD))
    await until(lambda: log[-1:] == [("start", s.binding.lora_name)], what="the held request sent on A")
    await dep.publish(lora_snapshot(2), "B")  # A is 1 behind: still allowed
    assert fields(await s.generate(GEN)) == ("A", 1, 0)  # not held behind the running request
    release.set()
    assert fields(await running) == ("A", 0, 0)
    await s.close()
    await dep.close()


async def test_with_on_stale_error_the_new_turn_is_refused_and_the_running_one_completes():
    dep, log, release = await deployment(max_lag=0, on_stale="error")
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    running = asyncio.ensure_future(s.generate(HELD))
    await until(lambda: log[-1:] == [("start", s.binding.lora_name)], what="the held request sent on A")
    await dep.publish(lora_snapshot(2), "B")
    with pytest.raises(BindingStale):
        await s.generate(GEN)
    release.set()
    assert fields(await running) == ("A", 0, 0)  # never cut in the middle
    await s.close()
    await dep.close()
