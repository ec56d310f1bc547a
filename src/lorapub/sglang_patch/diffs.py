"""The diff form: unified diffs per release, shipped as package data under ``diffs/<release>/``.

``apply_diffs`` recognises the release by its fingerprints, applies the whole series to a
scratch copy first, and touches the installation only when every diff applies. A known variant
(``0.5.17+relax``) takes its base release's diffs, then its own source edits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from importlib import resources

from lorapub.sglang_patch.targets import RELEASES, SUPPORTED, PatchMismatch, detect, sglang_root


def diff_files(version: str) -> list[str]:
    folder = resources.files("lorapub.sglang_patch") / "diffs" / version
    return sorted(str(p) for p in folder.iterdir() if p.name.endswith(".diff"))


def already_applied(root: str) -> bool:
    """Whether lorapub's diffs were applied at ``root`` (their marker is in the code)."""
    for release in RELEASES.values():
        rel, marker = release.applied_marker
        path = os.path.join(root, rel)
        if os.path.exists(path):
            with open(path) as f:
                if marker in f.read():
                    return True
    return False


def _patch(root: str, diff: str, dry: bool = False) -> subprocess.CompletedProcess[str]:
    if shutil.which("patch") is None:
        raise PatchMismatch("GNU patch is needed to apply the diffs (apt-get install patch)")
    # the diffs name a/sglang/<file>: strip two levels and patch inside the package folder
    # no fuzz: a hunk whose context does not match exactly is refused, never placed near it
    args = ["patch", "-p2", "--forward", "--batch", "--fuzz=0", "-d", root] + (["--dry-run"] if dry else [])
    with open(diff) as f:
        return subprocess.run(args, stdin=f, capture_output=True, text=True)


def apply_diffs(root: str | None = None, *, check_only: bool = False) -> str:
    """Apply (or only check) the diffs of the release found at ``root``. Returns a one-line report."""
    root = os.path.abspath(root or sglang_root())
    if already_applied(root):
        return f"{root}: lorapub's patches are already applied"
    release = detect(root)
    diffs = diff_files(release.upstream)  # a known variant takes its base release's diffs ...
    from lorapub.sglang_patch.release_0517 import VARIANT_EDITS, apply_variant_edits

    variant = " and the variant's edit" if release.version in VARIANT_EDITS else ""
    with tempfile.TemporaryDirectory() as scratch:
        for rel in release.touched_files:
            os.makedirs(os.path.join(scratch, os.path.dirname(rel)), exist_ok=True)
            shutil.copy(os.path.join(root, rel), os.path.join(scratch, rel))
        for diff in diffs:
            result = _patch(scratch, diff)
            if result.returncode != 0:
                raise PatchMismatch(f"{os.path.basename(diff)} does not apply:\n{result.stdout}{result.stderr}")
        apply_variant_edits(scratch, release.version)  # ... and then its own edits (anchors checked here)
    if check_only:
        return f"{root}: SGLang {release.version} verified; {len(diffs)} patches{variant} apply"
    for diff in diffs:
        result = _patch(root, diff)
        if result.returncode != 0:  # the scratch run passed, so this is a write or permission problem
            raise PatchMismatch(f"{os.path.basename(diff)} failed on {root}:\n{result.stdout}{result.stderr}")
    apply_variant_edits(root, release.version)
    return f"{root}: applied {len(diffs)} patches{variant} for SGLang {release.version}"


def render_0517(root: str) -> dict[str, str]:
    """Unified diffs of the 0.5.17 edits against the pristine tree at ``root`` (file name -> text)."""
    from lorapub.sglang_patch import release_0517

    if detect(root).version != "0.5.17":
        raise PatchMismatch(f"{root} is not a pristine SGLang 0.5.17 tree")
    out = {}
    for n, (rel, text) in enumerate(sorted(release_0517.patched_files(root).items()), start=1):
        with tempfile.TemporaryDirectory() as tmp:
            for side, body in (("a", open(os.path.join(root, rel)).read()), ("b", text)):
                path = os.path.join(tmp, side, "sglang", rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(body)
            diff = subprocess.run(
                ["diff", "-u", "--label", f"a/sglang/{rel}", "--label", f"b/sglang/{rel}", f"a/sglang/{rel}",
                 f"b/sglang/{rel}"],
                cwd=tmp, capture_output=True, text=True,
            ).stdout
        stem = os.path.splitext(os.path.basename(rel))[0].replace("_", "-")
        out[f"{n:04d}-{stem}.diff"] = diff
    out.update(render_prepared_load(root))
    out.update(render_provenance(root))
    return out


def _unified(rel: str, before: str, after: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for side, body in (("a", before), ("b", after)):
            path = os.path.join(tmp, side, "sglang", rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(body)
        return subprocess.run(
            ["diff", "-u", "--label", f"a/sglang/{rel}", "--label", f"b/sglang/{rel}", f"a/sglang/{rel}",
             f"b/sglang/{rel}"],
            cwd=tmp, capture_output=True, text=True,
        ).stdout


#: The 0.5.23 diff rendered from lorapub's code (0001-0003 are written by hand).
STAGING_0523 = "0004-engine-side-staging-routes.diff"


def render_0523(root: str) -> dict[str, str]:
    """The 0.5.23 staging-routes diff (file name -> text), against the pristine tree at ``root`` with
    0001-0003 applied: the staging block of :mod:`lorapub.sglang_patch.routes` after the state route."""
    from lorapub.sglang_patch.edits import insert_before
    from lorapub.sglang_patch.routes import HTTP_STAGING_BLOCK
    from lorapub.sglang_patch.targets import HTTP_FILE

    if detect(root).version != "0.5.23":
        raise PatchMismatch(f"{root} is not a pristine SGLang 0.5.23 tree")
    with tempfile.TemporaryDirectory() as scratch:
        release = RELEASES["0.5.23"]
        for rel in release.touched_files:
            os.makedirs(os.path.join(scratch, os.path.dirname(rel)), exist_ok=True)
            shutil.copy(os.path.join(root, rel), os.path.join(scratch, rel))
        for diff in diff_files("0.5.23"):
            if os.path.basename(diff) == STAGING_0523:
                continue
            result = _patch(scratch, diff)
            if result.returncode != 0:
                raise PatchMismatch(f"{os.path.basename(diff)} does not apply:\n{result.stdout}{result.stderr}")
        with open(os.path.join(scratch, HTTP_FILE)) as f:
            before = f.read()
    pending = '        "pending_unloads": dict(tm.pending_lora_unloads),\n'
    after = insert_before(before, pending, "", HTTP_FILE).replace(
        pending, pending + '        "staging": _LORAPUB_STAGING.report(),\n        "stamps": True,\n')
    after = insert_before(after, '@app.api_route("/open_session", methods=["GET", "POST"])\n', HTTP_STAGING_BLOCK,
                          HTTP_FILE)
    return {STAGING_0523: _unified(HTTP_FILE, before, after), **render_prepared_load(root), **render_provenance(root)}


#: The scheduler hook of :mod:`lorapub.sglang_patch.prepared_load`, the same in every release:
#: appended to SGLang's ``scheduler.py``, it runs in every scheduler process that imports it.
SCHEDULER_HOOK = """

# lorapub: adapter loads prepared off the scheduler thread (lorapub/sglang_patch/prepared_load.py)
from lorapub.sglang_patch import prepared_load as _lorapub_prepared_load  # noqa: E402

_lorapub_prepared_load.install(Scheduler)
"""
PREPARED_LOAD = {"0.5.17": "0004-scheduler-prepared-load.diff", "0.5.23": "0005-scheduler-prepared-load.diff"}


def _render_hook(root: str, file: str, hook: str, names: dict[str, str]) -> dict[str, str]:
    """The diff that appends ``hook`` to ``file`` of the release at ``root`` (file name -> text)."""
    version = detect(root).upstream
    with open(os.path.join(root, file)) as f:
        before = f.read()
    return {names[version]: _unified(file, before, before + hook)}


def render_prepared_load(root: str) -> dict[str, str]:
    """The scheduler-hook diff of the release at ``root`` (file name -> text)."""
    from lorapub.sglang_patch.targets import SCHEDULER_FILE

    return _render_hook(root, SCHEDULER_FILE, SCHEDULER_HOOK, PREPARED_LOAD)


#: The stamp hook of :mod:`lorapub.sglang_patch.provenance`, the same in every release: appended to
#: SGLang's ``tokenizer_manager.py``, it wraps ``TokenizerManager._wait_one_response``.
TOKENIZER_HOOK = """

# lorapub: every response that ran with a managed adapter carries a provenance stamp
# (lorapub/sglang_patch/provenance.py)
from lorapub.sglang_patch import provenance as _lorapub_provenance  # noqa: E402

_lorapub_provenance.install(TokenizerManager)
"""
PROVENANCE = {"0.5.17": "0005-tokenizer-manager-provenance.diff", "0.5.23": "0006-tokenizer-manager-provenance.diff"}


def render_provenance(root: str) -> dict[str, str]:
    """The stamp-hook diff of the release at ``root`` (file name -> text)."""
    from lorapub.sglang_patch.targets import TM_FILE

    return _render_hook(root, TM_FILE, TOKENIZER_HOOK, PROVENANCE)


__all__ = [
    "PROVENANCE", "SUPPORTED", "TOKENIZER_HOOK", "already_applied", "apply_diffs", "diff_files", "render_0517",
    "render_0523", "render_prepared_load", "render_provenance",
]
