"""The SGLang HTTP adapter passes the conformance suite against servers that require keys."""

from __future__ import annotations

import pytest

from lorapub.testing import SGLangUnderTest, check_engine_admin
from lorapub.testing.conformance import CHECKS


@pytest.mark.parametrize(
    "keys",
    [{"api_key": "sk-api", "admin_api_key": "sk-admin"}, {"api_key": "sk-api"}, {"admin_api_key": "sk-admin"}],
    ids=["both-keys", "api-key-only", "admin-key-only"],
)
async def test_sglang_http_adapter_against_a_keyed_double(tmp_path, keys):
    doubles = []

    async def factory():
        engine = await SGLangUnderTest.start(str(tmp_path / "stash"), **keys)
        doubles.append(engine.double)
        return engine

    assert await check_engine_admin(factory) == [c.__name__ for c in CHECKS]
    assert all(d.refused == [] for d in doubles)  # every call carried the key its route wants
