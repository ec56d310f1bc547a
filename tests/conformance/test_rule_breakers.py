"""The conformance suite fails engines that break the contract, each with a message naming the
check and the rule; it bounds every check by a deadline and lets cancellation through.

Each toy engine is :class:`lorapub.testing.MemoryEngine` with one rule broken.
"""

from __future__ import annotations

import asyncio
import re
import types

import pytest

from lorapub.core.identity import is_managed_name
from lorapub.testing import ConformanceFailure, MemoryEngine, check_engine_admin
from lorapub.testing.conformance import CHECKS, NotCheckedWarning
from lorapub.testing.memory_engine import MemoryUnderTest

ALL = [c.__name__ for c in CHECKS]


def factory_of(engine_class, under_test=MemoryUnderTest):
    async def factory():
        engine = under_test()
        engine.admin = engine.engine = engine_class("e0")
        return engine

    return factory


class BaseFallback(MemoryEngine):
    """Runs a generation naming an adapter it does not hold on the base model."""

    async def generate(self, payload):
        if not self.serves(payload.get("lora_path")):
            self.requests += 1
            return {"text": "base", "meta_info": {"lora_path": None, "engine": self.name}}
        return await super().generate(payload)


class NoDigestCheck(MemoryEngine):
    """Loads whatever bytes arrived, whether or not they match the manifest."""

    def _verify(self, request, buckets):
        pass


class AcceptsStaleIncarnation(MemoryEngine):
    """Takes a begin meant for any life of the engine as one for this life."""

    async def _begin(self, request):
        from attrs import evolve

        return await super()._begin(evolve(request, incarnation=self.incarnation_id))


class HangingReclaim(MemoryEngine):
    """Its reclaim never returns."""

    async def reclaim(self, lora_name, reclaim_id):
        await asyncio.Event().wait()


class EndAnswersADict(MemoryEngine):
    """Its end answers a dict where a ReadyLocal is due."""

    async def end(self, token):
        ready = await super().end(token)
        return {"engine": ready.engine, "digest": ready.digest, "incarnation": ready.incarnation}


class GenerateAnswersAMappingProxy(MemoryEngine):
    """Its generate answers a read-only mapping where a dict is due (lorapub stamps its provenance,
    ``result["lorapub"]``, into the engine's dict: a read-only reply would carry none)."""

    async def generate(self, payload):
        return types.MappingProxyType(await super().generate(payload))


@pytest.mark.parametrize(
    "engine_class, check, says",
    [
        (BaseFallback, "no_fallback_on_a_missing_version", "VersionMissing"),
        (NoDigestCheck, "end_verifies_the_digest", "do not match the manifest"),
        (AcceptsStaleIncarnation, "stale_incarnation_refused", "another life"),
        (EndAnswersADict, "idempotent_lifecycle", "end returned a dict, not a ReadyLocal"),
        (GenerateAnswersAMappingProxy, "reclaim_waits_for_native_refs", "generate returned a mappingproxy, not a dict"),
    ],
    ids=["base-fallback", "no-digest-check", "stale-incarnation", "end-returns-dict", "generate-returns-mappingproxy"],
)
async def test_the_suite_fails_an_engine_that_breaks_a_rule(engine_class, check, says):
    with pytest.raises(ConformanceFailure) as caught:
        await check_engine_admin(factory_of(engine_class))
    message = str(caught.value)
    assert message.startswith(f"{check}: "), message
    assert says in message, message


async def test_a_check_that_overruns_its_deadline_fails_naming_the_check_and_the_deadline():
    with pytest.raises(ConformanceFailure) as caught:
        await asyncio.wait_for(check_engine_admin(factory_of(HangingReclaim), deadline=2.0), 30)
    message = str(caught.value)
    assert message.startswith("reclaim_waits_for_native_refs: "), message
    assert re.search(r"deadline of 2 s", message), message


async def test_cancelling_the_suite_cancels_it_and_is_never_a_conformance_failure():
    stuck = asyncio.Event()

    class StuckEnd(MemoryEngine):
        """Its end never answers once asked to fail (the suite waits on it inside a check)."""

        async def end(self, token):
            if ("end", "error") in self._planned:
                stuck.set()
                await asyncio.Event().wait()
            return await super().end(token)

    suite = asyncio.ensure_future(check_engine_admin(factory_of(StuckEnd), deadline=60.0))
    await asyncio.wait_for(stuck.wait(), 30)
    suite.cancel()
    with pytest.raises(asyncio.CancelledError):
        await suite


class NoRestartHook:
    """An engine under test that offers every required hook and no ``restart``."""

    def __init__(self) -> None:
        self._inner = MemoryUnderTest()

    def __getattr__(self, name):
        if name == "restart":
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def admin(self):
        return self._inner.admin

    @admin.setter
    def admin(self, value):
        self._inner.admin = value

    @property
    def engine(self):
        return self._inner.engine

    @engine.setter
    def engine(self, value):
        self._inner.engine = value


async def test_a_check_the_engine_cannot_take_is_reported_not_checked_never_passed():
    with pytest.warns(NotCheckedWarning, match="new_incarnation_after_restart"):
        result = await check_engine_admin(factory_of(MemoryEngine, NoRestartHook))
    assert list(result) == [n for n in ALL if n != "new_incarnation_after_restart"]
    assert "new_incarnation_after_restart" not in result
    assert list(result.not_checked) == ["new_incarnation_after_restart"]
    assert "restart" in result.not_checked["new_incarnation_after_restart"]
    assert "not checked" in repr(result)


async def test_the_new_rules_hold_for_the_engines_that_pass():
    """What the new checks see on MemoryEngine, said directly: no fallback, digest verified."""
    from lorapub.errors import EngineError, VersionMissing
    from lorapub.testing.conformance import _begin

    under = MemoryUnderTest()
    request, snapshot, plan, _ = await _begin(under, 1, 5)
    for i in range(len(plan.buckets)):
        payload = bytearray(snapshot.bucket_bytes(plan, i))
        payload[-1] ^= 0xFF
        await under.admin.receive_bucket(request.token, i, bytes(payload))
    with pytest.raises(EngineError, match="SHA-256"):
        await under.admin.end(request.token)
    assert is_managed_name(request.lora_name) and request.lora_name not in await under.served()
    with pytest.raises(VersionMissing):
        await under.admin.generate(under.generation(request.lora_name))


async def test_one_call_that_never_answers_fails_in_the_call_deadline_not_the_whole_checks():
    """A reclaim that never answers costs the kit's call deadline, not the check's 60 s."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ConformanceFailure) as caught:
        await asyncio.wait_for(check_engine_admin(factory_of(HangingReclaim), call_deadline=0.5), 50)
    assert loop.time() - started < 30  # two checks reclaim: each fails in its call deadline
    assert caught.value.failures["reclaim_waits_for_native_refs"] == (
        "reclaim on e0 did not answer within its deadline of 0.5 s")
    from lorapub.testing.conformance import DEFAULT_CALL_DEADLINE, DEFAULT_DEADLINE
    assert DEFAULT_CALL_DEADLINE <= DEFAULT_DEADLINE / 4  # proportionate: a call is a small part of a check


class BreaksTwoRules(BaseFallback, NoDigestCheck):
    """Runs a missing version on the base model and loads bytes that do not match the manifest."""


async def test_every_broken_rule_is_reported_not_only_the_first():
    with pytest.raises(ConformanceFailure) as caught:
        await check_engine_admin(factory_of(BreaksTwoRules))
    failure = caught.value
    # (the base-model fallback also breaks the restart check's "VersionMissing after a restart")
    broken = ["end_verifies_the_digest", "no_fallback_on_a_missing_version", "new_incarnation_after_restart"]
    assert list(failure.failures) == broken
    lines = str(failure).splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == broken  # one line per check, in the suite's order
    assert "3 of 9 checks failed" in lines[-1]
    assert list(failure.result) == [n for n in ALL if n not in failure.failures]  # the rest ran and passed


async def test_a_factory_that_fails_stops_the_run_naming_it():
    async def broken():
        raise OSError("no port free")

    with pytest.raises(ConformanceFailure, match="idempotent_lifecycle: making the engine under test: OSError") as e:
        await check_engine_admin(broken)
    assert all(why.startswith("not run") for name, why in e.value.failures.items() if name != ALL[0])


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "60", True])
async def test_a_deadline_that_is_not_a_positive_number_is_invalid_input(bad):
    from lorapub import InvalidInput

    for option in ("deadline", "call_deadline"):
        with pytest.raises(InvalidInput, match=f"{option}=") as e:
            await check_engine_admin(factory_of(MemoryEngine), **{option: bad})
        assert e.value.code == "INVALID_INPUT"
