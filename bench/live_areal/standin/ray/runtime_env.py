"""ray.runtime_env of the stand-in (see ray/__init__.py)."""

from typing import Any

from ray import StandInError, missing

__getattr__ = missing("ray.runtime_env")


class RuntimeEnv(dict):  # Ray's is a dict too
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError("ray.runtime_env.RuntimeEnv")
