"""Test-only: ``LORAPUB_TEST_SCALE_TENSOR="<substring>=<factor>"`` scales one tensor of a ``dir`` load after
its bytes were verified, so the numeric READY gate can be shown to refuse it. Never set it in production.
See docs/provenance.md, "Numeric READY gate".
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["SCALE_ENV", "scale_for_test", "switch_from_env"]

SCALE_ENV = "LORAPUB_TEST_SCALE_TENSOR"


def scale_for_test(path: str) -> str | None:
    """Scale the first tensor (by name) whose name holds the substring, in ``path``'s
    adapter_model.safetensors; the tensor's name, or None when the switch is off or names none."""
    value = os.environ.get(SCALE_ENV)
    if not value or "=" not in value:
        return None
    substring, factor = value.rsplit("=", 1)
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    for name in sorted(tensors):
        if substring in name:
            tensors[name] = (tensors[name].double() * float(factor)).to(tensors[name].dtype)
            save_file(tensors, file)
            return name
    return None


def switch_from_env() -> "Callable[[str], object] | None":
    """The hook :class:`~lorapub.sglang_patch.staging.EngineStaging` takes as ``before_dir_load``: this switch
    where its variable is set (a test's server or double), else None (production: nothing runs)."""
    return scale_for_test if os.environ.get(SCALE_ENV) else None
