"""GPU acceptance, one test per criterion; skipped cleanly without a CUDA device."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU acceptance runs on the accelerator machine", allow_module_level=True)

from tests.gpu import acceptance  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    r = asyncio.run(acceptance.run("cuda", str(tmp_path_factory.mktemp("gpu"))))
    r["verdicts"] = acceptance.verdicts(r)
    out = os.environ.get("LORAPUB_GPU_REPORT")
    if out:
        with open(out, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return r


def test_every_acceptance_criterion_holds(report):
    failed = [name for name, ok in report["verdicts"].items() if not ok]
    assert not failed, failed
    assert len(report["verdicts"]) == 13


def test_scenario_covers_both_engines_and_every_turn_kind(report):
    engines = {c["engine"] for c in report["scenario"]}
    turns = {c["turn"].split(" (")[0].rstrip(" 12") for c in report["scenario"]}
    assert engines == {"e0", "e1"}
    assert {"first", "tool turn", "resume"} <= turns
    assert any(c["cached_tokens"] > 0 for c in report["scenario"])  # KV cache stayed on
