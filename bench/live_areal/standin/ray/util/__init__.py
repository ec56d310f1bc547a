"""ray.util of the stand-in (see ray/__init__.py)."""

from ray import missing

__getattr__ = missing("ray.util")

from . import placement_group, scheduling_strategies  # noqa: E402,F401
