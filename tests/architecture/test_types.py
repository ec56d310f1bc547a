"""The typed public face: the core, the staging protocol, the ports, the errors and the events pass ``mypy --strict``.

The configuration is pyproject.toml's ``[tool.mypy]`` (strict for these paths; what they import is
read for its types, not checked). .ci/install installs the pinned mypy, so CI always runs this.
"""

from __future__ import annotations

import pathlib

import pytest

import lorapub

SRC = pathlib.Path(lorapub.__file__).parent
ROOT = SRC.parent.parent
STRICT = [SRC / "core", SRC / "wire", SRC / "ports.py", SRC / "errors.py", SRC / "events.py"]


def test_core_wire_ports_and_errors_pass_mypy_strict():
    api = pytest.importorskip("mypy.api", reason="mypy is not installed (.ci/install installs it)")
    config = ROOT / "pyproject.toml"
    assert "[tool.mypy]" in config.read_text(), f"{config} has no [tool.mypy] section"
    # the checkout's incremental cache (.mypy_cache, ignored by git): a second run takes under a second
    stdout, stderr, status = api.run([
        "--config-file", str(config), "--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary",
        "--hide-error-context", *map(str, STRICT),
    ])
    assert (status, stdout, stderr) == (0, "", ""), f"mypy --strict on {[p.name for p in STRICT]}:\n{stdout}{stderr}"


def test_deploy_types_every_option_of_deployment():
    """``deploy(**options)`` is typed by DeploymentOptions: one entry per keyword option of
    Deployment (besides epoch and stash_dir, deploy's own), of the same type."""
    import inspect

    from lorapub.runtime.deployment import Deployment, DeploymentOptions

    options = {name: p.annotation for name, p in inspect.signature(Deployment.__init__).parameters.items()
               if p.kind is p.KEYWORD_ONLY and name not in {"epoch", "stash_dir"}}
    typed = {name: getattr(t, "__forward_arg__", t) for name, t in DeploymentOptions.__annotations__.items()}
    assert typed == options
