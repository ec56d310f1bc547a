"""Acceptance on live SGLang (see ``tests/gpu/live.py``): one test per criterion.

Runs where a CUDA device, SGLang 0.5.17 and locally built fixtures are present
(``tests/gpu/run_on_device.sh`` sets that up); skips cleanly everywhere else.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: live-SGLang acceptance runs on a GPU machine", allow_module_level=True)
pytest.importorskip("sglang")
FIXTURES = os.environ.get("LORAPUB_GPU_FIXTURES")
if not FIXTURES:
    pytest.skip("LORAPUB_GPU_FIXTURES is not set (tests/gpu/run_on_device.sh builds them)", allow_module_level=True)

from tests.gpu import live  # noqa: E402
from tests.gpu.fixtures import fixture_paths  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report():
    out = os.environ.get("LORAPUB_GPU_REPORT") or os.path.join(tempfile.mkdtemp(), "report.json")
    paths = fixture_paths(FIXTURES)
    run = live.Run(tempfile.mkdtemp(prefix="lorapub-live-"), os.path.dirname(os.path.abspath(out)), paths, out)
    r = asyncio.run(run.main())
    r["env"] = live.env_report()
    r["verdicts"] = live.verdicts(r)
    with open(out, "w") as f:
        json.dump(r, f, indent=1, default=str)
    return r


CRITERIA = list(live.verdicts({}))


@pytest.mark.parametrize("criterion", CRITERIA)
def test_criterion(report, criterion):
    assert report["verdicts"][criterion], json.dumps(
        {k: v for k, v in report.items() if k in ("errors", "sections")}, default=str)[:6000]
