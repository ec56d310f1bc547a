"""Engine-side staging on each supported release's own TokenizerManager LoRA code.

The staging (``lorapub.sglang_patch.staging``, what the patched server runs) drives the
release's own ``load_lora_adapter`` / ``load_lora_adapter_from_tensors`` / ``unload_lora_adapter``
(compiled from the release's files, runtime-patched or diff-patched, by ``harness``). Only the
GPU side is a stand-in: the scheduler fan-out, which for a tensor load deserializes the payload and
checks every tensor's SHA-256 as SGLang's TP worker does.

The last test serves the runtime routes from a real Starlette/FastAPI app under uvicorn (the
server SGLang runs) and drives them with :class:`~lorapub.adapters.sglang_wire.SGLangWireEngine`.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket

import pytest

from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.snapshot import Snapshot
from lorapub.sglang_patch import staging as es
from lorapub.testing.fixtures import lora_snapshot, peft_config
from lorapub.wire.codec import plan_to_json, token_params, token_to_json
from tests.sglang_patch import harness
from tests.sglang_patch.test_auth_levels import sglang_auth_importable  # noqa: F401 - a fixture
from tests.sglang_patch.test_lifecycle_gaps import RELEASES, patched_root, root_of

torch = pytest.importorskip("torch")
Request = pytest.importorskip("starlette.requests").Request  # module level: FastAPI resolves the annotation here
safetensors_torch = pytest.importorskip("safetensors.torch")
RECLAIM = {"X-Lorapub-Reclaim-Id": "cleanup-1"}
LIFE = "life-1"


def forking_dumps(obj) -> bytes:
    """SGLang's MultiprocessingSerializer.serialize: a ForkingPickler dump (torch's reductions)."""
    import torch.multiprocessing  # noqa: F401 - registers torch's reductions
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


@pytest.fixture(params=[(r, f) for r in RELEASES for f in ("runtime", "diff")], ids=lambda p: f"{p[0]}-{p[1]}")
def tm_class(request, tmp_path):
    release, form = request.param
    if form == "runtime":
        return harness.build_runtime_patched(root_of(release))
    return harness.build(patched_root(release), release)


def bf16_snapshot(seed: int, *, layers: int = 2, hidden: int = 32) -> Snapshot:
    """A seeded rank-4 PEFT adapter on q/v as bf16 torch tensors (what SGLang's tensor load takes)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        for m in ("q_proj", "v_proj"):
            p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            sd[f"{p}.lora_A.weight"] = (torch.randn(4, hidden, generator=g) * 0.05).to(torch.bfloat16)
            sd[f"{p}.lora_B.weight"] = (torch.randn(hidden, 4, generator=g) * 0.05).to(torch.bfloat16)
    return Snapshot(sd, peft_config(4))


def begin_body(snapshot: Snapshot, version_id: str, load: str, incarnation: str = LIFE, cap: int = 1024):
    key = VersionKey(1, version_id)
    token = AttemptToken(key, 1)
    plan = snapshot.plan(cap)
    return token, plan, {
        "token": token_to_json(token), "incarnation": incarnation, "lora_name": lora_name_for(key, snapshot.digest),
        "digest": snapshot.digest, "plan": plan_to_json(plan), "transport": {"kind": "http"}, "load": load,
    }


async def chunks_of(*parts):
    for p in parts:
        yield p


def raw_bucket(snapshot: Snapshot, bucket) -> bytes:
    from lorapub.adapters.sglang_wire import RawBucket

    return b"".join(bytes(v) for v in RawBucket(snapshot, bucket).views())


def params(token, index: int, fmt: str = "raw", incarnation: str = LIFE) -> dict:
    return {**token_params(token), "index": str(index), "incarnation": incarnation, "format": fmt}


async def stage_all(staging, snapshot, token, plan):
    for b in plan.buckets:
        blob = raw_bucket(snapshot, b)
        status, body = await staging.receive(params(token, b.index), chunks_of(blob[:7], blob[7:]), len(blob))
        assert status == 200 and body == {"incarnation": LIFE, "duplicate": False}, body


def new_staging(tm, tmp_path):
    return es.EngineStaging(es.SGLangHooks(lambda: tm, serialize=forking_dumps), incarnation=LIFE,
                            stash_root=str(tmp_path / "engine-disk"))


@pytest.mark.parametrize("load", ["dir", "tensors"])
async def test_staged_adapter_loads_pinned_through_the_releases_own_load(tm_class, load, tmp_path):
    tm = tm_class()
    staging = new_staging(tm, tmp_path)
    snapshot = bf16_snapshot(3)
    token, plan, body = begin_body(snapshot, "A", load)
    assert len(plan.buckets) > 1
    assert await staging.begin(body) == (200, {"incarnation": LIFE, "duplicate": False})
    assert await staging.begin(body) == (200, {"incarnation": LIFE, "duplicate": True})
    await stage_all(staging, snapshot, token, plan)
    name = body["lora_name"]
    status, receipt = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200, receipt
    ref = tm.lora_registry.get_all_adapters()[name]
    assert ref.pinned and receipt["lora_id"] == ref.lora_id and receipt["digest"] == snapshot.digest
    assert tm.rank_ops == [("load", name)]  # the release's own load reached the ranks once
    if load == "dir":  # the folder the engine wrote on its own disk is a PEFT adapter of exactly these bytes
        assert ref.lora_path == receipt["lora_path"] and ref.lora_path.startswith(str(tmp_path / "engine-disk"))
        loaded = safetensors_torch.load_file(os.path.join(ref.lora_path, "adapter_model.safetensors"))
        assert json.load(open(os.path.join(ref.lora_path, "adapter_config.json"))) == snapshot.serving_config
    else:  # SGLang's tensor load: nothing on disk, each rank checked every tensor's SHA-256
        assert ref.lora_path == "__tensor__" and not os.path.exists(str(tmp_path / "engine-disk" / LIFE / "1-A-a1"))
        loaded = tm.rank_tensors[name]
    assert sorted(loaded) == snapshot.tensor_names
    for n in snapshot.tensor_names:
        assert torch.equal(loaded[n], snapshot.tensor(n)), n
    assert staging.report()["bytes"] == 0  # the staged bytes were freed by the load
    # a duplicate end answers the same receipt and loads nothing twice
    status, again = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200 and again["lora_id"] == receipt["lora_id"] and again["duplicate"]
    assert tm.rank_ops == [("load", name)]
    # the managed pinned adapter refuses an ordinary unload (lorapub's patch 3)
    refused = await tm.unload_lora_adapter(harness.UnloadLoRAAdapterReqInput(lora_name=name), harness.Request(headers={}))
    assert not refused.success and "managed by lorapub" in refused.error_message
    # cleanup: tombstone, answer what was loaded, free; then the reclaim-authorised unload
    status, cleaned = await staging.cleanup({"token": body["token"]})
    assert status == 200 and cleaned["loaded"]["lora_id"] == ref.lora_id
    assert (await tm.unload_lora_adapter(harness.UnloadLoRAAdapterReqInput(lora_name=name),
                                         harness.Request(headers=RECLAIM))).success
    assert name not in tm.lora_registry.get_all_adapters()
    assert staging.report()["attempts"] == {} and not os.path.exists(staging.folder_of(token))
    # late messages are refused and recreate nothing
    for status, answer in (await staging.begin(body),
                           await staging.receive(params(token, 0), chunks_of(b"x"), 1),
                           await staging.end({"token": body["token"], "incarnation": LIFE})):
        assert status == 409 and answer["error"]["code"] == "STAGE_TOMBSTONE", answer
    assert staging.report()["attempts"] == {} and tm.rank_ops == [("load", name), ("unload", name)]


async def test_bytes_that_do_not_verify_are_refused_and_nothing_is_loaded(tm_class, tmp_path):
    tm = tm_class()
    staging = new_staging(tm, tmp_path)
    snapshot = lora_snapshot(5, layers=1, hidden=16, rank=2)
    token, plan, body = begin_body(snapshot, "B", "dir", cap=1 << 20)
    assert (await staging.begin(body))[0] == 200
    blob = bytearray(raw_bucket(snapshot, plan.buckets[0]))
    status, answer = await staging.receive(params(token, 0), chunks_of(bytes(blob[:-1])), len(blob) - 1)
    assert status == 400 and "plan" in answer["error"]["message"]
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 409 and answer["error"]["code"] == "STAGE_INCOMPLETE"
    blob[3] ^= 1  # one flipped bit: stored, checked beside the next bucket, refused at end before any load
    status, answer = await staging.receive(params(token, 0), chunks_of(bytes(blob)), len(blob))
    assert status == 200, answer
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 400 and answer["error"]["code"] == "STAGE_DIGEST", answer
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 409 and answer["error"]["code"] == "STAGE_FAILED"  # the attempt stays failed
    assert tm.rank_ops == []
    # a safetensors blob of the bucket (what Snapshot.bucket_bytes carries) is taken too
    token, plan, body = begin_body(snapshot, "B2", "dir", cap=1 << 20)
    assert (await staging.begin(body))[0] == 200
    blob = snapshot.bucket_bytes(plan, 0)
    status, answer = await staging.receive(params(token, 0, "safetensors"), chunks_of(blob), len(blob))
    assert status == 200, answer
    status, answer = await staging.receive(params(token, 0, "safetensors"), chunks_of(blob), len(blob))
    assert (status, answer["duplicate"]) == (200, True)
    status, answer = await staging.end({"token": body["token"], "incarnation": LIFE})
    assert status == 200 and tm.rank_ops == [("load", body["lora_name"])], answer


async def test_begin_refuses_another_life_a_forged_plan_a_loaded_name_and_a_full_engine(tm_class, tmp_path):
    tm = tm_class(max_loaded_loras=1)
    staging = new_staging(tm, tmp_path)
    snapshot = lora_snapshot(6, layers=1, hidden=16, rank=2)
    _, _, body = begin_body(snapshot, "C", "dir", incarnation="an-old-life")
    assert (await staging.begin(body))[1]["error"]["code"] == "STAGE_LIFE"
    _, _, body = begin_body(snapshot, "C", "dir")
    forged = json.loads(json.dumps(body))
    forged["plan"]["buckets"][0]["entries"][0]["sha256"] = "0" * 64
    status, answer = await staging.begin(forged)
    assert status == 400 and answer["error"]["code"] == "STAGE_DIGEST"
    wrong_name = dict(body, lora_name=body["lora_name"].replace("C", "D"))
    assert (await staging.begin(wrong_name))[0] == 400
    other = await tm.load_lora_adapter(harness.LoadLoRAAdapterReqInput(lora_name="third-party", lora_path="/x", pinned=True))
    assert other.success
    status, answer = await staging.begin(body)
    assert status == 409 and answer["error"]["code"] == "STAGE_CAPACITY"
    assert staging.report()["attempts"] == {}


# -- the runtime routes in a real Starlette server ------------------------------------------------------
async def serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["http", "shm", "gloo"])
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")
async def test_the_runtime_routes_stage_each_transport_into_the_releases_own_code(release, kind, sglang_auth_importable,
                                                                                  tmp_path, monkeypatch):
    fastapi = pytest.importorskip("fastapi")
    from starlette.responses import JSONResponse

    from lorapub.adapters.sglang_wire import HTTPBytes, SameHostIPC, SGLangWireEngine, TorchDistributed
    from lorapub.core.effects import SendBegin
    from lorapub.sglang_patch import routes

    root = root_of(release)
    cls = harness.build_runtime_patched(root)
    sglang_auth_importable(release)
    monkeypatch.setenv("LORAPUB_ENGINE_STASH", str(tmp_path / "engine-disk"))
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv("LORAPUB_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setattr(routes, "STAGING", None)
    tm = cls()
    app = fastapi.FastAPI()
    app.state.tokenizer_manager = tm

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        try:
            lora_id = await tm.generate(body.get("rid", "probe"), body["lora_path"])
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        return {"text": "", "output_ids": [], "meta_info": {"lora_id": lora_id}}

    @app.post("/unload_lora_adapter")
    async def unload(request: Request):
        body = await request.json()
        result = await tm.unload_lora_adapter(harness.UnloadLoRAAdapterReqInput(lora_name=body["lora_name"]), request)
        return JSONResponse({"success": result.success, "error_message": result.error_message},
                            status_code=200 if result.success else 400)

    routes.add_state_route(app, release)
    staging = routes.add_staging_routes(app, release)
    assert staging is routes.STAGING and staging.stash_root.startswith(str(tmp_path / "engine-disk"))
    staging.hooks._serialize = forking_dumps
    server, task, url = await serve(app)
    transport = {"http": HTTPBytes, "shm": lambda: SameHostIPC(shm_dir=str(tmp_path / "shm")),
                 "gloo": lambda: TorchDistributed(timeout=10.0)}[kind]()
    engine = SGLangWireEngine("e0", url, probe_timeout=10)
    engine.use_transport(transport)
    try:
        snapshot = bf16_snapshot(9)
        key = VersionKey(1, "A")
        token = AttemptToken(key, 1)
        plan = snapshot.plan(256)
        name = lora_name_for(key, snapshot.digest)
        inc = await engine.incarnation()
        assert inc == routes.INCARNATION
        source = transport.source(snapshot, plan)
        assert await engine.begin(SendBegin("e0", inc, token, name, snapshot.digest, plan)) == inc
        for b in plan.buckets:  # streamed through Starlette's request.stream(), a /dev/shm file, or a broadcast
            if not source.collective:
                await source.send(token, b.index, ("e0",))
                assert await engine.receive_bucket(token, b.index, source.payload(token, b.index)) == inc
            else:
                _, got = await asyncio.gather(source.send(token, b.index, ("e0",)),
                                              engine.receive_bucket(token, b.index, b""))
                assert got == inc
        ready = await engine.end(token)
        ref = tm.lora_registry.get_all_adapters()[name]
        assert (ready.digest, ready.incarnation, ready.lora_id) == (snapshot.digest, inc, ref.lora_id) and ref.pinned
        state = await engine.state()
        assert state["staging"]["bytes"] == 0 and str(token) in state["staging"]["attempts"]
        assert state["staging"]["collectives"] == (len(plan.buckets) if kind == "gloo" else 0)
        loaded = tm.rank_tensors.get(name) if kind == "shm" else safetensors_torch.load_file(
            os.path.join(ref.lora_path, "adapter_model.safetensors"))
        assert all(torch.equal(loaded[n], snapshot.tensor(n)) for n in snapshot.tensor_names)
        assert await engine.cleanup(token, name) == inc
        assert name not in tm.lora_registry.get_all_adapters()
        assert (await engine.state())["staging"]["attempts"] == {}
        with pytest.raises(Exception, match="STAGE_TOMBSTONE|cleaned up"):
            await engine.begin(SendBegin("e0", inc, token, name, snapshot.digest, plan))
    finally:
        await engine.close()
        server.should_exit = True
        await task
