"""A deployment's settings as one validated, immutable value: what ``Deployment(...)``'s keyword options
build, or what a caller passes whole (``Deployment(engines, settings=DeploymentSettings(epoch=7, ...))``).
A bad value is INVALID_INPUT naming the option and what to pass instead, as the keywords always said.
See docs/operating.md, "Settings".
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, TypedDict, cast

import attrs

from lorapub.core.identity import check_epoch, check_name_prefix
from lorapub.core.registry import (
    DEFAULT_CAPACITY,
    DEFAULT_LEASE_TTL,
    DEFAULT_TOMBSTONE_WINDOW,
    check_capacity,
    check_max_lag,
    check_room_for_lag,
)
from lorapub.errors import InvalidInput
from lorapub.events import Observer
from lorapub.ports import Clock, CopyStore, Registry, Routing, Transport
from lorapub.runtime.admission import check_status_address
from lorapub.runtime.runner import Deadlines
from lorapub.runtime.sessions import DEFAULT_IDLE_TTL
from lorapub.runtime.status import check_bind
from lorapub.snapshot import DEFAULT_BUCKET_CAP

__all__ = ["DeploymentSettings", "DeploymentOptions", "check_copies"]


def _epoch(_: object, __: attrs.Attribute[Any], value: object) -> None:
    check_epoch(value)


def _capacity(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_capacity(value)


def _on_stale(settings: DeploymentSettings, _: attrs.Attribute[Any], value: object) -> None:
    check_max_lag(settings.max_lag, value)  # max_lag with it: the one rule for on_stale's default
    if settings.capacity is not None:  # without one, the registry's capacity decides (Deployment checks it)
        check_room_for_lag(settings.capacity, settings.max_lag)


def _name_prefix(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        check_name_prefix(value)


def _flag(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInput(f"{attribute.name} must be True or False, got {value!r}")


def _seconds(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
        raise InvalidInput(f"{attribute.name} must be a positive number of seconds or None, got {value!r}")


def _bucket_cap(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or value < 1:
        raise InvalidInput(f"bucket_cap_bytes must be a positive int, got {value!r}")


def _deadlines_or_default(value: object) -> object:
    return Deadlines() if value is None else value


def _deadlines(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Deadlines):
        raise InvalidInput(f"deadlines must be a lorapub.Deadlines (e.g. Deadlines(begin=30, end=120)) or None, "
                           f"got {type(value).__name__} {value!r:.60}")


def _reclaim_retries(_: object, __: attrs.Attribute[Any], value: object) -> None:
    # named here: the reclaimer's RetryPolicy would name its own fields, not these arguments
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"reclaim_retries must be an int >= 0 (retries of a failed reclaim), got {value!r}")


def _reclaim_backoff(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
        raise InvalidInput(f"reclaim_backoff must be a finite number of seconds >= 0, got {value!r}")


def _status(_: object, __: attrs.Attribute[Any], value: object) -> None:
    check_status_address(value)


def _status_token(settings: DeploymentSettings, _: attrs.Attribute[Any], value: object) -> None:
    if settings.status is not None:
        check_bind(settings.status[0], cast(Any, value))  # a token of another type is refused there


def check_copies(copies: object) -> None:
    if copies is not None and not all(callable(getattr(copies, m, None)) for m in ("keep", "retain", "items")):
        raise InvalidInput(f"copies must be a lorapub.ports.CopyStore (keep, retain and items), got "
                           f"{type(copies).__name__}")


@attrs.frozen(kw_only=True)
class DeploymentSettings:
    """Every plain-valued option of :class:`~lorapub.Deployment` (what each means: its docstring), checked
    when made; the collaborators (engines, registry, transport, router, observers, clock, copies) stay
    ``Deployment``'s own arguments. ``attrs.evolve(settings, capacity=4)`` gives a changed copy, checked
    again. Only ``epoch`` has no default."""

    epoch: int = attrs.field(validator=_epoch)
    capacity: int | None = attrs.field(default=None, validator=_capacity)
    max_lag: int | None = None  # checked with on_stale
    on_stale: str | None = attrs.field(default=None, validator=_on_stale)  # as asked (None: the rule's default)
    name_prefix: str | None = attrs.field(default=None, validator=_name_prefix)
    avoid_suspect: bool = attrs.field(default=False, validator=_flag)
    reconcile_interval: float | None = attrs.field(default=5.0, validator=_seconds)
    lease_ttl: float | None = attrs.field(default=DEFAULT_LEASE_TTL, validator=_seconds)
    canary_interval: float | None = attrs.field(default=None, validator=_seconds)
    stale_attempt_after: float | None = attrs.field(default=None, validator=_seconds)
    idle_ttl: float | None = attrs.field(default=DEFAULT_IDLE_TTL, validator=_seconds)
    bucket_cap_bytes: int = attrs.field(default=DEFAULT_BUCKET_CAP, validator=_bucket_cap)
    deadlines: Deadlines = attrs.field(factory=Deadlines, converter=_deadlines_or_default, validator=_deadlines)
    reclaim_retries: int = attrs.field(default=5, validator=_reclaim_retries)
    reclaim_backoff: float = attrs.field(default=1.0, validator=_reclaim_backoff)
    status: tuple[str, int] | None = attrs.field(default=None, validator=_status)
    status_token: str | None = attrs.field(default=None, validator=_status_token, repr=False)
    tombstone_window: float | None = DEFAULT_TOMBSTONE_WINDOW
    auto_reclaim: bool = True
    own_engines: bool = True
    decision_log: bool = True

    @property
    def stale_rule(self) -> str:
        """The ``on_stale`` that applies: as asked, else ``"rebind"`` with ``max_lag`` set, ``"error"`` without."""
        return check_max_lag(self.max_lag, self.on_stale)

    def check_room(self, shared_registry: bool) -> None:
        """``max_lag`` against the default capacity, where this deployment makes its registry without
        a capacity asked (a shared registry was checked where it was made)."""
        if self.capacity is None and not shared_registry:
            check_room_for_lag(DEFAULT_CAPACITY, self.max_lag)

    @classmethod
    def of(cls, settings: object, options: Mapping[str, Any]) -> DeploymentSettings:
        """What ``Deployment(...)`` was given: ``settings=`` whole (its keyword options then left at
        their defaults), or the keyword options, built into a value here."""
        if settings is None:
            return cls(**options)  # epoch= left out is refused as epoch=None is, saying what it is for
        if not isinstance(settings, cls):
            raise InvalidInput(f"settings must be a lorapub.DeploymentSettings, got {type(settings).__name__}")
        # the keywords' own defaults: those of the fields, but epoch's and deadlines' (None)
        defaults: dict[str, object] = {a.name: a.default for a in attrs.fields(cls)}
        defaults.update(epoch=None, deadlines=None)
        beside = sorted(name for name, value in options.items()  # one equal to the settings' own is no clash
                        if value != defaults.get(name) and value != getattr(settings, name))
        if beside:
            raise InvalidInput(f"settings= was given with {', '.join(f'{n}=' for n in beside)} beside it: set "
                               f"{'them' if len(beside) > 1 else 'it'} in the settings (attrs.evolve(settings, "
                               f"{beside[0]}=...)) or leave settings= out")
        return settings


class DeploymentOptions(TypedDict, total=False):
    """The keyword options of :class:`Deployment` that :func:`deploy` passes on (besides ``epoch``
    and ``stash_dir``)."""

    registry: Registry | None
    auto_reclaim: bool
    deadlines: Deadlines | None
    bucket_cap_bytes: int
    reclaim_retries: int
    reclaim_backoff: float
    lease_ttl: float | None
    tombstone_window: float | None
    reconcile_interval: float | None
    stale_attempt_after: float | None
    router: Routing | None
    capacity: int | None
    max_lag: int | None
    on_stale: str | None
    idle_ttl: float | None
    own_engines: bool
    name_prefix: str | None
    transport: Transport | None
    observers: Iterable[Observer]
    decision_log: bool
    status: tuple[str, int] | None
    status_token: str | None
    canary_interval: float | None
    avoid_suspect: bool
    clock: Clock | None
    copies: CopyStore | None
    settings: DeploymentSettings | None
