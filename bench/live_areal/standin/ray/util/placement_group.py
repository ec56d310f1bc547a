"""ray.util.placement_group of the stand-in (see ray/__init__.py)."""

from typing import Any

from ray import StandInError, _refuse, missing

__getattr__ = missing("ray.util.placement_group")


class PlacementGroup:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError("ray.util.placement_group.PlacementGroup")


placement_group = _refuse("ray.util.placement_group.placement_group")
remove_placement_group = _refuse("ray.util.placement_group.remove_placement_group")
get_current_placement_group = _refuse("ray.util.placement_group.get_current_placement_group")
