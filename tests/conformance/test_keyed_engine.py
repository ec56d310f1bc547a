"""The SGLang engine adapter passes the conformance suite against servers that require keys, on every transport."""

from __future__ import annotations

import pytest

from lorapub.testing import SGLangUnderTest, check_engine_admin
from lorapub.testing.conformance import CHECKS
from tests.e2e.conftest import TRANSPORTS, make_transport


@pytest.mark.parametrize(
    "keys",
    [{"api_key": "sk-api", "admin_api_key": "sk-admin"}, {"api_key": "sk-api"}, {"admin_api_key": "sk-admin"}],
    ids=["both-keys", "api-key-only", "admin-key-only"],
)
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_sglang_engine_adapter_against_a_keyed_double(tmp_path, keys, kind):
    doubles = []
    (tmp_path / "shared").mkdir()

    async def factory():
        engine = await SGLangUnderTest.start(str(tmp_path / "engine-disk"), **keys,
                                             transport=make_transport(kind, str(tmp_path / "shared")))
        doubles.append(engine.double)
        return engine

    assert await check_engine_admin(factory) == [c.__name__ for c in CHECKS]
    assert all(d.refused == [] for d in doubles)  # every call carried the key its route wants
