import pytest

from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine, SharedDir
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.runner import Deadlines
from lorapub.testing import SGLangDouble

#: The transports every end-to-end test runs over on a CPU machine: HTTP bodies, and bucket files in
#: a folder both sides read (SameHostIPC's mechanism over a temporary folder).
TRANSPORTS = ["http", "shared-dir"]


def make_transport(kind: str, shared: str):
    return {"http": lambda: HTTPBytes(), "shared-dir": lambda: SharedDir(shared)}[kind]()


@pytest.fixture
def shared_dir(tmp_path):
    """The folder the doubles read bucket files from (their LORAPUB_SHM_DIR)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    return folder


@pytest.fixture
async def doubles(tmp_path, shared_dir):
    pair = []
    for name in ("e0", "e1"):
        d = SGLangDouble(name, max_loaded_loras=3)  # small enough that LRU eviction shows (test_rows)
        d.stash_root, d.shm_dir = str(tmp_path / f"{name}-disk"), str(shared_dir)  # its own disk; its shm folder
        pair.append(await d.start())
    yield {d.name: d for d in pair}
    for d in pair:
        await d.stop()


@pytest.fixture(params=TRANSPORTS)
def transport(request, shared_dir):
    return make_transport(request.param, str(shared_dir))


@pytest.fixture
async def engines(doubles):
    adapters = {name: SGLangWireEngine(name, d.url) for name, d in doubles.items()}
    yield adapters
    for a in adapters.values():
        await a.close()


FAST = Deadlines(begin=2, bucket=2, end=2, cleanup=2, commit=1, reclaim=5)


@pytest.fixture
async def deployment(engines, transport):
    d = await Deployment(engines, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10, transport=transport).start()
    yield d
    await d.close()  # waits for reclaims and stops the background tasks


def staged_attempts(double) -> dict:
    """What the double's engine-side staging holds: attempt -> its report."""
    return double.staging.report()["attempts"]


def stash_folders(double) -> list[str]:
    """The attempt folders on the double's own disk (this life's)."""
    import os

    root = double.staging.stash_root
    return sorted(os.listdir(root)) if os.path.isdir(root) else []
