"""Regression tests for the LoRA lifecycle of every supported SGLang release, run on its own code.

Each ``check_*`` raises AssertionError when SGLang misbehaves. It runs on three builds
of each release's TokenizerManager LoRA code: the release as shipped ("unpatched"), with
``lorapub.sglang_patch.apply()`` ("runtime"), and a copy of its files with the release's
``diffs/`` applied ("diff"). Gaps a release has fail unpatched and pass patched; behaviour
a release already gets right is guarded on every build.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from lorapub import sglang_patch
from lorapub.sglang_patch import diffs, targets
from tests import sglang_real
from tests.helpers.waiting import until
from tests.sglang_patch import harness

RELEASES = ["0.5.17", "0.5.23"]
A = "relax_policy_lora@1-A-0123456789ab"
RECLAIM = {"X-Lorapub-Reclaim-Id": "reclaim-1-A-1"}


def root_of(release: str) -> str:
    root = sglang_real.release_root(release)
    if root is None:
        pytest.fail(f"SGLang {release}'s code is not on this machine: run .ci/install (it fetches both releases)")
    return root


def diff_patched_root(release: str, tmp_path) -> str:
    root = root_of(release)
    copy = tmp_path / "sglang"
    fingerprinted = {rel for rel, _, _ in targets.RELEASES[release].fingerprints}
    for rel in sorted({*targets.RELEASES[release].touched_files, *fingerprinted, "srt/utils/common.py",
                       "srt/utils/aio_rwlock.py", "srt/lora/lora_registry.py", "_version.py"}):
        dst = copy / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(root, rel), dst)
    report = diffs.apply_diffs(str(copy))
    assert f"for SGLang {release}" in report, report
    return str(copy)


_PATCHED: dict[str, str] = {}


def patched_root(release: str) -> str:
    """A diff-patched copy of ``release`` made once per test process, for tests that only read it (a
    copy and apply per test was 1.5 s each, over a hundred tests)."""
    if release not in _PATCHED:
        where = tempfile.mkdtemp(prefix=f"lorapub-{release}-")
        atexit.register(shutil.rmtree, where, True)
        _PATCHED[release] = diff_patched_root(release, pathlib.Path(where))
    return _PATCHED[release]


@pytest.fixture(params=[(r, f) for r in RELEASES for f in ("unpatched", "runtime", "diff")], ids=lambda p: f"{p[0]}-{p[1]}")
def build(request, tmp_path):
    release, form = request.param
    if form == "unpatched":
        cls = harness.build(root_of(release), release)
    elif form == "runtime":
        cls = harness.build_runtime_patched(root_of(release))
    else:
        cls = harness.build(patched_root(release), release)
    cls.form = form
    cls.release = release
    return cls


async def loaded(cls, name=A, pinned=True, **kw):
    tm = cls(**kw)
    result = await tm.load_lora_adapter(harness.LoadLoRAAdapterReqInput(lora_name=name, lora_path=f"/adapters/{name}", pinned=pinned))
    assert result.success, result.error_message
    return tm


async def unload(tm, name=A, headers=RECLAIM):
    return await tm.unload_lora_adapter(harness.UnloadLoRAAdapterReqInput(lora_name=name), harness.Request(headers=dict(headers)))


# -- exactly-once release: upstream in 0.5.23, lorapub's backport in 0.5.17 --------------------
async def check_500_and_503_release_once_and_keep_the_other_ref(cls):
    tm = await loaded(cls)
    hold = asyncio.Event()
    r_long = asyncio.create_task(tm.generate("long", A, hold=hold))
    await asyncio.sleep(0)
    assert tm.refs(A) == 1
    for status in (500, 503):
        with pytest.raises(Exception):
            await tm.generate(f"r{status}", A, terminal=status)
        await tm.settle()
        assert tm.refs(A) == 1, f"a {status} ending moved the native refs to {tm.refs(A)} under a running request"
    hold.set()
    await r_long
    await tm.settle()
    assert tm.refs(A) == 0


async def check_pre_dispatch_400_returns_the_count(cls):
    tm = await loaded(cls)
    before = tm.refs(A)
    with pytest.raises(ValueError, match="context length"):
        await tm.generate("too-long", A, n_tokens=500, context_len=64)
    await tm.settle()
    assert tm.refs(A) == before, f"a request rejected before scheduling kept its ref ({tm.refs(A)})"


async def check_disconnect_and_duplicate_terminal_release_once(cls):
    tm = await loaded(cls)
    hold = asyncio.Event()
    r = asyncio.create_task(tm.generate("disc", A, hold=hold))
    await asyncio.sleep(0)
    state = tm.rid_to_state["disc"]
    r.cancel()  # client disconnect after dispatch: SGLang aborts, the scheduler answers
    with pytest.raises(asyncio.CancelledError):
        await r
    assert tm.aborted == ["disc"]
    tm.scheduler_finished("disc")
    tm.scheduler_finished("disc") if cls.release == "0.5.17" else tm._release_lora_once(state)  # a duplicate terminal
    await tm.settle()
    assert tm.refs(A) == 0, f"a disconnected request left {tm.refs(A)} native ref(s)"
    assert tm.releases.count(state.obj.lora_id) == 1


async def check_wait_for_unload_returns_only_after_the_last_terminal(cls):
    tm = await loaded(cls)
    holds = [asyncio.Event(), asyncio.Event()]
    reqs = [asyncio.create_task(tm.generate(f"r{i}", A, hold=h)) for i, h in enumerate(holds)]
    await asyncio.sleep(0)
    holds[0].set()
    await reqs[0]
    unloading = asyncio.create_task(unload(tm))
    await asyncio.sleep(0.01)
    assert not unloading.done() and ("unload", A) not in tm.rank_ops
    holds[1].set()
    await reqs[1]
    assert (await unloading).success
    assert tm.rank_ops.count(("unload", A)) == 1


async def check_lru_never_evicts_pinned_adapters(cls):
    tm = await loaded(cls, max_loaded_loras=3)
    b = A.replace("-A-", "-B-")
    await tm.load_lora_adapter(harness.LoadLoRAAdapterReqInput(lora_name=b, lora_path="/b", pinned=True))
    for name in ("third-party-1", "third-party-2"):
        await tm.load_lora_adapter(harness.LoadLoRAAdapterReqInput(lora_name=name, lora_path=f"/{name}"))
    assert set(tm.lora_registry.get_all_adapters()) == {A, b, "third-party-2"}


# -- the gaps: fail on the shipped wheel, pass with either form of the patch ----------------
async def check_rejected_before_acquire_releases_nothing(cls):
    tm = await loaded(cls)
    with pytest.raises(ValueError, match="never been loaded"):
        await tm.generate("unknown", "relax_policy_lora@1-Z-000000000000")
    await tm.settle()
    assert None not in tm.releases, "a release was scheduled for a request that acquired nothing"
    assert tm.refs(A) == 0


async def check_late_request_after_unload_is_rejected_without_reload(cls):
    tm = await loaded(cls)
    assert (await unload(tm)).success
    try:
        await tm.generate("late", A)
    except ValueError:
        pass
    else:
        raise AssertionError("a late request for an unloaded managed adapter was served")
    assert tm.rank_ops.count(("load", A)) == 1, f"implicit reload: {tm.rank_ops}"
    assert A not in tm.lora_registry.get_all_adapters()


async def check_request_racing_unload_is_rejected_without_reload(cls):
    tm = await loaded(cls)
    hold = asyncio.Event()
    inflight = asyncio.create_task(tm.generate("old", A, hold=hold))
    await asyncio.sleep(0)
    unloading = asyncio.create_task(unload(tm))
    await until(lambda: A not in tm.lora_registry.get_all_adapters(), what="A unregistered")  # waiting for the native ref
    late = asyncio.create_task(tm.generate("late", A))
    await asyncio.sleep(0.01)
    hold.set()
    await inflight
    assert (await unloading).success
    outcome = await asyncio.gather(late, return_exceptions=True)
    assert isinstance(outcome[0], ValueError), "the late request was served by a reloaded adapter"
    assert tm.rank_ops.count(("load", A)) == 1, f"implicit reload: {tm.rank_ops}"


async def check_managed_pinned_adapter_refuses_ordinary_unload(cls):
    tm = await loaded(cls)
    refused = await unload(tm, headers={})
    assert not refused.success, "an ordinary unload removed a managed pinned adapter"
    assert A in tm.lora_registry.get_all_adapters()
    assert (await unload(tm)).success  # lorapub's reclaim still can
    tm2 = await loaded(cls, name="third-party", pinned=True)
    assert (await unload(tm2, name="third-party", headers={})).success  # others keep SGLang's behaviour


CHECKS = [
    check_500_and_503_release_once_and_keep_the_other_ref,
    check_pre_dispatch_400_returns_the_count,
    check_disconnect_and_duplicate_terminal_release_once,
    check_wait_for_unload_returns_only_after_the_last_terminal,
    check_lru_never_evicts_pinned_adapters,
    check_rejected_before_acquire_releases_nothing,
    check_late_request_after_unload_is_rejected_without_reload,
    check_request_racing_unload_is_rejected_without_reload,
    check_managed_pinned_adapter_refuses_ordinary_unload,
]
# What each release gets wrong as shipped (the rest it gets right, and every build is held to it).
GAPS = {
    "0.5.17": {
        "check_500_and_503_release_once_and_keep_the_other_ref",
        "check_pre_dispatch_400_returns_the_count",
        "check_disconnect_and_duplicate_terminal_release_once",
        "check_late_request_after_unload_is_rejected_without_reload",
        "check_request_racing_unload_is_rejected_without_reload",
        "check_managed_pinned_adapter_refuses_ordinary_unload",
    },
    "0.5.23": {
        "check_rejected_before_acquire_releases_nothing",
        "check_late_request_after_unload_is_rejected_without_reload",
        "check_request_racing_unload_is_rejected_without_reload",
        "check_managed_pinned_adapter_refuses_ordinary_unload",
    },
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_lifecycle(build, check):
    if build.form == "unpatched" and check.__name__ in GAPS[build.release]:
        with pytest.raises(AssertionError):
            await check(build)
    else:
        await check(build)


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_is_recognised_by_its_code(release, tmp_path):
    assert sglang_patch.verify(root_of(release)) == release
    patched = diff_patched_root(release, tmp_path)  # other bodies of the patched functions
    with pytest.raises(sglang_patch.PatchMismatch) as refused:
        sglang_patch.verify(patched)
    message = str(refused.value)
    assert "supports SGLang 0.5.17, 0.5.17+relax, 0.5.23 only" in message and "unload_lora_adapter" in message


def test_another_release_is_refused_before_anything_is_touched(tmp_path):
    copy = tmp_path / "sglang"
    shutil.copytree(root_of("0.5.23"), copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    mixin = copy / targets.MIXIN_FILE
    mixin.write_text(mixin.read_text().replace("async def unload_lora_adapter(", "async def unload_lora_adapter(  # 0.6\n"))
    before = mixin.read_text()
    with pytest.raises(sglang_patch.PatchMismatch, match=r"0\.5\.17, 0\.5\.17\+relax, 0\.5\.23"):
        diffs.apply_diffs(str(copy))
    with pytest.raises(sglang_patch.PatchMismatch):
        sglang_patch.apply(harness.build(root_of("0.5.23"), "0.5.23"), root=str(copy), add_state_route=False)
    assert mixin.read_text() == before


@pytest.mark.parametrize("release", RELEASES)
def test_command_line_checks_and_applies_all_or_nothing(release, tmp_path):
    root = diff_patched_root(release, tmp_path / "patched")  # already applied: recognised, left alone
    run = [sys.executable, "-m", "lorapub.sglang_patch"]
    out = subprocess.run([*run, "check", "--root", root], capture_output=True, text=True)
    assert out.returncode == 0 and "already applied" in out.stdout, out.stderr
    pristine = tmp_path / "pristine" / "sglang"
    shutil.copytree(root_of(release), pristine, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    out = subprocess.run([*run, "check", "--root", str(pristine)], capture_output=True, text=True)
    count = len(diffs.diff_files(release))
    assert count == {"0.5.17": 5, "0.5.23": 6}[release]
    assert out.returncode == 0 and f"SGLang {release} verified; {count} patches apply" in out.stdout, out.stderr
    out = subprocess.run([*run, "apply", "--root", str(pristine)], capture_output=True, text=True)
    assert out.returncode == 0 and f"applied {count} patches for SGLang {release}" in out.stdout, out.stderr


def test_shipped_0517_diffs_are_the_runtime_edits():
    """The 0.5.17 diffs are rendered from the same edits the runtime form compiles."""
    rendered = diffs.render_0517(root_of("0.5.17"))
    shipped = {os.path.basename(p): open(p).read() for p in diffs.diff_files("0.5.17")}
    assert rendered == shipped


def test_shipped_0523_staging_diff_is_the_runtime_routes():
    """0.5.23's staging-routes diff is rendered from the same block the 0.5.17 diff carries."""
    rendered = diffs.render_0523(root_of("0.5.23"))
    shipped = {os.path.basename(p): open(p).read() for p in diffs.diff_files("0.5.23")}
    assert rendered[diffs.STAGING_0523] == shipped[diffs.STAGING_0523]
    hook = diffs.PREPARED_LOAD["0.5.23"]
    assert rendered[hook] == shipped[hook]
    stamp = diffs.PROVENANCE["0.5.23"]
    assert rendered[stamp] == shipped[stamp]


@pytest.mark.parametrize("release", RELEASES)
def test_runtime_patch_is_idempotent(release):
    cls = harness.build_runtime_patched(root_of(release))
    before = dict(vars(cls))
    assert sglang_patch.apply(cls, root=root_of(release), add_state_route=False) is cls
    assert dict(vars(cls)) == before
    assert getattr(cls, sglang_patch.PATCH_MARK) == release
