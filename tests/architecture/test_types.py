"""The typed public face: the pure core, the staging protocol and the ports pass ``mypy --strict``.

The configuration is pyproject.toml's ``[tool.mypy]`` (strict for these paths; what they import is
read for its types, not checked). .ci/install installs the pinned mypy, so CI always runs this.
"""

from __future__ import annotations

import pathlib

import pytest

import lorapub

SRC = pathlib.Path(lorapub.__file__).parent
ROOT = SRC.parent.parent
STRICT = [SRC / "core", SRC / "wire", SRC / "ports.py"]


def test_core_wire_and_ports_pass_mypy_strict(tmp_path):
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (.ci/install installs it)")
    config = ROOT / "pyproject.toml"
    assert "[tool.mypy]" in config.read_text(), f"{config} has no [tool.mypy] section"
    stdout, stderr, status = api.run([
        "--config-file", str(config), "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary",
        "--hide-error-context", *map(str, STRICT),
    ])
    assert (status, stdout, stderr) == (0, "", ""), f"mypy --strict on {[p.name for p in STRICT]}:\n{stdout}{stderr}"
