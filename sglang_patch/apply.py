#!/usr/bin/env python3
"""Apply (or check) lorapub's SGLang patches to an SGLang 0.5.23 installation.

    python sglang_patch/apply.py --check      # dry run: do they apply cleanly?
    python sglang_patch/apply.py              # apply in place
    python sglang_patch/apply.py --root DIR   # DIR is the `sglang` package folder

It refuses code other than 0.5.23 (fingerprints of every patched function)
and detects an installation that is already patched.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PATCHES = sorted(glob.glob(os.path.join(HERE, "patches", "*.diff")))
TOUCHED = ["srt/managers/tokenizer_manager.py", "srt/managers/tokenizer_control_mixin.py", "srt/entrypoints/http_server.py"]
MARKER = ("srt/managers/tokenizer_control_mixin.py", "LORAPUB_MANAGED_PREFIX")


def _patch(parent: str, diff: str, dry: bool) -> subprocess.CompletedProcess:
    args = ["patch", "-p1", "--forward", "--batch", "-d", parent] + (["--dry-run"] if dry else [])
    with open(diff) as f:
        return subprocess.run(args, stdin=f, capture_output=True, text=True)


def already_applied(root: str) -> bool:
    with open(os.path.join(root, MARKER[0])) as f:
        return MARKER[1] in f.read()


def main(argv=None) -> int:
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    from lorapub import sglang_patch

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", help="the sglang package folder (default: the installed one)")
    parser.add_argument("--check", action="store_true", help="only check that the patches apply")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root or sglang_patch.sglang_root())
    if already_applied(root):
        print(f"{root}: lorapub's patches are already applied")
        return 0
    sglang_patch.verify(root)  # raises PatchMismatch on other code
    # Apply the whole series to a scratch copy first: the installation is touched only if all apply.
    with tempfile.TemporaryDirectory() as scratch:
        for rel in TOUCHED:
            os.makedirs(os.path.join(scratch, "sglang", os.path.dirname(rel)), exist_ok=True)
            shutil.copy(os.path.join(root, rel), os.path.join(scratch, "sglang", rel))
        for diff in PATCHES:
            result = _patch(scratch, diff, dry=False)
            if result.returncode != 0:
                print(f"{os.path.basename(diff)} does not apply:\n{result.stdout}{result.stderr}", file=sys.stderr)
                return 1
    if args.check:
        print(f"{root}: SGLang {sglang_patch.SGLANG_VERSION} verified; {len(PATCHES)} patches apply")
        return 0
    parent = os.path.dirname(root)
    for diff in PATCHES:
        result = _patch(parent, diff, dry=False)
        if result.returncode != 0:
            print(f"{os.path.basename(diff)} failed:\n{result.stdout}{result.stderr}", file=sys.stderr)
            return 1
        print(f"applied {os.path.basename(diff)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
