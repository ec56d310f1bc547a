"""ray.exceptions of the stand-in (see ray/__init__.py): the classes AReaL names in except clauses."""

from ray import missing

__getattr__ = missing("ray.exceptions")


class RayError(Exception):
    pass


class RayTaskError(RayError):
    pass


class RayActorError(RayError):
    pass


class ActorDiedError(RayActorError):
    pass


class GetTimeoutError(RayError, TimeoutError):
    pass


class ObjectLostError(RayError):
    pass
