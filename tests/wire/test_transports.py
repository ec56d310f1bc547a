"""Publication through a Deployment over each wire transport, engines staging inside themselves.

Two contract doubles run lorapub's engine-side staging (the code the SGLang patch runs); the
publisher sends each bucket its transport's way. What each test proves is in its name.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from lorapub.adapters.sglang_wire import (
    DEFAULT_TRANSPORT,
    HTTPBytes,
    SameHostIPC,
    SGLangWireEngine,
    SharedDir,
    TorchDistributed,
)
from lorapub.core.version import VersionState
from lorapub.errors import InvalidInput
from lorapub.ports import BucketSource, TakesTransport, Transport
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.publisher import PublicationFailed
from lorapub.snapshot import InlineBucketSource
from lorapub.testing import MemoryEngine, SGLangDouble
from lorapub.testing.fixtures import lora_snapshot
from tests.e2e.conftest import FAST

GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}}
KINDS = ["http", "http-loop", "http-tensors", "shm", "shared-dir", "gloo"]


def make_transport(kind: str, shm_dir: str):
    return {
        "http": lambda: HTTPBytes(),
        "http-loop": lambda: HTTPBytes(sender="loop"),
        "http-tensors": lambda: HTTPBytes(load="tensors"),
        "shm": lambda: SameHostIPC(shm_dir=shm_dir),
        "shared-dir": lambda: SharedDir(shm_dir),
        "gloo": lambda: TorchDistributed(timeout=10.0),
    }[kind]()


class Recorder:
    """What reached each engine's staging (format of every bucket)."""

    def __init__(self, double: SGLangDouble) -> None:
        self.formats: list[str] = []
        real = double.staging.receive

        async def receive(params, chunks, length=None):
            self.formats.append(params.get("format"))
            return await real(params, chunks, length)

        double.staging.receive = receive


@pytest.fixture
async def wired(tmp_path, request):
    kind = request.param
    shm = tmp_path / "shm"
    shm.mkdir()
    doubles = []
    for name in ("e0", "e1"):
        d = SGLangDouble(name)
        d.stash_root, d.shm_dir = str(tmp_path / f"{name}-disk"), str(shm)
        doubles.append(await d.start())
    transport = make_transport(kind, str(shm))
    engines = {d.name: SGLangWireEngine(d.name, d.url, probe_timeout=10) for d in doubles}
    recorders = {d.name: Recorder(d) for d in doubles}
    dep = await Deployment(engines, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10, transport=transport).start()
    yield kind, dep, {d.name: d for d in doubles}, recorders, shm
    await dep.settle()
    await dep.close()
    for e in engines.values():
        await e.close()
    for d in doubles:
        await d.stop()


EXPECTED_FORMAT = {"http": "raw", "http-loop": "raw", "http-tensors": "raw", "shm": "shm", "shared-dir": "shm",
                   "gloo": "torch"}


async def no_files(folder, timeout: float = 5.0) -> bool:
    """Shared-memory bucket files are removed off the event loop: wait for it (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while list(folder.iterdir()):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def staged(double: SGLangDouble) -> dict:
    return double.staging.report()


@pytest.mark.parametrize("wired", KINDS, indirect=True)
async def test_publish_serve_and_reclaim_free_every_stash(wired):
    kind, dep, doubles, recorders, shm = wired
    assert dep.publisher.source_factory == dep.transport.source  # the publisher's half is the transport's
    assert all(e.transport is dep.transport for e in dep.engines.values())
    a = await dep.publish(lora_snapshot(1), "A")
    plan = lora_snapshot(1).plan(8 << 10)
    for name, d in doubles.items():
        assert recorders[name].formats == [EXPECTED_FORMAT[kind]] * len(plan.buckets)  # each bucket once, its way
        assert a.lora_name in d.registered() and d.lora_registry.get_all_adapters()[a.lora_name].pinned
        assert staged(d)["bytes"] == 0  # after the load the engine keeps no staged bytes
    if kind == "gloo":
        assert all(staged(d)["collectives"] == len(plan.buckets) for d in doubles.values())
    session = dep.session("s1")
    first = await session.generate(GEN)
    b = await dep.publish(lora_snapshot(2), "B")
    again = await session.generate(GEN)
    assert again["output_ids"] == first["output_ids"]  # the session stays on A's exact content
    await session.close()
    await dep.settle()
    assert (await dep.state()).versions[a.version].state is VersionState.RECLAIMED
    for d in doubles.values():
        assert a.lora_name not in d.registered()
        assert all(x["lora_name"] != a.lora_name for x in staged(d)["attempts"].values())  # A's stash freed
        assert not os.path.exists(os.path.join(d.staging.stash_root, "1-A-a1"))
    assert await no_files(shm)  # every shared-memory bucket file was removed
    assert b.receipt is not None


@pytest.mark.parametrize("wired", KINDS, indirect=True)
async def test_a_bucket_refused_by_one_engine_fails_clean_and_frees_every_stash(wired):
    kind, dep, doubles, recorders, shm = wired
    doubles["e1"].inject("bucket", "error", status=500)
    with pytest.raises(PublicationFailed):
        await dep.publish(lora_snapshot(3), "C")
    state = await dep.state()
    key = next(k for k in state.versions if k.version_id == "C")
    assert state.versions[key].state is VersionState.FAILED_CLEAN
    for d in doubles.values():
        report = staged(d)
        assert report["attempts"] == {} and report["bytes"] == 0 and report["tombstones"] == 1
        assert not any(n.startswith("relax_policy_lora@1-C") for n in d.registered())
    assert await no_files(shm)
    # the same id and snapshot publish afresh (a new attempt; the old one stays refused)
    report = await dep.publish(lora_snapshot(3), "C")
    assert report.receipt is not None


@pytest.mark.parametrize("wired", ["http"], indirect=True)
async def test_bytes_that_do_not_match_the_manifest_are_refused_before_any_load(wired):
    _, dep, doubles, _, _ = wired

    class Corrupt(BucketSource):

        def __init__(self, snapshot, plan):
            self.inner = InlineBucketSource(snapshot, plan)

        async def send(self, token, index, engines):
            await self.inner.send(token, index, engines)

        def payload(self, token, index):
            blob = bytearray(self.inner.payload(token, index))
            blob[-1] ^= 0xFF  # one flipped bit in the last tensor
            return bytes(blob)

    dep.publisher.source_factory = Corrupt
    with pytest.raises(PublicationFailed, match="SHA-256"):
        await dep.publish(lora_snapshot(4), "D")
    for d in doubles.values():
        assert [e for e in d.events if e[0] == "load"] == []
        assert staged(d)["attempts"] == {}


def wire(*names: str) -> dict[str, SGLangWireEngine]:
    return {n: SGLangWireEngine(n, f"http://127.0.0.1:{i + 1}") for i, n in enumerate(names)}


async def test_the_deployment_names_the_transport_once_and_hands_it_to_every_engine(tmp_path):
    t = SameHostIPC(shm_dir=str(tmp_path))
    engines = wire("e0", "e1")
    assert all(e.transport is DEFAULT_TRANSPORT for e in engines.values())  # none given yet: HTTP bodies
    dep = Deployment(engines, epoch=1, transport=t)
    assert dep.transport is t and all(e.transport is t for e in engines.values())
    assert all(isinstance(e, TakesTransport) for e in engines.values()) and isinstance(t, Transport)
    # without one, the engines' own: HTTP bodies by default
    plain = Deployment(wire("e0", "e1"), epoch=1)
    assert plain.transport == HTTPBytes() and all(e.transport == HTTPBytes() for e in plain.engines.values())
    # engines that take no transport are sent safetensors bytes, as before
    assert Deployment({"m0": MemoryEngine("m0")}, epoch=1).transport is None


async def test_an_engine_given_another_transport_is_invalid_input_naming_it(tmp_path):
    t = HTTPBytes()
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    others = (HTTPBytes(load="tensors"), HTTPBytes(sender="loop"), SameHostIPC(shm_dir=str(tmp_path)),
              SharedDir(tmp_path), TorchDistributed())
    for other in others:
        engines = wire("e0", "e1")
        engines["e1"].use_transport(other)  # given by an earlier deployment
        with pytest.raises(InvalidInput, match="engine e1 already sends buckets") as e:
            Deployment(engines, epoch=1, transport=t)
        assert repr(other) in e.value.message
        with pytest.raises(InvalidInput, match="engines e0 and e1 send buckets different ways"):
            Deployment(engines, epoch=1)  # named nowhere: the engines disagree
        # refused: no engine of the failed deployment was handed its transport
        assert engines["e0"].can_use_transport(other) and engines["e0"].can_use_transport(t)
        Deployment(engines | {"e1": wire("e1")["e1"]}, epoch=1, transport=other)  # e0 still free to take another
    # a deployment refused for another reason (here its status address) hands no engine its transport
    engines = wire("e0", "e1")
    with pytest.raises(InvalidInput, match="status must be"):
        Deployment(engines, epoch=1, transport=SharedDir(other_dir), status=("127.0.0.1", -1))
    assert all(e.can_use_transport(t) and e.transport == HTTPBytes() for e in engines.values())
    # equal transports are one way of sending: HTTPBytes() made twice, one folder spelled two ways
    engines = wire("e0", "e1")
    engines["e1"].use_transport(HTTPBytes())
    assert Deployment(engines, epoch=1, transport=HTTPBytes()).transport == HTTPBytes()
    assert SameHostIPC(shm_dir=str(tmp_path)) == SameHostIPC(shm_dir=str(tmp_path) + "/")
    assert SharedDir(tmp_path) == SharedDir(str(tmp_path) + "/") != SameHostIPC(shm_dir=str(tmp_path), load="dir")
    engines = wire("e0", "e1")
    engines["e0"].use_transport(SharedDir(tmp_path))
    assert Deployment(engines, epoch=1, transport=SharedDir(str(tmp_path) + "/")).engines["e0"].transport.path \
        == str(tmp_path)
    # a transport that keeps per-attempt state (torch.distributed's groups) is one way only as one object
    shared, another = TorchDistributed(), TorchDistributed()
    assert shared != another and shared == shared
    engines = wire("e0", "e1")
    assert all(e.transport is shared for e in Deployment(engines, epoch=1, transport=shared).engines.values())
    with pytest.raises(InvalidInput, match="engine e0 already sends buckets"):
        Deployment(engines, epoch=1, transport=another)

    class Stateful(HTTPBytes):  # an embedder's transport that keeps state of its own equals only itself
        __eq__ = object.__eq__
        __hash__ = object.__hash__

    a, b = Stateful(), Stateful()
    engines = wire("e0", "e1")
    engines["e0"].use_transport(a)
    engines["e1"].use_transport(b)
    with pytest.raises(InvalidInput, match="send buckets different ways"):
        Deployment(engines, epoch=1)


def test_a_deployment_refuses_a_transport_its_engines_cannot_take():
    with pytest.raises(InvalidInput, match="transport must be a lorapub.ports.Transport"):
        Deployment(wire("e0"), epoch=1, transport="http")
    with pytest.raises(InvalidInput, match="no engine takes a transport"):
        Deployment({"m0": MemoryEngine("m0")}, epoch=1, transport=HTTPBytes())
    with pytest.raises(InvalidInput, match="e0 take a transport, m1 do not"):
        Deployment({**wire("e0"), "m1": MemoryEngine("m1")}, epoch=1)
    with pytest.raises(InvalidInput, match="e0: a transport is a lorapub.ports.Transport"):
        wire("e0")["e0"].use_transport(object())
    with pytest.raises(TypeError):  # the engine is not where the transport is named
        SGLangWireEngine("e0", "http://127.0.0.1:1", transport=HTTPBytes())


async def test_a_duplicate_torch_receive_starts_no_second_collective(tmp_path):
    from lorapub.core.effects import SendBegin
    from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for

    d = SGLangDouble("e0")
    d.stash_root = str(tmp_path / "disk")
    await d.start()
    transport = TorchDistributed(timeout=10.0)
    engine = SGLangWireEngine("e0", d.url, probe_timeout=10)
    engine.use_transport(transport)
    try:
        snapshot = lora_snapshot(8, layers=1, hidden=16, rank=2)
        plan = snapshot.plan(256)
        source = transport.source(snapshot, plan)
        key = VersionKey(1, "T")
        token = AttemptToken(key, 1)
        inc = await engine.incarnation()
        await engine.begin(SendBegin("e0", inc, token, lora_name_for(key, snapshot.digest), snapshot.digest, plan))
        # the source's half and two receives of the same bucket at once (a duplicate in flight)
        results = await asyncio.gather(source.send(token, 0, ("e0",)), engine.receive_bucket(token, 0, b""),
                                       engine.receive_bucket(token, 0, b""))
        assert results[1:] == [inc, inc]
        assert await engine.receive_bucket(token, 0, b"") == inc  # and once more after it finished
        await source.send(token, 0, ("e0",))  # a duplicate send joins nothing either
        assert d.staging.collectives == 1 and source.broadcasts == 1
        assert d.staging.report()["attempts"][str(token)]["buckets"] == [0]
    finally:
        await engine.close()
        await d.stop()


async def test_a_cleanup_that_comes_during_the_engines_load_leaves_no_adapter_behind(tmp_path):
    """The engine tombstones the attempt at once and waits for its load; a load that ends after that
    is refused as cleaned up (the staging then answers ``loaded: null``), yet it did register the
    adapter: the cleanup unloads it, so the failed version holds no slot."""
    from lorapub.core.effects import SendBegin
    from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for
    from lorapub.demo.workload import until
    from lorapub.errors import EngineError

    d = SGLangDouble("e0", load_delay=0.5)
    d.stash_root = str(tmp_path / "disk")
    await d.start()
    engine = SGLangWireEngine("e0", d.url, probe_timeout=10)
    try:
        snapshot = lora_snapshot(8)
        plan = snapshot.plan(4 << 10)
        key = VersionKey(1, "L")
        token, name = AttemptToken(key, 1), lora_name_for(key, snapshot.digest)
        source = engine.transport.source(snapshot, plan)
        inc = await engine.begin(SendBegin("e0", await engine.incarnation(), token, name, snapshot.digest, plan))
        for b in plan.buckets:
            assert await engine.receive_bucket(token, b.index, source.payload(token, b.index)) == inc
        ending = asyncio.create_task(engine.end(token))
        await until(lambda: d.staging.report()["attempts"].get(str(token), {}).get("driving"), timeout=5)  # end loads for 0.5 s
        await asyncio.sleep(0.1)
        assert await engine.cleanup(token, name) == inc  # while the load runs
        with pytest.raises(EngineError, match="cleaned up"):
            await ending
        assert name not in d.registered() and d.physical_unloads.count(name) == 1
        assert d.staging.report()["attempts"] == {}
    finally:
        await engine.close()
        await d.stop()


async def test_a_cleanup_of_another_attempt_never_unloads_the_version_an_attempt_holds(tmp_path):
    """Another attempt of the same version (a re-provisioning, a replayed one) may hold the name: the
    cleanup of one that loaded nothing leaves it loaded."""
    from lorapub.core.effects import SendBegin
    from lorapub.core.identity import AttemptToken, VersionKey, lora_name_for

    d = SGLangDouble("e0")
    d.stash_root = str(tmp_path / "disk")
    await d.start()
    engine = SGLangWireEngine("e0", d.url, probe_timeout=10)
    try:
        snapshot = lora_snapshot(9)
        plan = snapshot.plan(4 << 10)
        key = VersionKey(1, "R")
        holder, other, name = AttemptToken(key, 2), AttemptToken(key, 1), lora_name_for(key, snapshot.digest)
        source = engine.transport.source(snapshot, plan)
        inc = await engine.begin(SendBegin("e0", await engine.incarnation(), holder, name, snapshot.digest, plan))
        for b in plan.buckets:
            await engine.receive_bucket(holder, b.index, source.payload(holder, b.index))
        await engine.end(holder)
        assert await engine.cleanup(other, name) == inc
        assert name in d.registered() and d.physical_unloads == []
    finally:
        await engine.close()
        await d.stop()


def test_a_bucket_whose_flattening_ahead_failed_is_refused_naming_why_never_sent_half_written(monkeypatch):
    """The next bucket is flattened on a thread while this one is broadcast: if that thread fails, the next
    broadcast raises a typed error naming the cause, instead of sending the half-written buffer."""
    from lorapub.adapters.transports import torch_dist
    from lorapub.core.identity import AttemptToken, VersionKey
    from lorapub.errors import EngineError

    snapshot = lora_snapshot(8, layers=1, hidden=16, rank=2)
    plan = snapshot.plan(256)
    assert len(plan.buckets) >= 2
    source = TorchDistributed(timeout=10.0).source(snapshot, plan)
    second = {e.name for e in plan.buckets[1].entries}

    class Broken:  # the snapshot, but reading a tensor of bucket 1 fails
        def tensor(self, name):
            if name in second:
                raise OSError("the snapshot's memory went away")
            return snapshot.tensor(name)

    class Group:
        sent = []

        def broadcast(self, tensors, opts):
            Group.sent.append(bytes(tensors[0].numpy()))
            return self

        def wait(self):
            return True

    token = AttemptToken(VersionKey(1, "T"), 1)
    source.snapshot = Broken()
    source._groups[token] = Group()
    monkeypatch.setattr(torch_dist, "barrier", lambda *a, **k: None)
    source._broadcast(token, 0, 2)  # bucket 0 goes; bucket 1 is flattened meanwhile, and that fails
    with pytest.raises(EngineError, match="bucket 1 .*could not be flattened: OSError: the snapshot's memory went away"):
        source._broadcast(token, 1, 2)
    assert len(Group.sent) == 1  # nothing of bucket 1 was sent
