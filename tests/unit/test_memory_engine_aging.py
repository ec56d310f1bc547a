"""The in-process engine ages undriven stashes out as lorapub's engine-side staging does
(``LORAPUB_STAGE_IDLE_S``): dropped and tombstoned, never recreated, never an adapter unloaded."""

from __future__ import annotations

import pytest

from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.errors import EngineError
from lorapub.testing import ManualClock as Clock, MemoryEngine
from lorapub.testing.fixtures import lora_snapshot


SNAPSHOTS = {}


def request(engine: MemoryEngine, inc: str, version: str, seed: int) -> SendBegin:
    snap = SNAPSHOTS[version] = lora_snapshot(seed)
    key = VersionKey(1, version)
    return SendBegin(engine.name, inc, AttemptToken(key, 1), lora_name_for(key, snap.digest), snap.digest,
                     snap.plan(4 << 10))


def payload(request: SendBegin, index: int) -> bytes:
    """The bucket's real bytes (the engine verifies them at end)."""
    return SNAPSHOTS[request.token.version.version_id].bucket_bytes(request.plan, index)


async def test_an_undriven_stash_is_dropped_and_refused_and_a_loaded_one_kept_while_its_adapter_is():
    clock = Clock()
    e = MemoryEngine("e0", stage_idle_s=600, clock=clock)
    inc = await e.incarnation()
    a, b = request(e, inc, "A", 1), request(e, inc, "B", 2)
    assert len(a.plan.buckets) > 1
    await e.begin(a)
    await e.receive_bucket(a.token, 0, b"x")  # then its publisher vanishes
    clock.now += 599
    await e.begin(b)
    assert a.token in e.stashes and e.aged == []
    for i in range(len(b.plan.buckets)):
        await e.receive_bucket(b.token, i, payload(b, i))
    await e.end(b.token)
    clock.now += 2
    assert await e.incarnation() == inc and e.aged == [a.token]
    for late in (e.receive_bucket(a.token, 1, b"x"), e.end(a.token), e.begin(a)):
        with pytest.raises(EngineError):
            await late
    assert a.token not in e.stashes

    clock.now += 3600  # B's end loaded its adapter: kept while it is loaded, never unloaded by aging
    await e.incarnation()
    assert b.token in e.stashes and e.serves(b.lora_name) and e.aged == [a.token]
    await e.reclaim(b.lora_name, "r1")
    clock.now += 601
    await e.incarnation()
    assert e.aged == [a.token, b.token] and b.token not in e.stashes
    await e.cleanup(b.token, b.lora_name)
    assert e.unloads == {b.lora_name: 1}
