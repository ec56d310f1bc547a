"""A refusal names the next step (what to call, with what), not only what went wrong."""

from __future__ import annotations

import asyncio

import pytest

from lorapub import Deployment, SessionClosed, VersionConflict
from lorapub.testing import MemoryEngine, lora_snapshot
from tests.e2e.conftest import FAST

GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


async def _deployment(**engine) -> Deployment:
    return await Deployment({"e0": MemoryEngine("e0", **engine)}, epoch=1, deadlines=FAST,
                            reconcile_interval=None).start()


async def test_a_version_id_sent_with_another_snapshot_is_told_to_use_a_new_id():
    dep = await _deployment()
    await dep.publish(lora_snapshot(1), "A")
    with pytest.raises(VersionConflict) as err:
        await dep.publish(lora_snapshot(2), "A")
    assert "under a new version id" in err.value.message and "same snapshot" in err.value.message
    await dep.close()


async def test_a_closed_session_is_told_how_to_start_again_and_the_id_can_be_used_again():
    dep = await _deployment()
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.generate(GEN)
    await s.close()
    with pytest.raises(SessionClosed) as err:
        await s.generate(GEN)
    assert "dep.session(id) again" in err.value.message and err.value.details["session"] == s.key
    again = dep.session("s")  # what the message says works: a new lifecycle of the same id
    assert again is not s and (await again.generate(GEN))["lorapub"]["version_id"] == "A"
    await dep.close()


async def test_a_request_cut_by_close_says_its_tokens_are_lost_and_to_retry_in_a_new_session():
    dep = await _deployment(generate_seconds=5.0)
    await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    await s.open()
    running = asyncio.ensure_future(s.generate(GEN))
    while not s.busy:
        await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(s.close())
    with pytest.raises(SessionClosed) as err:
        await asyncio.wait_for(running, 5)
    await closing
    assert "tokens are lost" in err.value.message and "new session" in err.value.message
    await dep.close()


async def test_publishing_a_retired_version_again_is_a_retry_that_never_makes_it_the_default():
    dep = await _deployment()
    first = await dep.publish(lora_snapshot(1), "A")
    await dep.session("on-a").generate(GEN)  # keeps A (RETIRED, not reclaimed) once B is the default
    await dep.publish(lora_snapshot(2), "B")
    again = await dep.publish(lora_snapshot(1), "A")  # e.g. a trainer retrying after a lost reply
    assert again.reused and again.receipt == first.receipt and again.state.value == "RETIRED"
    out = await dep.session("s").generate(GEN)
    assert out["lorapub"]["version_id"] == "B"  # the default is still the newer version
    await dep.close()


async def test_slots_kept_only_by_an_engine_that_does_not_confirm_are_named_with_the_way_out():
    from lorapub import CapacityError

    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, deadlines=FAST, reconcile_interval=None, reclaim_retries=0).start()
    await dep.publish(lora_snapshot(1), "A")
    engines["e1"].fail_next("reclaim", "reply", count=1000)  # e1 stops answering its unloads
    await dep.publish(lora_snapshot(2), "B")  # A retires, no session keeps it: its reclaim waits on e1
    with pytest.raises(CapacityError) as err:
        await dep.publish(lora_snapshot(3), "C")
    assert err.value.details["held_by_sessions"] == 0 and err.value.details["waiting_on_engines"] == ["e1"]
    assert err.value.details["unreachable_engines"] == []  # e1 answers: its unload may yet be confirmed
    assert "No session keeps them: they wait for e1" in err.value.message and "does not answer" not in err.value.message
    engines["e1"].clear_faults()
    engines["e1"].fail_next(None, "request", count=1000)  # now e1 answers nothing at all
    with pytest.raises(CapacityError) as err:
        await dep.publish(lora_snapshot(3), "C")
    assert err.value.details["unreachable_engines"] == ["e1"]
    assert "Now e1 does not answer" in err.value.message and "remove_engine" in err.value.message
    engines["e1"].clear_faults()
    await dep.close()


async def test_a_retiring_versions_refs_do_not_count_as_sessions_keeping_its_slot():
    from lorapub import CapacityError

    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, deadlines=FAST, reconcile_interval=None, reclaim_retries=0,
                           capacity=2, max_lag=0).start()
    await dep.publish(lora_snapshot(1), "A")
    await dep.session("s").generate(GEN)  # a ref on A, which max_lag=0 retires at the next commit
    engines["e1"].fail_next("reclaim", "reply", count=1000)
    await dep.publish(lora_snapshot(2), "B")
    with pytest.raises(CapacityError) as err:
        await dep.publish(lora_snapshot(3), "C")
    assert err.value.details["held_by_sessions"] == 0 and err.value.details["waiting_on_engines"] == ["e1"]
    engines["e1"].clear_faults()
    await dep.close()


async def test_a_cleanup_owed_by_an_engine_that_does_not_answer_is_named_on_the_next_publish():
    from lorapub import LorapubError, PublicationBlocked

    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, deadlines=FAST, reconcile_interval=None).start()
    await dep.publish(lora_snapshot(1), "A")
    engines["e1"].fail_next("begin", "error")
    engines["e1"].fail_next("cleanup", "reply", count=1000)
    with pytest.raises(LorapubError):
        await dep.publish(lora_snapshot(2), "B")  # fails on e1; its cleanup there is not confirmed
    with pytest.raises(PublicationBlocked) as err:
        await dep.publish(lora_snapshot(3), "C")
    assert err.value.details["waiting_on_engines"] == ["e1"] and err.value.details["unreachable_engines"] == []
    engines["e1"].clear_faults()
    engines["e1"].fail_next(None, "request", count=1000)  # now e1 answers nothing at all
    with pytest.raises(PublicationBlocked) as err:
        await dep.publish(lora_snapshot(3), "C")
    assert err.value.details["unreachable_engines"] == ["e1"] and "Now e1 does not answer" in err.value.message
    engines["e1"].clear_faults()
    await dep.close()
