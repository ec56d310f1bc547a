"""The engine adapter passes the EngineAdmin conformance suite on every transport's options
(against the contract double, which runs the same staging code as lorapub's SGLang patch; the
shared-folder transport and plain HTTP run in tests/conformance)."""

from __future__ import annotations

import pytest

from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, TorchDistributed
from lorapub.testing import SGLangUnderTest, check_engine_admin
from lorapub.testing.conformance import CHECKS


def transports(tmp_path):
    return {
        "http-dir": lambda: HTTPBytes(),
        "http-dir-loop": lambda: HTTPBytes(sender="loop"),
        "http-tensors": lambda: HTTPBytes(load="tensors"),
        "shm": lambda: SameHostIPC(shm_dir=str(tmp_path)),
        "gloo": lambda: TorchDistributed(timeout=10.0),
    }


@pytest.mark.parametrize("kind", ["http-dir", "http-dir-loop", "http-tensors", "shm", "gloo"])
async def test_wire_engine_passes_the_conformance_suite(kind, tmp_path):
    make = transports(tmp_path / "shm")[kind]
    (tmp_path / "shm").mkdir()

    async def factory():
        return await SGLangUnderTest.start(str(tmp_path / "engine-disk"), transport=make())  # the kit's own timeouts

    assert await check_engine_admin(factory) == [c.__name__ for c in CHECKS]
