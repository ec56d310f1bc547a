"""``python -m lorapub.sglang_patch.launch <sglang.launch_server args>``: SGLang with lorapub's patch."""

import runpy


def main() -> None:
    from lorapub import sglang_patch

    sglang_patch.apply()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
