"""A rollout worker holds only the API key (docs/embedding.md): it starts, binds and generates on the
registry a publisher holding both keys shares, and never needs the admin key to do so."""

from __future__ import annotations

import logging

from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.runtime.deployment import Deployment
from lorapub.testing import SGLangDouble, lora_snapshot
from tests.e2e.conftest import FAST

API, ADMIN = "sk-api-3f9a1c", "sk-admin-77d0e2"
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


async def test_a_worker_holding_only_the_api_key_starts_binds_and_generates(caplog):
    double = await SGLangDouble("e0", api_key=API, admin_api_key=ADMIN).start()
    publisher_engine = SGLangWireEngine("e0", double.url, api_key=API, admin_api_key=ADMIN)
    publisher = await Deployment({"e0": publisher_engine}, epoch=1, deadlines=FAST).start()
    worker_engine = SGLangWireEngine("e0", double.url, api_key=API)
    try:
        a = await publisher.publish(lora_snapshot(1), "A")
        with caplog.at_level(logging.INFO, logger="lorapub.runtime.admission"):
            worker = await Deployment({"e0": worker_engine}, epoch=1, deadlines=FAST,
                                      registry=publisher.registry, own_engines=False).start()
        # the check the worker cannot run (its inventory is an admin route) is said, naming what was skipped
        assert any("managed-adapter prefix is not checked here" in r.getMessage() for r in caplog.records)
        try:
            session = worker.session("s")
            out = await session.generate(GEN)  # its stamp attested by the life the registry recorded
            assert session.binding.version == a.version and out["output_ids"]
            await session.close()
            # what the worker was refused is reading the state route, never a load, unload or pause
            assert {(method, path) for method, path, _ in double.refused} <= {("GET", "/lorapub/state")}
            # its health is not blocked by what it may not read: the engine is named in a note, not unreachable
            health = await worker.reconcile()
            assert health.healthy, health.describe()
            assert any(n.startswith("e0: not administered here") for n in health.notes), health.notes
        finally:
            await worker.close()
    finally:
        await publisher.close()
        await publisher_engine.close()
        await worker_engine.close()
        await double.stop()
