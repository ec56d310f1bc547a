"""``python -m lorapub demo`` runs from the package alone: no source tree on the path."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import lorapub


@pytest.mark.parametrize("transport", ["http", "shared-dir"])
def test_demo_runs_outside_the_source_tree(tmp_path, transport):
    package_root = str(pathlib.Path(lorapub.__file__).parent.parent)  # src/ here, site-packages when installed
    env = {**os.environ, "PYTHONPATH": package_root}
    out = subprocess.run(
        [sys.executable, "-m", "lorapub", "demo", "--sessions", "8", "--stash-dir", str(tmp_path / "stash"),
         "--transport", transport],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")
    assert "CAPACITY_ERROR" in out.stdout and "NO_PUBLISHED_VERSION" in out.stdout
    says = {"http": "buckets travel HTTPBytes(", "shared-dir": f"buckets travel SharedDir('{tmp_path / 'stash' / 'shared'}'"}
    assert says[transport] in out.stdout
    if transport == "shared-dir":  # every bucket file was removed once both engines read it
        assert list((tmp_path / "stash" / "shared").iterdir()) == []
