"""``python -m lorapub.sglang_patch check|apply|verify|launch``.

    check  [--root DIR]   the release found and whether its diffs apply (touches nothing)
    apply  [--root DIR]   apply the diffs in place (all or nothing)
    verify [--root DIR]   only name the supported release found (fingerprints)
    launch ARGS...        run sglang.launch_server ARGS with the runtime form applied
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":
        sys.argv = [sys.argv[0]] + argv[1:]
        from lorapub.sglang_patch.launch import main as launch

        launch()
        return 0
    from lorapub.sglang_patch import PatchMismatch, diffs, verify

    parser = argparse.ArgumentParser(prog="python -m lorapub.sglang_patch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "apply", "verify"])
    parser.add_argument("--root", help="the sglang package folder (default: the installed one)")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            print(f"SGLang {verify(args.root)}: supported")
        else:
            print(diffs.apply_diffs(args.root, check_only=args.command == "check"))
    except PatchMismatch as e:
        print(f"lorapub.sglang_patch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
