"""Every EngineAdmin in this repository passes lorapub.testing's conformance suite.

The GPU engines (tests/gpu) run the same suite on their device.
"""

from __future__ import annotations

import pytest

from lorapub.testing import ConformanceFailure, SGLangUnderTest, check_engine_admin
from lorapub.testing.conformance import CHECKS
from lorapub.testing.memory_engine import MemoryUnderTest
from tests.e2e.conftest import TRANSPORTS, make_transport


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_sglang_engine_adapter_against_the_double(tmp_path, kind):
    (tmp_path / "shared").mkdir()

    async def factory():
        return await SGLangUnderTest.start(str(tmp_path / "engine-disk"),
                                           transport=make_transport(kind, str(tmp_path / "shared")))

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
        engine = await Resending.start(str(tmp_path / "engine-disk"))
        engine._generate = engine.admin.generate
        engine.admin.generate = engine._resend
        return engine

    with pytest.raises(ConformanceFailure, match="generation_never_resent"):
        await check_engine_admin(factory)
