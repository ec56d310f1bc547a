"""``python -m lorapub``: bad arguments and unusable engines are one line on stderr and exit 2,
``--version`` answers without loading the demo, and the demo's temporary folder is gone on
every way out (success, an engine it cannot reach, SIGTERM)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

import lorapub

SRC = str(pathlib.Path(__file__).resolve().parents[2] / "src")


def lorapub_cli(*args: str, tmp: pathlib.Path, timeout: float = 120, extra: tuple[str, ...] = ()):
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, *extra, "-m", "lorapub", *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=timeout)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once this socket is closed


def assert_usage_error(out: subprocess.CompletedProcess, says: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("lorapub demo: error: ") and says in last, out.stderr
    # argparse adds its usage line before the error; nothing else is written
    assert all(line.startswith(("usage:", " ", "lorapub demo: error: ")) for line in out.stderr.strip().splitlines()), out.stderr


def test_version_prints_the_package_version_without_loading_the_demo(tmp_path):
    out = lorapub_cli("--version", tmp=tmp_path, extra=("-X", "importtime"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"lorapub {lorapub.__version__}"
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    heavy = {m for m in imported if m.split(".")[0] in {"torch", "aiohttp", "numpy", "safetensors", "sglang"}}
    assert not heavy, sorted(heavy)


def test_the_version_is_the_projects():
    text = (pathlib.Path(SRC).parent / "pyproject.toml").read_text()
    assert f'\nversion = "{lorapub.__version__}"\n' in text


@pytest.mark.parametrize(
    "args, says",
    [
        (("--sessions", "0"), "argument --sessions: must be at least 1, got 0"),
        (("--sessions", "-3"), "argument --sessions: must be at least 1, got -3"),
        (("--sessions", "many"), "argument --sessions: invalid int value: 'many'"),
        (("--engine-url", "http://127.0.0.1:1"), "give it twice"),
        (("--engine-url", "not-a-url", "--engine-url", "http://127.0.0.1:1"), "argument --engine-url: base_url must be"),
        (("--transport", "carrier-pigeon"), "argument --transport: invalid choice: 'carrier-pigeon'"),
        (("--transport", "shared-dir", "--shared-dir", "/nonexistent/lorapub"),
         "argument --shared-dir: path must be an existing folder, got '/nonexistent/lorapub'"),
        (("--shared-dir", "/tmp"), "argument --shared-dir: goes with --transport shared-dir"),
    ],
    ids=["sessions-0", "sessions-negative", "sessions-not-int", "one-engine-url", "bad-url", "bad-transport",
         "missing-shared-dir", "shared-dir-without-its-transport"],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, says):
    out = lorapub_cli("demo", *args, tmp=tmp_path / "tmp", timeout=60)
    assert_usage_error(out, says)
    assert list((tmp_path / "tmp").iterdir()) == []


def test_an_unreachable_engine_is_one_line_and_exit_2_and_leaves_no_folder(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    out = lorapub_cli("demo", "--engine-url", url, "--engine-url", url, tmp=tmp_path / "tmp", timeout=60)
    assert_usage_error(out, f"cannot use engine e0 at {url}")
    assert "OUTCOME_UNKNOWN" in out.stderr and "usage:" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_demo_with_few_sessions_runs_and_removes_its_folder(tmp_path):
    out = lorapub_cli("demo", "--sessions", "2", tmp=tmp_path / "tmp", timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.rstrip().endswith("OK")
    assert list((tmp_path / "tmp").iterdir()) == []
    # the engine counts span every life: e1's crash in the story is counted, its earlier unloads kept
    e1 = next(line for line in out.stdout.splitlines() if line.startswith("  e1: loads"))
    assert "restarts 1" in e1 and "physical unloads 0" not in e1, e1


def test_a_terminated_demo_removes_its_folder(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    child = subprocess.Popen([sys.executable, "-m", "lorapub", "demo", "--sessions", "40"], cwd=tmp, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        seen = []
        for line in child.stdout:
            seen.append(line)
            if "published A" in line or time.monotonic() > deadline:
                break
        assert any("published A" in line for line in seen), "".join(seen)
        assert [p.name for p in tmp.iterdir() if p.name.startswith("lorapub-demo-")], "the demo's folder exists"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "lorapub demo: terminated", err[-2000:]
    assert list(tmp.iterdir()) == []
