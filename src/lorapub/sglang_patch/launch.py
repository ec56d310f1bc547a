"""``python -m lorapub.sglang_patch launch <sglang.launch_server args>``: SGLang with lorapub's patch.

``LORAPUB_SGLANG_PATCH=observe`` adds only the read-only ``/lorapub/state`` route to an
otherwise unpatched server (to measure what SGLang does without the patch).
"""

import os
import runpy


def main() -> None:
    from lorapub.core.identity import MANAGED_PREFIX, check_name_prefix
    from lorapub.wire.routes import MANAGED_PREFIX_ENV
    from lorapub.sglang_patch import apply, verify
    from lorapub.sglang_patch.routes import add_state_route

    if os.environ.get("LORAPUB_SGLANG_PATCH", "apply") == "observe":
        add_state_route(None, verify(), form="observe")
    else:  # the names it protects: as the diff form, from SGLANG_LORAPUB_MANAGED_PREFIX
        apply(managed_prefix=check_name_prefix(os.environ.get(MANAGED_PREFIX_ENV, MANAGED_PREFIX)))
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
