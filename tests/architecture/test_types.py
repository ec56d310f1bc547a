"""The typed public face and the runtime behind it: the core, the staging protocol, the ports, the errors,
the events, the runtime, the snapshot, the probe, the clocks, health, the in-process registry and the adapters
pass ``mypy --strict``, and so do the Relax and AReaL integrations, the test kit (``lorapub.testing``, but for
its verbatim copy of SGLang's files, which pyproject's ``exclude`` keeps out of the directories mypy walks), the
SGLang patch (``lorapub.sglang_patch``; SGLang's own objects it patches are ``Any`` there), the commands
(``lorapub.demo``, ``lorapub.cli``) and the package's ``__init__`` and ``__main__``: all of ``src/lorapub``.

The configuration is pyproject.toml's ``[tool.mypy]`` (strict for these paths; what they import is
read for its types, not checked). .ci/install installs the pinned mypy, so CI always runs this.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import lorapub

SRC = pathlib.Path(lorapub.__file__).parent
ROOT = SRC.parent.parent
STRICT = [SRC / "core", SRC / "wire", SRC / "ports.py", SRC / "errors.py", SRC / "events.py",
          SRC / "runtime", SRC / "snapshot.py", SRC / "probe.py", SRC / "clock.py", SRC / "health.py",
          SRC / "local_registry.py", SRC / "_moved.py", SRC / "adapters",
          SRC / "integrations", SRC / "testing", SRC / "sglang_patch",
          SRC / "demo", SRC / "cli", SRC / "__init__.py", SRC / "__main__.py"]


def test_strict_set_passes_mypy_strict():
    pytest.importorskip("mypy.api", reason="mypy is not installed (.ci/install installs it)")
    config = ROOT / "pyproject.toml"
    assert "[tool.mypy]" in config.read_text(), f"{config} has no [tool.mypy] section"
    # In a process of its own: mypy's in-process API (mypy.api.run) leaves millions of objects alive in
    # the test process after a cold run (measured: 3.5 M, from 0.2 M), and every later gc.collect() then
    # costs seconds (2.5 s each on 2 cores), which the suite pays in every test that collects garbage.
    # The checkout's incremental cache (.mypy_cache, ignored by git): a second run takes under a second.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(ROOT / ".mypy_cache"),
         "--no-error-summary", "--hide-error-context", *map(str, STRICT)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), \
        f"mypy --strict on {[p.name for p in STRICT]}:\n{done.stdout}{done.stderr}"


def test_deploy_types_every_option_of_deployment():
    """``deploy(**options)`` is typed by DeploymentOptions: one entry per keyword option of
    Deployment (besides epoch and stash_dir, deploy's own), of the same type."""
    import inspect

    from lorapub.runtime.deployment import Deployment, DeploymentOptions

    options = {name: p.annotation for name, p in inspect.signature(Deployment.__init__).parameters.items()
               if p.kind is p.KEYWORD_ONLY and name not in {"epoch", "stash_dir"}}
    typed = {name: getattr(t, "__forward_arg__", t) for name, t in DeploymentOptions.__annotations__.items()}
    assert typed == options


def test_mypy_refuses_a_door_row_whose_handler_takes_another_command(tmp_path):
    """``on(Command, handler)``: the handler's command parameter must be that command (the registry's and
    the staging machine's tables are checked so by mypy --strict)."""
    pytest.importorskip("mypy.api", reason="mypy is not installed (.ci/install installs it)")
    snippet = tmp_path / "rows.py"
    snippet.write_text(
        "from lorapub.core.door import Table, on\n"
        "from lorapub.core.registry import Commit, Outcome, RegistryState, Reserve, commit, reserve\n"
        "from lorapub.core.staging import machine as M\n"
        "from lorapub.core.staging.messages import Begin\n"
        "good: Table[RegistryState, Outcome] = Table('r', on(Reserve, reserve), on(Commit, commit))\n"
        "bad: Table[RegistryState, Outcome] = Table('r', on(Reserve, commit))\n"
        "wrong: Table[M.StagingState, M.Outcome] = Table('s', on(Begin, M.end))\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
         str(ROOT / ".mypy_cache"), "--strict", "--no-error-summary", str(snippet)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [6, 7], done.stdout + done.stderr
    assert all('Argument 2 to "on"' in line for line in errors), done.stdout
