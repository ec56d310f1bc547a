"""Moved to :mod:`lorapub.core.staging.machine` (the staging machine is pure: it belongs to the core).
This old path stays importable: it is that very module.
"""

from __future__ import annotations

import sys

from lorapub.core.staging import machine as _moved

sys.modules[__name__] = _moved
