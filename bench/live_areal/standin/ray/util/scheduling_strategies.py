"""ray.util.scheduling_strategies of the stand-in (see ray/__init__.py)."""

from typing import Any

from ray import StandInError, missing

__getattr__ = missing("ray.util.scheduling_strategies")


class PlacementGroupSchedulingStrategy:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError("ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy")


class NodeAffinitySchedulingStrategy:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError("ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy")
