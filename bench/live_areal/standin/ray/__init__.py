"""A stand-in for Ray, packed with AReaL for a machine that lacks Ray (bench/live_areal/pack.sh).

Why: AReaL 1.0.4 imports ray at module level wherever it has a Ray backend: its distributed launcher and
scheduler (areal.infra.launcher.ray, areal.infra.scheduler.ray), placement groups, RPC actors and tensor store
(areal.infra.rpc), and name_resolve's Ray key-value store (areal.utils.name_resolve, reached from
``import areal`` through areal.api.cli_args). The live side-by-side (bench/areal_side_by_side.py --urls) uses
none of them: AReaL's remote SGLang engine, its workflow executor and workflows talk HTTP to running servers,
and name_resolve uses its in-memory backend. The real Ray (about 65 MB, compiled) cannot travel in the pack.

What is here is what those modules touch when they are imported: ``ray.remote`` as a decorator, the classes
named in annotations and isinstance checks, the exceptions named in except clauses, and the submodules
imported by name. Everything that would do Ray's work (init, get, put, wait, kill, an actor's or task's
.remote(), a placement group) raises :class:`StandInError`. ``is_initialized()`` answers False, which is true:
this Ray never starts. A name not here raises :class:`StandInAttributeError` saying so.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+lorapub-stand-in"
STAND_IN = True

_WHY = ("is not available: this `ray` is lorapub's stand-in (bench/live_areal/standin/ray), packed for a "
        "machine without Ray; AReaL's Ray launcher, scheduler and name-resolve backends need the real Ray")


class StandInError(RuntimeError):
    """Ray's work was asked of the stand-in."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} {_WHY}")


class StandInAttributeError(AttributeError):
    """A name the stand-in does not provide (an AttributeError, so hasattr and getattr's default still work)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name} {_WHY}")


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise StandInError(what)
    refused.__name__ = what.rsplit(".", 1)[-1]
    refused.__qualname__ = refused.__name__
    return refused


def missing(module: str) -> Any:
    """A module-level __getattr__ for a stand-in module: a name it lacks says so."""

    def __getattr__(name: str) -> Any:
        raise StandInAttributeError(module, name)
    return __getattr__


__getattr__ = missing("ray")


class ObjectRef:
    """Ray's future; none ever exists here (AReaL's serializer only checks isinstance against it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError("ray.ObjectRef")


class _Remote:
    """What ``@ray.remote`` makes of a class or function: the definition stands (so the module imports),
    starting it as an actor or a task raises."""

    def __init__(self, target: Any, options: dict[str, Any]) -> None:
        self._target, self._options = target, options
        self.__name__ = getattr(target, "__name__", "remote")
        self.__qualname__ = getattr(target, "__qualname__", self.__name__)
        self.__doc__ = getattr(target, "__doc__", None)
        self.__module__ = getattr(target, "__module__", __name__)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInError(f"{self.__qualname__}.remote()")

    def options(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInError(f"{self.__qualname__}.options()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInError(f"calling {self.__qualname__} (a @ray.remote definition)")


def remote(*args: Any, **kwargs: Any) -> Any:
    """``@ray.remote`` and ``@ray.remote(num_cpus=...)``."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return _Remote(args[0], {})
    return lambda target: _Remote(target, kwargs)


def is_initialized() -> bool:
    return False


init = _refuse("ray.init")
shutdown = _refuse("ray.shutdown")
get = _refuse("ray.get")
put = _refuse("ray.put")
wait = _refuse("ray.wait")
kill = _refuse("ray.kill")
cancel = _refuse("ray.cancel")
nodes = _refuse("ray.nodes")
get_actor = _refuse("ray.get_actor")
get_runtime_context = _refuse("ray.get_runtime_context")
cluster_resources = _refuse("ray.cluster_resources")
available_resources = _refuse("ray.available_resources")

from . import actor, exceptions, runtime_env, util  # noqa: E402,F401 - `import ray` gives ray.actor etc., as Ray's does
