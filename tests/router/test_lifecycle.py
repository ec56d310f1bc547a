"""Publish -> bind -> generate -> reclaim with every generation going through the real router."""

from __future__ import annotations

import asyncio
import itertools
import random

from lorapub.core.version import VersionState
from lorapub.testing.fixtures import lora_snapshot
from tests.router.harness import served_by


def _request(rid: str, prompt: list[int], tokens: int = 4) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens}, "rid": rid}


def _received(doubles: dict, rid: str) -> list[tuple[str, dict]]:
    return [(d.name, b) for d in doubles.values() for b in d.received if b.get("rid") == rid]


def _check_exact(doubles: dict, rid: str, reply: dict, lora_name: str) -> str:
    """The router chose one worker; that worker got the exact lora_path, once, and ran that adapter."""
    seen = _received(doubles, rid)
    assert len(seen) == 1, f"{rid} reached the engines {len(seen)} times"
    engine, body = seen[0]
    assert body["lora_path"] == lora_name
    assert "log_metrics" in body  # the body the router rebuilt, not one lorapub sent to the worker directly
    chosen = served_by(doubles, reply)
    assert chosen.name == engine and reply["meta_info"]["lora_id"] == chosen.lora_id(lora_name)
    return engine


async def test_publish_bind_generate_reclaim_through_the_router(fleet, doubles):
    d = fleet.deployment
    a = await d.publish(lora_snapshot(1), "A")
    assert a.state is VersionState.PUBLISHED

    old = [d.session(f"old-{i}") for i in range(8)]
    chosen = set()
    for i, s in enumerate(old):
        reply = await s.generate(_request(f"old-{i}-t0", [20 + i, 21, 22, 23]))
        chosen.add(_check_exact(doubles, f"old-{i}-t0", reply, a.lora_name))
    assert chosen <= set(doubles)

    b = await d.publish(lora_snapshot(2), "B")
    for i, s in enumerate(old):  # tool turns after the publication keep version A
        reply = await s.generate(_request(f"old-{i}-t1", [20 + i, 21, 22, 23, 99]))
        _check_exact(doubles, f"old-{i}-t1", reply, a.lora_name)
        assert s.binding.lora_name == a.lora_name
    new = d.session("new")
    reply = await new.generate(_request("new-t0", [7, 7, 7]))
    _check_exact(doubles, "new-t0", reply, b.lora_name)

    # Nothing reached a worker without a managed lora_path: no base, no other name.
    managed = {a.lora_name, b.lora_name}
    for dbl in doubles.values():
        assert set(dbl.lora_paths()) <= managed, dbl.lora_paths()

    for s in old:
        await s.close()
    await d.settle()
    state = await d.state()
    assert state.versions[a.version].state is VersionState.RECLAIMED
    for dbl in doubles.values():
        assert a.lora_name not in dbl.registered() and dbl.physical_unloads.count(a.lora_name) == 1
        assert b.lora_name in dbl.registered()
    reply = await new.generate(_request("new-t1", [7, 7, 7, 1]))
    _check_exact(doubles, "new-t1", reply, b.lora_name)


async def test_publication_under_concurrent_load_through_the_router(fleet, doubles):
    """Sessions keep generating through the router while B is published: no request fails,
    none runs on base or on a version other than the session's own."""
    d = fleet.deployment
    a = await d.publish(lora_snapshot(1), "A")
    for dbl in doubles.values():
        dbl.decode_delay = 0.003
    rids = itertools.count()
    done = asyncio.Event()
    results: list[tuple[str, str, str, str]] = []  # (session, bound name, rid, serving engine)
    failures: list[BaseException] = []
    sent = 0

    async def rollout(worker: int) -> None:
        nonlocal sent
        rng = random.Random(worker)
        while not done.is_set():
            s = d.session(f"w{worker}-{next(rids)}")
            prompt = [worker, rng.randrange(1000)]
            for _turn in range(rng.randrange(2, 5)):
                rid = f"r{next(rids)}"
                sent += 1
                try:
                    reply = await s.generate(_request(rid, prompt, tokens=3))
                except BaseException as e:  # noqa: BLE001 - every failure is a test failure
                    failures.append(e)
                    return
                # Checked before any other task runs: the serving engine ran the bound version.
                engine = served_by(doubles, reply)
                assert reply["meta_info"]["lora_id"] == engine.lora_id(s.binding.lora_name)
                results.append((s.key.session_id, s.binding.lora_name, rid, engine.name))
                prompt = prompt + reply["output_ids"] + [rng.randrange(1000)]
            await s.close()

    workers = [asyncio.create_task(rollout(i)) for i in range(12)]
    await asyncio.sleep(0.3)
    b = await d.publish(lora_snapshot(2), "B")
    await asyncio.sleep(0.3)
    done.set()
    await asyncio.gather(*workers)
    await d.settle()

    assert not failures, failures[:3]
    assert len(results) == sent
    by_session: dict[str, set[str]] = {}
    for session, name, _rid, _engine in results:
        by_session.setdefault(session, set()).add(name)
    assert all(len(names) == 1 for names in by_session.values()), "a session changed version"
    bound = {n for names in by_session.values() for n in names}
    assert bound == {a.lora_name, b.lora_name}, bound
    # Every request reached exactly one engine, once, with the session's exact lora_path.
    seen: dict[str, list[str]] = {}
    for dbl in doubles.values():
        for body in dbl.received:
            if body.get("rid"):
                seen.setdefault(body["rid"], []).append(body["lora_path"])
    for _session, name, rid, _engine in results:
        assert seen[rid] == [name], (rid, seen.get(rid))
    assert {engine for *_, engine in results} == set(doubles), "the router used one worker only"
    state = await d.state()
    assert state.versions[a.version].state is VersionState.RECLAIMED
