"""Servers launched with --api-key and --admin-api-key, as production SGLang runs.

The doubles enforce the keys as SGLang's middleware does (its own ``decide_request_auth``):
NORMAL routes (``/generate``, ``/v1/models``) want the API key when one is set; ADMIN_OPTIONAL
routes (load, unload, pause, continue, flush, lorapub's state route) want the admin key when
one is set, else the API key.
"""

from __future__ import annotations

import aiohttp
import pytest

from lorapub.adapters.sglang_http import SGLangHTTP
from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.adapters.sglang_wire import SGLangWireEngine
from lorapub.wire.routes import RECLAIM_HEADER, STATE_ROUTE
from lorapub.core.version import VersionState
from lorapub.errors import EngineError
from lorapub.runtime.deployment import Deployment, deploy
from lorapub.runtime.overwrite import FIXED_LORA_NAME
from lorapub.testing import SGLangDouble, lora_snapshot
from tests.e2e.conftest import FAST

API, ADMIN = "sk-api-3f9a1c", "sk-admin-77d0e2"
GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


async def start_doubles(shared_dir, **keys) -> dict:
    made = {}
    for n in ("e0", "e1"):
        d = SGLangDouble(n, **keys)
        d.shm_dir = str(shared_dir)  # where a shared-folder transport's bucket files are read
        made[n] = await d.start()
    return made


@pytest.fixture
async def keyed(shared_dir):
    pair = await start_doubles(shared_dir, api_key=API, admin_api_key=ADMIN)
    yield pair
    for d in pair.values():
        await d.stop()


def bearer(key):
    return {"Authorization": f"Bearer {key}"} if key else {}


async def call(double, method, path, key=None, body=None, headers=None):
    async with aiohttp.ClientSession() as http:
        async with http.request(method, double.url + path, json=body, headers={**bearer(key), **(headers or {})}) as r:
            return r.status, await r.json(content_type=None) if r.content_type == "application/json" else await r.text()


async def keyed_deployment(doubles, transport, **keys):
    engines = {n: SGLangWireEngine(n, d.url, **keys) for n, d in doubles.items()}
    return engines, await Deployment(engines, epoch=1, deadlines=FAST, transport=transport).start()


async def test_without_the_admin_key_nobody_loads_unloads_cleans_up_or_reads_state(keyed, transport, tmp_path):
    engines, dep = await keyed_deployment(keyed, transport, api_key=API, admin_api_key=ADMIN)
    a = await dep.publish(lora_snapshot(1), "A")
    d = keyed["e0"]
    path = lora_snapshot(9).save_peft_dir(str(tmp_path / "intruder"))
    for key in (None, API, "sk-guess"):  # no key, the API key (all a rollout worker holds), a wrong key
        assert await call(d, "POST", "/load_lora_adapter", key, {"lora_name": "intruder", "lora_path": path}) == (
            401, {"error": "Unauthorized"})
        assert (await call(d, "POST", "/unload_lora_adapter", key, {"lora_name": a.lora_name}))[0] == 401
        assert (await call(d, "POST", "/unload_lora_adapter", key, {"lora_name": a.lora_name},
                           headers={RECLAIM_HEADER: "cleanup-forged"}))[0] == 401  # cleanup/reclaim
        assert (await call(d, "GET", STATE_ROUTE, key))[0] == 401
        for admin_route in ("/pause_generation", "/continue_generation", "/flush_cache"):
            assert (await call(d, "POST", admin_route, key, {}))[0] == 401
    assert d.registered() == [a.lora_name] and d.physical_unloads == [] and not d.is_paused
    # the same through lorapub's own clients holding only the API key: definite, typed, nothing done
    worker = SGLangWireEngine("e0", d.url, api_key=API)
    with pytest.raises(EngineError, match=f"e0 {STATE_ROUTE} answered 401: Unauthorized"):
        await worker.incarnation()
    with pytest.raises(EngineError, match="401: Unauthorized"):
        await worker.reclaim(a.lora_name, "reclaim-forged")
    with pytest.raises(EngineError, match="401: Unauthorized"):
        await worker.client.admin("/load_lora_adapter", {"lora_name": "intruder", "lora_path": path})
    assert d.registered() == [a.lora_name] and d.physical_unloads == []
    await worker.close()
    for e in engines.values():
        await e.close()


async def test_the_api_key_generates_but_does_not_administer(keyed):
    d = keyed["e0"]
    assert (await call(d, "POST", "/generate", None, GEN))[0] == 401
    assert (await call(d, "POST", "/generate", ADMIN, GEN))[0] == 401  # NORMAL routes want the API key itself
    status, out = await call(d, "POST", "/generate", API, GEN)
    assert status == 200 and out["output_ids"]
    assert (await call(d, "GET", "/v1/models", API))[0] == 200
    assert (await call(d, "GET", "/health"))[0] == 200  # probes need no key, as in SGLang
    client = SGLangHTTP("e0", d.url, api_key=API)
    assert (await client.generate(GEN))["output_ids"]
    with pytest.raises(EngineError, match="401: Unauthorized"):
        await client.admin("/pause_generation", {"mode": "abort"})
    assert not d.is_paused
    await client.close()


async def test_a_deployment_with_both_keys_publishes_binds_generates_and_reclaims(keyed, transport):
    engines, dep = await keyed_deployment(keyed, transport, api_key=API, admin_api_key=ADMIN)
    a = await dep.publish(lora_snapshot(1), "A")
    s = dep.session("s")
    first = await s.generate(GEN)
    assert s.binding.version == a.version and first["meta_info"]["lora_id"]
    b = await dep.publish(lora_snapshot(2), "B")
    assert (await s.generate(GEN))["meta_info"]["lora_id"] == first["meta_info"]["lora_id"]  # still A
    await s.close()
    await dep.settle()
    state = await dep.state()
    assert state.versions[a.version].state is VersionState.RECLAIMED
    assert state.versions[b.version].state is VersionState.PUBLISHED
    for d in keyed.values():
        assert d.registered() == [b.lora_name] and d.physical_unloads == [a.lora_name]
        assert d.refused == []  # every call carried the right key
    for e in engines.values():
        await e.close()


@pytest.mark.parametrize(
    "server, client",
    [
        ({"api_key": API}, {"api_key": API}),  # --api-key alone: admin routes take the API key
        ({"admin_api_key": ADMIN}, {"admin_api_key": ADMIN}),  # --admin-api-key alone: generation is open
    ],
    ids=["api-key-only", "admin-key-only"],
)
async def test_one_key_servers_work_with_that_key(server, client, transport, shared_dir):
    doubles = await start_doubles(shared_dir, **server)
    try:
        engines, dep = await keyed_deployment(doubles, transport, **client)
        a = await dep.publish(lora_snapshot(1), "A")
        s = dep.session("s")
        await s.generate(GEN)
        await dep.publish(lora_snapshot(2), "B")
        await s.close()
        await dep.settle()
        assert (await dep.state()).versions[a.version].state is VersionState.RECLAIMED
        assert all(d.refused == [] for d in doubles.values())
        for e in engines.values():
            await e.close()
    finally:
        for d in doubles.values():
            await d.stop()


async def test_the_switch_off_path_carries_the_keys_on_stock_sglang(tmp_path):
    doubles = {n: await SGLangDouble(n, stock=True, api_key=API, admin_api_key=ADMIN).start() for n in ("e0", "e1")}
    try:
        keyless = {n: SGLangOverwriteAdmin(n, d.url, api_key=API) for n, d in doubles.items()}
        dep = await deploy(keyless, epoch=1, enabled=False, stash_dir=str(tmp_path / "a"))
        with pytest.raises(EngineError, match="pause_generation answered 401: Unauthorized"):
            await dep.publish(lora_snapshot(1), "A")
        assert not any(d.is_paused for d in doubles.values())
        admins = {n: SGLangOverwriteAdmin(n, d.url, api_key=API, admin_api_key=ADMIN) for n, d in doubles.items()}
        dep = await deploy(admins, epoch=1, enabled=False, stash_dir=str(tmp_path / "b"))
        await dep.publish(lora_snapshot(1), "A")
        await dep.publish(lora_snapshot(2), "B")
        assert (await dep.session("s").generate(GEN))["output_ids"]
        for d in doubles.values():
            assert d.registered() == [FIXED_LORA_NAME] and not d.is_paused
        for e in (*keyless.values(), *admins.values()):
            await e.close()
    finally:
        for d in doubles.values():
            await d.stop()


async def test_keys_never_show_in_repr_or_errors(keyed, tmp_path):
    d = keyed["e0"]
    made = [
        SGLangHTTP("e0", d.url, api_key=API, admin_api_key=ADMIN),
        SGLangWireEngine("e0", d.url, api_key=API, admin_api_key=ADMIN),
        SGLangOverwriteAdmin("e0", d.url, api_key=API, admin_api_key=ADMIN),
    ]
    texts = [repr(m) for m in made] + [str(m) for m in made] + [repr(d), repr(vars(made[0]).keys())]
    wrong = SGLangWireEngine("e0", d.url, api_key=API + "x", admin_api_key=ADMIN + "x")
    for attempt in (wrong.incarnation(), wrong.generate({**GEN, "lora_path": "x"})):
        with pytest.raises(EngineError) as e:
            await attempt
        texts += [str(e.value), repr(e.value.details)]
    assert all(API not in t and ADMIN not in t for t in texts), texts
    assert "keys=api_key+admin_api_key" in repr(made[0])
    for m in (*made, wrong):
        await m.close()
