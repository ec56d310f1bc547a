"""SGLang 0.5.17 with Relax's own patch: the known variant ``0.5.17+relax``.

Relax runs SGLang 0.5.17 with ``docker/patch/sglang/v0.5.17.patch`` of redai-studio/Relax. That
patch edits none of the functions lorapub fingerprints, but it adds a route,
``POST /update_lora_from_distributed``, whose handler (``TokenizerControlMixin.
update_lora_from_distributed``) replaces an adapter of the same name in place: it unloads it through
``_unload_lora_adapter_locked`` (never ``unload_lora_adapter``, where lorapub refuses an ordinary
unload of a managed adapter) and registers the new tensors under that name. The tree is therefore
recognised as its own variant, never as plain 0.5.17, and the variant's edit makes the route refuse
managed names.

The tree is built here from the 0.5.17 tree plus Relax's patch text, which is not part of this
repository: ``.ci/install`` downloads it at the pinned commit into ``.cache/relax/``
(``$LORAPUB_RELAX_PATCH`` names another copy). Without it these tests are skipped.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest

from lorapub import sglang_patch
from lorapub.sglang_patch import diffs, targets
from tests import sglang_real
from tests.sglang_patch import harness
from tests.sglang_patch.test_lifecycle_gaps import CHECKS, GAPS, loaded, root_of

RELAX_COMMIT = "0a91dd1db44022920f61f05948e89a5cb83f8b38"
RELAX_PATCH_SHA256 = "a1826903f452c2ac51243742edd208c28080fe8707be87bea8d976e5eefcf48d"
VARIANT = "0.5.17+relax"
A = "relax_policy_lora@1-A-0123456789ab"
B = "relax_policy_lora@1-B-0123456789ab"
FIXED = "relax_policy_lora"  # Relax's own fixed adapter name (LORA_ADAPTER_NAME): not managed


def relax_patch() -> str:
    path = os.environ.get("LORAPUB_RELAX_PATCH") or os.path.join(
        sglang_real.REPO, ".cache", "relax", RELAX_COMMIT, "v0.5.17.patch")
    if not os.path.exists(path):
        pytest.skip(f"Relax's SGLang 0.5.17 patch is not at {path}: run .ci/install (it downloads it)")
    with open(path, "rb") as f:
        raw = f.read()
    got = hashlib.sha256(raw).hexdigest()
    assert got == RELAX_PATCH_SHA256, f"{path} is not Relax's patch at {RELAX_COMMIT} (sha256 {got})"
    return raw.decode()


def sections(patch: str) -> dict[str, str]:
    """The patch's per-file sections, by path inside the sglang package (a/python/sglang/<rel>)."""
    parts = re.split(r"(?m)^(?=diff --git )", patch)
    out = {}
    for part in parts:
        found = re.match(r"diff --git a/python/sglang/(\S+) b/", part)
        if found:
            out[found.group(1)] = part
    return out


def copy_release_files(dst) -> set[str]:
    """The 0.5.17 files the patch tool and the harness read, copied to ``dst``."""
    root = root_of("0.5.17")
    fingerprinted = {rel for rel, _, _ in targets.RELEASES[VARIANT].fingerprints}
    files = {*targets.RELEASES[VARIANT].touched_files, *fingerprinted, "srt/utils/common.py",
             "srt/utils/aio_rwlock.py", "srt/lora/lora_registry.py", "_version.py"}
    for rel in sorted(files):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(root, rel), dst / rel)
    return files


@pytest.fixture(scope="module")
def relax_root(tmp_path_factory) -> str:
    """The 0.5.17 files with Relax's patch applied to them (only its sections for those files)."""
    patch = relax_patch()
    copy = tmp_path_factory.mktemp("relax") / "sglang"
    files = copy_release_files(copy)
    found = sections(patch)
    applied = sorted(rel for rel in found if rel in files)
    for rel in applied:
        result = subprocess.run(["patch", "-p3", "--batch", "--forward", "--fuzz=0", "-d", str(copy)],
                                input=found[rel], capture_output=True, text=True)
        assert result.returncode == 0, f"Relax's section for {rel} does not apply:\n{result.stdout}{result.stderr}"
    # Relax edits four of the files lorapub patches, and neither file prepared loads rely on
    assert {targets.TM_FILE, targets.MIXIN_FILE, targets.HTTP_FILE, targets.SCHEDULER_FILE} <= set(applied)
    assert targets.LORA_MANAGER_FILE not in found and targets.MEM_POOL_FILE not in found
    return str(copy)


def copy_of(root: str, dst) -> str:
    shutil.copytree(root, dst)
    return str(dst)


# -- recognition --------------------------------------------------------------------------------------
def test_the_relax_tree_is_the_known_variant_and_plain_0517_stays_0517(relax_root):
    assert sglang_patch.verify(relax_root) == VARIANT
    assert sglang_patch.verify(root_of("0.5.17")) == "0.5.17"
    # every 0.5.17 fingerprint holds on the Relax tree: it is told apart by the function it adds
    for key, expected in targets.RELEASES["0.5.17"].fingerprints.items():
        assert targets.fingerprint(*key, relax_root) == expected, key


def test_an_edited_relax_route_is_refused_and_named(relax_root, tmp_path):
    root = copy_of(relax_root, tmp_path / "sglang")
    mixin = os.path.join(root, targets.MIXIN_FILE)
    text = open(mixin).read()
    anchor = "            async with self.lora_update_lock:\n                # Self-contained same-name replacement"
    assert text.count(anchor) == 1
    with open(mixin, "w") as f:
        f.write(text.replace(anchor, "            pass\n" + anchor))
    before = open(mixin).read()
    with pytest.raises(sglang_patch.PatchMismatch) as refused:
        diffs.apply_diffs(root)
    message = str(refused.value)
    assert f"SGLang {VARIANT}:\n    TokenizerControlMixin.update_lora_from_distributed: fingerprint" in message
    assert "SGLang 0.5.17:\n    TokenizerControlMixin.update_lora_from_distributed: present" in message
    assert open(mixin).read() == before  # nothing touched


def test_command_line_checks_applies_and_verifies_the_variant(relax_root, tmp_path):
    root = copy_of(relax_root, tmp_path / "sglang")
    run = [sys.executable, "-m", "lorapub.sglang_patch"]
    out = subprocess.run([*run, "verify", "--root", root], capture_output=True, text=True)
    assert out.returncode == 0 and f"SGLang {VARIANT}: supported" in out.stdout, out.stderr
    out = subprocess.run([*run, "check", "--root", root], capture_output=True, text=True)
    assert out.returncode == 0 and f"SGLang {VARIANT} verified; 4 patches and the variant's edit apply" in out.stdout, out.stderr
    out = subprocess.run([*run, "apply", "--root", root], capture_output=True, text=True)
    assert out.returncode == 0 and f"applied 4 patches and the variant's edit for SGLang {VARIANT}" in out.stdout, out.stderr
    out = subprocess.run([*run, "check", "--root", root], capture_output=True, text=True)
    assert out.returncode == 0 and "already applied" in out.stdout, out.stderr
    for rel in targets.RELEASES[VARIANT].touched_files:
        ast.parse(open(os.path.join(root, rel)).read())
    route = targets.function_source(*targets.RELAX_ROUTE, root)
    assert route.count("self._lorapub_refuse_distributed_update(obj)") == 1
    assert route.index("_lorapub_refuse_distributed_update") < route.index("async with self.lora_update_lock")
    assert f'"sglang": "{VARIANT}",' in open(os.path.join(root, targets.HTTP_FILE)).read()


def test_runtime_patch_names_the_variant_and_is_idempotent(relax_root):
    cls = harness.build_runtime_patched(relax_root)
    assert getattr(cls, sglang_patch.PATCH_MARK) == VARIANT
    before = dict(vars(cls))
    assert sglang_patch.apply(cls, root=relax_root, add_state_route=False) is cls
    assert dict(vars(cls)) == before


# -- behaviour on the variant's own code: shipped (unpatched), runtime-patched, diff-patched -----------
@pytest.fixture(params=["unpatched", "runtime", "diff"])
def build(request, relax_root, tmp_path):
    if request.param == "unpatched":
        cls = harness.build(relax_root, "0.5.17")
    elif request.param == "runtime":
        cls = harness.build_runtime_patched(relax_root)
    else:
        root = copy_of(relax_root, tmp_path / "sglang")
        assert f"for SGLang {VARIANT}" in diffs.apply_diffs(root)
        cls = harness.build(root, "0.5.17")
    cls.form = request.param
    cls.release = "0.5.17"
    return cls


def push(name: str, pinned: bool = False) -> harness.UpdateLoRAFromDistributedReqInput:
    return harness.UpdateLoRAFromDistributedReqInput(
        lora_name=name, config_dict={"r": 8}, names=["w"], dtypes=["bfloat16"], shapes=[[8, 8]], pinned=pinned)


async def check_route_refuses_managed_names(cls):
    tm = await loaded(cls)  # A: managed, pinned, loaded by lorapub
    ref = tm.lora_registry.get_all_adapters()[A]
    result = await tm.update_lora_from_distributed(push(A))
    assert not result.success, "/update_lora_from_distributed replaced a managed version in place"
    assert "managed by lorapub" in result.error_message
    assert tm.lora_registry.get_all_adapters()[A] == ref  # same lora_id, still pinned
    assert ("unload", A) not in tm.rank_ops and tm.rank_ops.count(("load", A)) == 1
    # a managed name that is not loaded is not registered behind lorapub's back either
    assert not (await tm.update_lora_from_distributed(push(B, pinned=True))).success
    assert B not in tm.lora_registry.get_all_adapters() and ("load", B) not in tm.rank_ops


async def check_route_keeps_replacing_relax_fixed_adapter(cls):
    tm = cls()
    first = await tm.update_lora_from_distributed(push(FIXED))
    assert first.success, first.error_message
    old_id = tm.lora_registry.get_all_adapters()[FIXED].lora_id
    second = await tm.update_lora_from_distributed(push(FIXED))
    assert second.success, second.error_message
    assert tm.lora_registry.get_all_adapters()[FIXED].lora_id != old_id
    assert tm.rank_ops == [("load", FIXED), ("unload", FIXED), ("load", FIXED)]


async def check_route_lru_eviction_passes_over_managed_adapters(cls):
    tm = await loaded(cls, max_loaded_loras=3)
    result = await tm.load_lora_adapter(harness.LoadLoRAAdapterReqInput(lora_name=B, lora_path=f"/adapters/{B}", pinned=True))
    assert result.success, result.error_message
    assert (await tm.update_lora_from_distributed(push(FIXED))).success  # 3 loaded: A, B pinned; FIXED not
    assert (await tm.update_lora_from_distributed(push("other"))).success  # 4 > 3: the LRU unpinned goes
    assert set(tm.lora_registry.get_all_adapters()) == {A, B, "other"}
    assert ("unload", A) not in tm.rank_ops and ("unload", B) not in tm.rank_ops


VARIANT_CHECKS = [
    check_route_refuses_managed_names,
    check_route_keeps_replacing_relax_fixed_adapter,
    check_route_lru_eviction_passes_over_managed_adapters,
]
VARIANT_GAPS = {"check_route_refuses_managed_names"}


@pytest.mark.parametrize("check", CHECKS + VARIANT_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_lifecycle_on_the_variant(build, check):
    """Every 0.5.17 check holds on the variant as on 0.5.17, and so do the route's own."""
    if build.form == "unpatched" and check.__name__ in GAPS["0.5.17"] | VARIANT_GAPS:
        with pytest.raises(AssertionError):
            await check(build)
    else:
        await check(build)
