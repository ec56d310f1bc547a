"""docs/operating.md, "A durable registry in one process": the documented snippet runs as written,
resumes what it published, and a refused LocalRegistry leaves no store file behind."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from lorapub import InvalidInput
from lorapub.core.version import VersionState
from lorapub.testing import MemoryEngine, lora_snapshot

DOC = pathlib.Path(__file__).parents[2] / "docs" / "operating.md"


def documented_snippet() -> dict:
    section = DOC.read_text().split("## A durable registry in one process", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the documented example, as a user copies it
    return namespace


async def test_the_documented_durable_registry_resumes_what_it_published(tmp_path):
    doc = documented_snippet()
    path = str(tmp_path / "registry.db")
    engines = {n: MemoryEngine(n) for n in ("e0", "e1")}
    dep, registry = await doc["open_deployment"](engines, 7, path)
    await dep.publish(lora_snapshot(1), "step1")
    await dep.publish(lora_snapshot(2), "step2")
    await doc["close_deployment"](dep, registry)

    dep, registry = await doc["open_deployment"](engines, 7, path)  # the publisher's restart
    try:
        state = await dep.state()
        published = {k.version_id: v.state for k, v in state.versions.items()}
        assert published["step2"] is VersionState.PUBLISHED
        out = await dep.session("s").generate({"input_ids": [1, 2]})
        assert out["lorapub"]["version_id"] == "step2"
    finally:
        await doc["close_deployment"](dep, registry)


async def test_a_refused_local_registry_leaves_no_store_behind(tmp_path):
    from lorapub.local_registry import LocalRegistry
    from lorapub.adapters.stores import SQLiteStore

    path = str(tmp_path / "registry.db")
    with pytest.raises(InvalidInput, match="capacity"):
        LocalRegistry(1, {"e0": "e0-life0"}, 1, store=SQLiteStore(path))
    assert os.listdir(tmp_path) == []  # no empty store for `status --store` to report
    LocalRegistry(1, {"e0": "e0-life0"}, 2, store=SQLiteStore(path)).close()  # the same path works after
    assert os.path.exists(path)


def test_the_design_doc_names_the_store_the_code_uses():
    root = DOC.parents[1]
    code = (root / "src" / "lorapub" / "adapters" / "ray_registry.py").read_text()
    assert "functools.partial(SQLiteStore, store_path)" in code
    design = (root / "docs" / "design.md").read_text()
    for paragraph in design.split("\n*"):
        if "store_path" in paragraph:  # every place that says what store_path gives
            assert "SQLiteStore" in paragraph, paragraph
    assert "`FileStore` (write, fsync, rename before the reply leaves) for a registry" not in design
