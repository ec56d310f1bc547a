"""A Relax run in production shape, through the stand-ins of ``relax_harness.py`` (which follow the
call sequences of Relax's pinned ``service.py`` and ``runtime.py``): groups that end the way Relax ends
them, engines that come and go, a trainer that restarts, and the refusals Relax's agents see."""

from __future__ import annotations

import asyncio
import gc
import time
from types import SimpleNamespace

import pytest

from lorapub.integrations import relax as relax_lorapub
from lorapub.integrations.relax import LorapubConfig, RelaxLorapub

from tests.integrations import relax_harness as harness
from tests.integrations.relax_harness import RuntimeDomain
from tests.integrations.test_relax import ask, make_relax, served, specs, start_group, teardown


# ------------------------------------------------------------------------------------------------
# Groups end the way Relax ends them
# ------------------------------------------------------------------------------------------------


async def run_group(relax, group_id: str, *session_ids: str, turns: int = 1) -> list:
    """One group as Relax runs it: start_group, every member's turns, the agents exit, and the driver's
    ``collect_group`` ends it with the shard's ``release_group``."""
    first = await start_group(relax, group_id, *session_ids)
    answers = list(await asyncio.gather(*first.values()))
    for _ in range(turns - 1):
        answers += await asyncio.gather(*(ask(relax.shard, sid, [4]) for sid in session_ids))
    for sid in session_ids:
        await relax.shard.finish_agent(sid)
    exports = await RuntimeDomain(relax.shard).collect_group(group_id, session_ids)
    assert exports is not None and all("error" not in a for a in answers), answers
    return exports


async def test_a_completed_group_is_forgotten_and_its_id_comes_back_as_a_new_group(tmp_path):
    relax = await make_relax(tmp_path, enabled=True)
    try:
        await relax.step(1)
        # a PrepareDomain rebuilt: train ids restart at train:prepare_group_0, with the same session ids
        for round_ in range(3):
            await run_group(relax, "train:prepare_group_0", "s0", "s1")
            assert relax.lorapub._groups == {} and relax.lorapub.open_sessions == ()
            assert relax.lorapub.deployment.sessions.sessions == {}  # nothing of the ended group stays
            if round_ == 1:
                await relax.step(2)
                await relax.lorapub.deployment.reconcile()
        exports = await run_group(relax, "train:prepare_group_0", "s0", "s1")
        assert [e["metadata"]["lorapub"]["version_id"] for e in exports] == ["step2", "step2"]
    finally:
        await teardown(relax)


class _Member:
    __slots__ = ("closed",)

    def __init__(self) -> None:
        self.closed = False

    async def open(self):
        return self

    async def close(self) -> None:
        self.closed = True


class _Sessions:
    """The part of a Deployment the shard's group bookkeeping touches, with nothing behind it: what
    the shard itself keeps per group is all that is measured."""

    def session(self, session_id, nonce=None, *, group=None):
        return _Member()

    async def close(self) -> None:
        pass


def _bare_lorapub(lorapub: RelaxLorapub) -> RelaxLorapub:
    async def started() -> None:
        lorapub.deployment = _Sessions()

    lorapub._start_deployment = started
    return lorapub


async def test_an_id_still_known_starts_a_new_group_and_releases_what_the_old_one_left_open():
    lorapub = _bare_lorapub(RelaxLorapub(SimpleNamespace(enable_lorapub=True),
                                         config=LorapubConfig(epoch=1, registry=""), engines={}))
    await lorapub.open_group("train:prepare_group_0", ("a", "b"))
    old = dict(lorapub._groups["train:prepare_group_0"].members)
    await lorapub.release("a")  # b's finish never reached lorapub, and no release_group came
    await lorapub.open_group("train:prepare_group_0", ("a", "b"))  # Relax let the id go: a new group
    assert old["b"].closed and lorapub.member("b") is not old["b"] and not lorapub.member("b").closed
    assert set(lorapub.open_sessions) == {"a", "b"}
    await lorapub.aclose()


async def test_100k_groups_through_release_group_with_reused_ids_keep_shard_memory_bounded():
    args = SimpleNamespace(enable_lorapub=True, agentic_session_lifecycle=False)
    harness.INJECT["shard"] = {"config": LorapubConfig(epoch=1, registry=""), "engines": {}}
    try:
        shard = harness.AgenticSessionShard(args, None, None, None)
    finally:
        harness.INJECT["shard"] = {}
    _bare_lorapub(shard._lorapub)
    driver = RuntimeDomain(shard)
    ids = [f"train:prepare_group_{i}" for i in range(4)]  # reused: a PrepareDomain rebuilt restarts them
    started_at = time.monotonic()
    objects_at: dict[int, int] = {}
    for n in range(100_000):
        group_id = ids[n % len(ids)]
        session_ids = (f"{group_id}.session-{n % 2}",)
        await shard.start_group("train", group_id, specs(*session_ids))
        for sid in session_ids:  # the agent exits: _finalize_terminal_session -> _finish_session_once
            await shard.finish_agent(sid)
        assert await driver.collect_group(group_id, session_ids) is not None  # -> the shard's release_group
        assert not shard._groups and not shard._lorapub._groups and not shard._lorapub.open_sessions
        if n in (10_000, 99_999):
            gc.collect()
            objects_at[n] = len(gc.get_objects())
    assert objects_at[99_999] - objects_at[10_000] < 200, objects_at  # nothing grows with the groups run
    assert time.monotonic() - started_at < 30
    await shard.shutdown()
