"""No caller-controlled string reaches a file path, and the switch-off path never leaves generation paused."""

from __future__ import annotations

import asyncio
import os

import attrs
import pytest

from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown
from lorapub.runtime.overwrite import FIXED_LORA_NAME, OverwriteDeployment
from lorapub.testing import lora_snapshot
from tests.helpers.waiting import until


class FakeOverwriteAdmin:
    """An OverwriteAdmin that records every call; ``fail[op]`` is raised by that op."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[str] = []
        self.fail: dict[str, BaseException] = {}
        self.loaded: dict[str, str] = {}
        self.paused = False
        self.gate: asyncio.Event | None = None  # flush_cache waits on it when set
        self.continue_gate: asyncio.Event | None = None  # continue_generation waits on it when set
        self.load_gate: asyncio.Event | None = None  # load_adapter waits on it when set

    async def _op(self, op: str) -> None:
        self.calls.append(op)
        if op in self.fail:
            raise self.fail[op]

    async def pause_generation(self) -> None:
        await self._op("pause")
        self.paused = True

    async def continue_generation(self) -> None:
        await self._op("continue")
        if self.continue_gate is not None:
            await self.continue_gate.wait()
        self.paused = False

    async def flush_cache(self) -> None:
        await self._op("flush")
        if self.gate is not None:
            await self.gate.wait()

    async def loaded_adapters(self) -> list[str]:
        await self._op("list")
        return list(self.loaded)

    async def load_adapter(self, lora_name: str, lora_path: str) -> None:
        await self._op("load")
        if self.load_gate is not None:
            await self.load_gate.wait()
        self.loaded[lora_name] = lora_path

    async def unload_adapter(self, lora_name: str) -> None:
        await self._op("unload")
        self.loaded.pop(lora_name)

    async def generate(self, payload):
        await self._op("generate")
        return {"text": "", "meta_info": {"finish_reason": {"type": "length"}}}


@pytest.fixture
def fakes():
    return {"e0": FakeOverwriteAdmin("e0"), "e1": FakeOverwriteAdmin("e1")}


def tree(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs}


# -- the overwrite path's stash -----------------------------------------------------------------
@pytest.mark.parametrize("version_id", ["../../x", "../escape", "a/b", "/abs", "v1\n", "", "v 1", "x" * 200])
async def test_a_version_id_never_reaches_a_path_on_the_overwrite_path(fakes, tmp_path, version_id):
    stash = tmp_path / "stash"
    dep = await OverwriteDeployment(fakes, stash_dir=str(stash)).start()
    with pytest.raises(InvalidInput, match="version_id"):
        await dep.publish(lora_snapshot(1), version_id)
    assert tree(tmp_path) == set()  # nothing written, inside the stash or outside it
    assert all(f.calls == [] for f in fakes.values())  # nothing sent: no engine was paused


async def test_a_symlink_planted_in_the_stash_is_refused_not_followed(fakes, tmp_path):
    stash, outside = tmp_path / "stash", tmp_path / "outside"
    outside.mkdir()
    (stash / "legacy").mkdir(parents=True)
    snap = lora_snapshot(1)
    os.symlink(outside, stash / "legacy" / f"000000-A-{snap.digest[:12]}")
    dep = await OverwriteDeployment(fakes, stash_dir=str(stash)).start()
    with pytest.raises(InvalidInput, match="would leave the stash"):
        await dep.publish(snap, "A")
    assert tree(outside) == set() and all(f.calls == [] for f in fakes.values())


async def test_without_a_stash_dir_each_deployment_writes_to_its_own_private_directory(fakes):
    import stat

    first, second, idle = OverwriteDeployment(fakes), OverwriteDeployment(fakes), OverwriteDeployment(fakes)
    await first.publish(lora_snapshot(1), "A")
    await second.publish(lora_snapshot(1), "A")
    own, other = first.publisher.stash_dir, second.publisher.stash_dir
    assert own != other  # not one predictable shared path
    assert stat.S_IMODE(os.stat(own).st_mode) == 0o700 and os.path.basename(own).startswith("lorapub-legacy-")
    loaded = [f.loaded[FIXED_LORA_NAME] for f in fakes.values()]
    assert all(p.startswith(os.path.realpath(other) + os.sep) and os.path.isdir(p) for p in loaded)
    await first.close()
    await second.close()
    assert not os.path.exists(own) and not os.path.exists(other)  # removed on close
    assert idle.publisher.stash_dir is None and idle.publisher.private_stash is None  # never published: none made


async def test_adapter_directories_stay_inside_the_stash(fakes, tmp_path):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    await dep.publish(lora_snapshot(1), "A")
    await dep.publish(lora_snapshot(2), "B")
    paths = [f.loaded[FIXED_LORA_NAME] for f in fakes.values()]
    root = os.path.realpath(tmp_path / "legacy")
    assert all(os.path.dirname(p) == root for p in paths)
    assert os.path.basename(paths[0]).startswith("000001-B-")


# -- the overwrite path never leaves generation paused -------------------------------------------
@pytest.mark.parametrize(
    "engine, op, error, raised",
    [
        ("e1", "load", EngineError("e1 /load_lora_adapter answered 400: bad adapter"), EngineError),
        ("e0", "unload", EngineError("refused"), EngineError),
        ("e1", "flush", OutcomeUnknown("e1 /flush_cache: no answer"), OutcomeUnknown),
        ("e1", "pause", EngineError("e1 /pause_generation answered 401: Unauthorized"), EngineError),
        ("e0", "list", RuntimeError("an embedder's admin broke"), OutcomeUnknown),
        ("e1", "pause", ZeroDivisionError("division by zero"), OutcomeUnknown),
    ],
    ids=["load", "unload", "flush-unknown", "pause-refused", "list-untyped", "pause-untyped"],
)
async def test_a_failure_mid_way_continues_every_engine_and_raises_typed(fakes, tmp_path, engine, op, error, raised):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    await dep.publish(lora_snapshot(1), "A")
    fakes["e0"].loaded[FIXED_LORA_NAME] = fakes["e1"].loaded[FIXED_LORA_NAME] = "old"
    fakes[engine].fail[op] = error
    with pytest.raises(raised) as e:
        await dep.publish(lora_snapshot(2), "B")
    assert type(e.value) is raised and (engine in str(e.value) or e.value is error)
    for f in fakes.values():
        assert not f.paused and f.calls[-1] == "continue", (f.name, f.calls)
    assert dep.publisher.updates == 1  # the failed update does not count


async def test_the_overwrite_loads_on_every_engine_at_once(fakes, tmp_path):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    await dep.publish(lora_snapshot(1), "A")
    fakes["e0"].load_gate = asyncio.Event()  # e0's load does not finish...
    task = asyncio.create_task(dep.publish(lora_snapshot(2), "B"))

    async def e1_loaded() -> None:
        while fakes["e1"].calls.count("load") < 2:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(e1_loaded(), 5)  # ...and e1 unloads and loads all the same (in turn it never would)
    assert fakes["e0"].calls[-1] == "load" and not task.done()
    fakes["e0"].load_gate.set()
    await task
    for f in fakes.values():
        assert f.calls[-6:] == ["pause", "flush", "list", "unload", "load", "continue"] and not f.paused


async def test_a_failed_continue_is_reported_not_swallowed(fakes, tmp_path):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    fakes["e1"].fail["continue"] = EngineError("e1 /continue_generation answered 503: draining")
    with pytest.raises(EngineError, match="may still be paused.*draining"):
        await dep.publish(lora_snapshot(1), "A")
    assert not fakes["e0"].paused  # the other engine was continued all the same


async def test_a_publication_cancelled_twice_still_continues_every_engine(fakes, tmp_path):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    fakes["e0"].gate = fakes["e1"].gate = asyncio.Event()  # flush never finishes
    fakes["e1"].continue_gate = asyncio.Event()  # e1 takes a while to continue
    task = asyncio.create_task(dep.publish(lora_snapshot(1), "A"))
    while not all("flush" in f.calls for f in fakes.values()):
        await asyncio.sleep(0.01)
    task.cancel()  # the caller gives up during the flush...
    while "continue" not in fakes["e1"].calls:
        await asyncio.sleep(0.01)
    task.cancel()  # ...and again while generation is being continued
    with pytest.raises(asyncio.CancelledError):
        await task
    fakes["e1"].continue_gate.set()
    await until(lambda: all(not f.paused and f.calls[-1] == "continue" for f in fakes.values()),
                what="every engine continued")


@pytest.mark.parametrize(
    "engines, stash, named",
    [
        ({}, None, "at least one engine"),
        ([FakeOverwriteAdmin("e0")], None, "mapping"),
        ({"e0": object()}, None, "not an OverwriteAdmin"),
        ({"../e0": FakeOverwriteAdmin("e0")}, None, "engine name"),
        ({"e0": FakeOverwriteAdmin("e0")}, 7, "stash_dir"),
        ({"e0": FakeOverwriteAdmin("e0")}, "", "stash_dir"),
    ],
    ids=["empty", "list", "not-an-admin", "bad-name", "stash-int", "stash-empty"],
)
def test_overwrite_deployment_refuses_bad_arguments(engines, stash, named):
    with pytest.raises(InvalidInput, match=named):
        OverwriteDeployment(engines, stash_dir=stash)


async def test_publish_takes_a_snapshot(fakes, tmp_path):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    with pytest.raises(InvalidInput, match="Snapshot"):
        await dep.publish({"w": [1.0]}, "A")


# -- engine-side staging ------------------------------------------------------------------------
@pytest.mark.parametrize("seq", ["../../x", -1, None, 1.5, True])
def test_attempt_tokens_refuse_a_sequence_that_is_not_a_count(seq):
    with pytest.raises(InvalidInput, match="seq"):
        AttemptToken(VersionKey(1, "A"), seq)
    with pytest.raises(InvalidInput, match="VersionKey"):
        AttemptToken("1-A", 1)


def begin_request(token: AttemptToken, seed: int = 1) -> tuple[SendBegin, object]:
    snap = lora_snapshot(seed, layers=1, hidden=8, rank=2)
    plan = snap.plan(256)
    return SendBegin("e0", "life0", token, lora_name_for(token.version, snap.digest), snap.digest, plan), snap


class NoLoads:
    """An engine for the engine-side staging that is never asked to load here."""

    def adapters(self):
        return {}

    def max_loaded_loras(self):
        return 3


def engine_staging(root):
    from lorapub.sglang_patch import staging as es

    return es.EngineStaging(NoLoads(), incarnation="life0", stash_root=str(root))


def begin_body(request: SendBegin, token_json: dict | None = None) -> dict:
    from lorapub.wire.codec import plan_to_json, token_to_json

    return {"token": token_json or token_to_json(request.token), "incarnation": "life0",
            "lora_name": request.lora_name, "digest": request.digest, "plan": plan_to_json(request.plan),
            "transport": {"kind": "http"}, "load": "dir"}


def everything_under(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, dirs, files in os.walk(path) for f in files + dirs}


async def test_a_token_that_skipped_its_checks_cannot_leave_the_stash(tmp_path):
    """The engine adapter's staging lives in the engine: every token arrives as JSON and is checked there."""
    from lorapub.wire.codec import token_params

    staging = engine_staging(tmp_path / "engine" / "stash")
    token = AttemptToken(VersionKey(1, "A"), 1)
    request, _ = begin_request(token)
    before = everything_under(tmp_path)
    for forged in ({"epoch": 1, "version_id": "../../../outside", "seq": 1}, {"epoch": 1, "version_id": "A", "seq": -1},
                   {"epoch": "1/..", "version_id": "A", "seq": 1}):
        status, answer = await staging.begin(begin_body(request, forged))
        assert status == 400 and "not an attempt token" in answer["error"]["message"], answer
        params = {**{k: str(v) for k, v in forged.items()}, "index": "0", "incarnation": "life0", "format": "raw"}
        assert (await staging.receive(params, None, 0))[0] == 400
        assert (await staging.cleanup({"token": forged}))[0] == 400
    assert everything_under(tmp_path) == before  # nothing made anywhere, inside the stash or out of it
    assert (await staging.begin(begin_body(request)))[0] == 200
    assert os.path.commonpath([staging.folder_of(token), staging.stash_root]) == staging.stash_root
    assert os.path.basename(staging.folder_of(token)) == "1-A-a1"
    assert token_params(token) == {"epoch": "1", "version_id": "A", "seq": "1"}


@pytest.mark.parametrize("index", ["-1", "99", "None", "True", "../x", "1.0", ""])
async def test_a_bucket_index_outside_the_plan_is_refused(tmp_path, index):
    from lorapub.wire.codec import token_params

    staging = engine_staging(tmp_path / "stash")
    token = AttemptToken(VersionKey(1, "A"), 1)
    request, snap = begin_request(token)
    assert (await staging.begin(begin_body(request)))[0] == 200
    folder = everything_under(staging.folder_of(token))
    blob = snap.bucket_bytes(request.plan, 0)

    async def body():
        yield blob

    params = {**token_params(token), "index": index, "incarnation": "life0", "format": "safetensors"}
    status, answer = await staging.receive(params, body(), len(blob))
    assert status == 400 and "bucket index" in answer["error"]["message"], answer
    assert staging.report()["attempts"][str(token)]["buckets"] == []
    assert everything_under(staging.folder_of(token)) == folder


async def test_staged_bytes_that_do_not_verify_are_a_definite_engine_error(tmp_path):
    from lorapub.adapters.sglang_wire import SGLangWireEngine
    from lorapub.testing import SGLangDouble

    double = SGLangDouble("e0")
    double.stash_root = str(tmp_path / "disk")
    await double.start()
    engine = SGLangWireEngine("e0", double.url)
    try:
        life = await engine.incarnation()
        token = AttemptToken(VersionKey(1, "A"), 1)
        request, snap = begin_request(token)
        request = attrs.evolve(request, incarnation=life)
        assert await engine.begin(request) == life
        with pytest.raises(InvalidInput, match="a bucket payload is bytes"):  # refused before anything is sent
            await engine.receive_bucket(token, 0, "not bytes")
        with pytest.raises(EngineError, match="safetensors"):
            await engine.receive_bucket(token, 0, b"\x00garbage that is not safetensors")
        with pytest.raises(EngineError, match="never arrived"):
            await engine.end(token)
        assert double.registered() == []
        # a plan whose serving config is not the one the digest names: refused at begin, before any byte
        token2 = AttemptToken(VersionKey(1, "B"), 1)
        request2, _ = begin_request(token2, seed=2)
        request2 = attrs.evolve(request2, incarnation=life,
                                plan=attrs.evolve(request2.plan, serving_config_json='{"r": NaN'))
        with pytest.raises(EngineError, match="describes no valid manifest"):
            await engine.begin(request2)
        assert double.registered() == [] and str(token2) not in double.staging.report()["attempts"]
    finally:
        await engine.close()
        await double.stop()


async def test_misuse_of_the_overwrite_session_and_snapshot_dirs_is_invalid_input(fakes, tmp_path):
    dep = await OverwriteDeployment(fakes, stash_dir=str(tmp_path)).start()
    for bad in (None, "prompt", [1, 2]):
        with pytest.raises(InvalidInput, match="payload"):
            await dep.session("s").generate(bad)
    assert all("generate" not in f.calls for f in fakes.values())
    for bad in (None, "", 7, "a\x00b"):
        with pytest.raises(InvalidInput, match="save_peft_dir"):
            lora_snapshot(1).save_peft_dir(bad)


async def test_an_unwritable_stash_is_invalid_input_before_any_engine_is_paused(fakes, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the stash folder should be")
    dep = await OverwriteDeployment(fakes, stash_dir=str(blocker)).start()
    with pytest.raises(InvalidInput, match="cannot be written under stash_dir"):
        await dep.publish(lora_snapshot(1), "A")
    assert all(f.calls == [] for f in fakes.values())
