"""Moved to :mod:`lorapub.snapshot` (beside the ports, so adapters need not import the runtime).
This old path stays importable: it is that very module.
"""

from __future__ import annotations

import sys

from lorapub import snapshot as _moved

__all__ = _moved.__all__
sys.modules[__name__] = _moved  # the same module object: every name, the private ones too, and patches
