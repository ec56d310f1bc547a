"""Every EngineAdmin in this repository passes lorapub.testing's conformance suite.

The GPU engines (tests/gpu) run the same suite on their device.
"""

from __future__ import annotations

import pytest

from lorapub.testing import ConformanceFailure, SGLangUnderTest, check_engine_admin
from lorapub.testing.conformance import CHECKS
from lorapub.testing.memory_engine import MemoryUnderTest


async def test_sglang_http_adapter_against_the_double(tmp_path):
    async def factory():
        return await SGLangUnderTest.start(str(tmp_path / "stash"))

    assert await check_engine_admin(factory) == [c.__name__ for c in CHECKS]


async def test_memory_engine_used_by_the_fault_machine():
    assert await check_engine_admin(MemoryUnderTest.start) == [c.__name__ for c in CHECKS]


async def test_the_suite_catches_an_admin_that_resends_generations(tmp_path):
    class Resending(SGLangUnderTest):
        async def _resend(self, payload):
            try:
                return await self._generate(payload)
            except Exception:
                return await self._generate(payload)  # the bug the suite must see

    async def factory():
        engine = await Resending.start(str(tmp_path / "stash"))
        engine._generate = engine.admin.generate
        engine.admin.generate = engine._resend
        return engine

    with pytest.raises(ConformanceFailure, match="generation_never_resent"):
        await check_engine_admin(factory)
