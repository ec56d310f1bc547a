import pytest

from lorapub.adapters.sglang_http import SGLangEngine
from lorapub.runtime.deployment import Deployment
from lorapub.runtime.runner import Deadlines
from lorapub.testing import SGLangDouble


@pytest.fixture
async def doubles():
    pair = [await SGLangDouble("e0").start(), await SGLangDouble("e1").start()]
    yield {d.name: d for d in pair}
    for d in pair:
        await d.stop()


@pytest.fixture
async def engines(doubles, tmp_path):
    adapters = {name: SGLangEngine(name, d.url, str(tmp_path / "stash")) for name, d in doubles.items()}
    yield adapters
    for a in adapters.values():
        await a.close()


FAST = Deadlines(begin=2, bucket=2, end=2, cleanup=2, commit=1, reclaim=5)


@pytest.fixture
async def deployment(engines, tmp_path):
    d = await Deployment(engines, epoch=1, deadlines=FAST, bucket_cap_bytes=8 << 10, stash_dir=str(tmp_path)).start()
    yield d
    await d.close()  # waits for reclaims and stops the background tasks
