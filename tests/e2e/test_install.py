"""The two commands of the README: the demo needs lorapub's light dependencies only (no torch),
and the test command's ``.ci/install`` takes torch's CPU build where it can, says what it does,
and keeps what is already installed. ``.ci/run`` runs exactly the README's test command."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0].lower()


def two_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, re.S)


# -- the demo's install ------------------------------------------------------------------------
def test_lorapubs_own_dependencies_hold_no_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {requirement_name(d) for d in project["dependencies"]}
    assert not names & {"torch", "ray", "sglang", "sglang-router", "matplotlib"}, names
    assert "torch" in {requirement_name(d) for d in project["optional-dependencies"]["torch"]}


def test_the_readmes_demo_command_installs_lorapub_alone():
    demo, tests = two_commands()[:2]
    assert demo == "python3 -m pip install -e . && python3 -m lorapub demo"
    assert tests == "bash .ci/install && python3 -m pytest -q"


def run_demo(*python_args: str, env_extra: dict[str, str], tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, *python_args, "-m", "lorapub", "demo", "--sessions", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_demo_imports_no_torch(tmp_path):
    out = run_demo("-X", "importtime", env_extra={"PYTHONPATH": SRC}, tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in imported if m.split(".")[0] == "torch" or m == "safetensors.torch"}


def test_the_demo_runs_where_torch_cannot_be_imported(tmp_path):
    shadow = tmp_path / "no-torch"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    out = run_demo(env_extra={"PYTHONPATH": f"{shadow}{os.pathsep}{SRC}"}, tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")


# -- .ci/install and .ci/run, against a stand-in interpreter that installs nothing ----------------
FAKE_PYTHON = r"""#!/usr/bin/env bash
# Records each call; answers as a machine described by FAKE_TORCH (a torch version that imports,
# or empty) and FAKE_CPU_INDEX (1: PyTorch's CPU index answers).
echo "python $*" >> "$FAKE_LOG"
case "$1" in
  -)  cat >/dev/null
      version=$FAKE_TORCH
      [ -f "$FAKE_DIR/torch-installed" ] && version=2.13.0+cpu
      [ -z "$version" ] && exit 1
      echo "$version (CPU build)"
      case "$version" in 1.*|2.[0-3].*|2.[0-3]) exit 1;; esac
      exit 0;;
  -c) case "$2" in *urlopen*) [ "$FAKE_CPU_INDEX" = 1 ] && exit 0; exit 1;; esac; exit 0;;
  -m) case "$*" in *"torch=="*) touch "$FAKE_DIR/torch-installed";; esac
      [ "$2" = pytest ] && exit "${FAKE_PYTEST_RC:-0}"
      exit 0;;
esac
exit 0
"""


def fake_repo(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """A copy of the CI scripts in a repository of their own, a stand-in python3 and patch on PATH."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    (repo / ".cache" / "sglang" / "0.5.17" / "sglang").mkdir(parents=True)
    (repo / ".cache" / "sglang" / "0.5.17" / "sglang" / "_version.py").write_text("__version__ = '0.5.17'\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("patch", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls"),
           "FAKE_DIR": str(tmp_path), "PYTHON": str(bin_dir / "python3")}
    return repo, env


def install(tmp_path: pathlib.Path, **machine: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo, env = fake_repo(tmp_path)
    env.update({"FAKE_TORCH": "", "FAKE_CPU_INDEX": "0", **machine})
    out = subprocess.run(["bash", str(repo / ".ci" / "install")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    return out, calls


def torch_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("python -m pip install") and "torch==" in c]


def test_install_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "install")]).returncode == 0


def test_install_takes_torchs_cpu_build_from_pytorchs_cpu_index(tmp_path):
    out, calls = install(tmp_path, FAKE_CPU_INDEX="1")
    assert torch_installs(calls) == [
        f"python -m pip install --quiet --disable-pip-version-check --index-url {CPU_INDEX} torch==2.13.0"]
    assert "[install] torch 2.13.0 (CPU build, from https://download.pytorch.org/whl/cpu)…" in out.stdout
    assert "CUDA" not in out.stdout


def test_install_falls_back_to_the_public_index_and_says_it_is_the_cuda_build(tmp_path):
    out, calls = install(tmp_path, FAKE_CPU_INDEX="0")
    assert torch_installs(calls) == ["python -m pip install --quiet --disable-pip-version-check torch==2.13.0"]
    line = next(line for line in out.stdout.splitlines() if "unreachable" in line)
    assert line.startswith("[install] torch 2.13.0: ") and "public index" in line and "CUDA build" in line


def test_install_keeps_a_torch_that_already_imports(tmp_path):
    out, calls = install(tmp_path, FAKE_TORCH="2.13.0+cpu", FAKE_CPU_INDEX="1")
    assert torch_installs(calls) == []
    assert not any("urlopen" in c for c in calls)
    assert "[install] torch 2.13.0+cpu (CPU build) already importable: kept" in out.stdout


def test_install_replaces_a_torch_older_than_the_extra_allows(tmp_path):
    out, calls = install(tmp_path, FAKE_TORCH="2.1.0", FAKE_CPU_INDEX="1")
    assert len(torch_installs(calls)) == 1
    assert "[install] torch 2.1.0 (CPU build) is older than 2.4: replaced" in out.stdout


def test_install_says_each_step_and_keeps_pip_quiet(tmp_path):
    out, calls = install(tmp_path, FAKE_TORCH="2.13.0+cpu")
    steps = out.stdout.splitlines()
    assert steps and all(line.startswith("[install] ") for line in steps), out.stdout
    assert [s for s in steps if "lorapub (editable)" in s or "sglang 0.5.23" in s or "sglang-router" in s]
    pip_calls = [c for c in calls if " -m pip " in c]
    assert pip_calls and all("--quiet" in c for c in pip_calls), pip_calls
    assert any(c.endswith("install --quiet --disable-pip-version-check -e .[test,ray,bench,metrics,cli]") for c in calls), calls


def run_ci(tmp_path: pathlib.Path, pytest_rc: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo, env = fake_repo(tmp_path)
    (repo / ".ci" / "install").write_text("#!/usr/bin/env bash\necho \"install $*\" >> \"$FAKE_LOG\"\n")
    env["FAKE_PYTEST_RC"] = str(pytest_rc)
    out = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return out, (tmp_path / "calls").read_text().splitlines()


def test_ci_runs_exactly_the_readmes_test_command(tmp_path):
    out, calls = run_ci(tmp_path, 0)
    assert out.returncode == 0, out.stderr
    install_cmd, test_cmd = two_commands()[1].split(" && ")
    assert install_cmd == "bash .ci/install" and test_cmd == "python3 -m pytest -q"
    assert calls == ["install ", "python -m pytest -q"]


def test_ci_fails_when_pytest_collects_nothing(tmp_path):
    out, _ = run_ci(tmp_path, 5)
    assert out.returncode == 1 and "collected no tests" in out.stderr
