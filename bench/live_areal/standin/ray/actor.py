"""ray.actor of the stand-in (see ray/__init__.py)."""

from typing import Any

from ray import StandInError, _refuse, missing

__getattr__ = missing("ray.actor")


class ActorHandle:
    """Named in AReaL's annotations; none ever exists here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError("ray.actor.ActorHandle")


exit_actor = _refuse("ray.actor.exit_actor")
