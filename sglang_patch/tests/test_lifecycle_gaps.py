"""Regression tests for SGLang 0.5.23's LoRA lifecycle, run on its own code.

Each ``check_*`` raises AssertionError when SGLang misbehaves. It runs on
three builds of the same TokenizerManager LoRA code: the installed wheel as
shipped ("unpatched"), the wheel with ``lorapub.sglang_patch.apply()``
("runtime"), and a copy of the wheel's files with ``sglang_patch/patches/*.diff``
applied ("diff"). Gaps that 0.5.23 still has fail unpatched and pass patched;
behaviour 0.5.23 already gets right (its own exactly-once release) is guarded
on every build.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess

import pytest

from tests import sglang_real

if not sglang_real.available():
    pytest.skip("sglang 0.5.23 is not installed (pip install --no-deps sglang==0.5.23)", allow_module_level=True)

from sglang_patch.tests import harness  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A = "relax_policy_lora@1-A-0123456789ab"
RECLAIM = {"X-Lorapub-Reclaim-Id": "reclaim-1-A-1"}


def diff_patched_root(tmp_path) -> str:
    root = sglang_real.sglang_root()
    for rel in ("srt/managers/tokenizer_manager.py", "srt/managers/tokenizer_control_mixin.py", "srt/entrypoints/http_server.py"):
        dst = tmp_path / "sglang" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(root, rel), dst)
    for diff in sorted(glob.glob(os.path.join(HERE, "patches", "*.diff"))):
        with open(diff) as f:
            subprocess.run(["patch", "-p1", "--batch", "-d", str(tmp_path)], stdin=f, check=True, capture_output=True)
    return str(tmp_path / "sglang")


@pytest.fixture(params=["unpatched", "runtime", "diff"])
def build(request, tmp_path):
    if request.param == "unpatched":
        cls = harness.build()
    elif request.param == "runtime":
        cls = harness.build_runtime_patched()
    else:
        cls = harness.build(diff_patched_root(tmp_path))
    cls.form = request.param
    return cls


async def loaded(cls, name=A, pinned=True, **kw):
    tm = cls(**kw)
    result = await tm.load_lora_adapter(harness.LoadLoRAAdapterReqInput(lora_name=name, lora_path=f"/adapters/{name}", pinned=pinned))
    assert result.success, result.error_message
    return tm


async def unload(tm, name=A, headers=RECLAIM):
    return await tm.unload_lora_adapter(harness.UnloadLoRAAdapterReqInput(lora_name=name), harness.Request(headers=dict(headers)))


# -- guarded on every build: 0.5.23's own exactly-once release ------------------------
async def test_500_and_503_release_once_and_keep_the_other_ref(build):
    tm = await loaded(build)
    hold = asyncio.Event()
    r_long = asyncio.create_task(tm.generate("long", A, hold=hold))
    await asyncio.sleep(0)
    assert tm.refs(A) == 1
    for status in (500, 503):
        with pytest.raises(Exception):
            await tm.generate(f"r{status}", A, terminal=status)
        await tm.settle()
        assert tm.refs(A) == 1  # 2 -> 1, never 0 while r_long runs
    hold.set()
    await r_long
    await tm.settle()
    assert tm.refs(A) == 0


async def test_pre_dispatch_400_returns_the_count(build):
    tm = await loaded(build)
    before = tm.refs(A)
    with pytest.raises(ValueError, match="context length"):
        await tm.generate("too-long", A, n_tokens=500, context_len=64)
    await tm.settle()
    assert tm.refs(A) == before


async def test_duplicate_terminal_and_disconnect_release_once(build):
    tm = await loaded(build)
    hold = asyncio.Event()
    r = asyncio.create_task(tm.generate("disc", A, hold=hold))
    await asyncio.sleep(0)
    r.cancel()  # client disconnect after dispatch: SGLang aborts, the scheduler answers
    with pytest.raises(asyncio.CancelledError):
        await r
    assert tm.aborted == ["disc"]
    state = tm.rid_to_state["disc"]
    tm.scheduler_finished("disc")
    tm._release_lora_once(state)  # a duplicate terminal event
    await tm.settle()
    assert tm.refs(A) == 0 and tm.releases.count(state.obj.lora_id) == 1


async def test_wait_for_unload_returns_only_after_the_last_terminal(build):
    tm = await loaded(build)
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


async def test_lru_never_evicts_pinned_adapters(build):
    tm = await loaded(build, max_loaded_loras=3)
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
    await asyncio.sleep(0.01)  # unregistered, waiting for the native ref
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


GAPS = [
    check_rejected_before_acquire_releases_nothing,
    check_late_request_after_unload_is_rejected_without_reload,
    check_request_racing_unload_is_rejected_without_reload,
    check_managed_pinned_adapter_refuses_ordinary_unload,
]


@pytest.mark.parametrize("check", GAPS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_gap_is_closed_by_the_patch(build, check):
    if build.form == "unpatched":
        with pytest.raises(AssertionError):
            await check(build)
    else:
        await check(build)


def test_patch_refuses_code_it_was_not_written_for(tmp_path):
    from lorapub import sglang_patch

    root = diff_patched_root(tmp_path)  # a different body of unload_lora_adapter
    with pytest.raises(sglang_patch.PatchMismatch, match="unload_lora_adapter"):
        sglang_patch.verify(root)
    sglang_patch.verify()  # the installed 0.5.23 is accepted


def test_apply_script_checks_the_installed_release():
    out = subprocess.run(["python3", os.path.join(HERE, "apply.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "3 patches apply" in out.stdout


def test_runtime_patch_is_idempotent():
    from lorapub import sglang_patch

    cls = harness.build_runtime_patched()
    wrapped = cls._release_lora_once
    assert sglang_patch.apply(cls, add_state_route=False) is cls and cls._release_lora_once is wrapped
