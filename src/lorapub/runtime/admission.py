"""What a deployment checks before it takes its engines: the engine map, the one transport handed to
every engine, the status endpoint's address. See docs/design.md, "Runtime wiring".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import types
import warnings
from typing import Any, Awaitable, Callable, Mapping, ParamSpec, Protocol, TypeVar, runtime_checkable

from lorapub._moved import moved
from lorapub.core.attempt import ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, check_id
from lorapub.wire.routes import MANAGED_PREFIX_ENV
from lorapub.core.registry import Fleet
from lorapub.errors import EngineCapacityError, EngineError, InvalidInput, OutcomeUnknown
from lorapub.ports import (
    ChecksTransport,
    Closes,
    EndTimings,
    EngineAdmin,
    EngineLimits,
    Inventory,
    OverwriteAdmin,
    Releases,
    ReportsEndTimings,
    ReportsInventory,
    ReportsLimits,
    TakesTransport,
    Transport,
)

__all__ = ["check_engines", "check_operations", "with_lifecycle", "release_adapter", "close_adapter", "hand_transport", "check_status_address", "transport_name", "check_limits",
           "check_protects", "answer_within", "refuse_moved_options"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_P = ParamSpec("_P")


#: Deployment keywords that were removed, and what replaced each.
_MOVED_OPTIONS = {
    "stash_dir": "the publisher-side stash was retired: engines stage inside themselves, and the bytes travel "
                 "the transport named once on the deployment: Deployment(engines, transport=HTTPBytes() | "
                 "SameHostIPC() | SharedDir(path)) (deploy(stash_dir=) stays, for the overwrite path, enabled=False)",
}


def refuse_moved_options(init: Callable[_P, None]) -> Callable[_P, None]:
    """``Deployment.__init__``, where a removed keyword is INVALID_INPUT naming its replacement (any
    other unknown keyword stays Python's own TypeError). Its signature is the one inspected."""

    @functools.wraps(init)
    def checked(*args: _P.args, **options: _P.kwargs) -> None:
        for name in options:
            if name in _MOVED_OPTIONS:
                raise InvalidInput(f"Deployment({name}=) was removed: {_MOVED_OPTIONS[name]}")
        init(*args, **options)

    return checked


def _declares(obj: object, name: str) -> bool:
    """``obj`` (its class or itself) sets ``name``: not an attribute a mock makes up when asked."""
    return inspect.getattr_static(obj, name, None) is not None


@runtime_checkable
class _Named(Protocol):
    """An adapter that gives itself a name (checked: it names stash folders, routes and log fields)."""

    name: object


@runtime_checkable
class _Operations(Protocol):
    """An adapter :func:`check_operations` admits: EngineAdmin without its lifecycle (``close``, ``release``)."""

    name: str

    async def incarnation(self) -> str: ...
    async def begin(self, request: SendBegin) -> str: ...
    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str: ...
    async def end(self, token: AttemptToken) -> ReadyLocal: ...
    async def cleanup(self, token: AttemptToken, lora_name: str) -> str: ...
    async def reclaim(self, lora_name: str, reclaim_id: str) -> None: ...
    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]: ...


def _doing(operation: str) -> type:
    """A runtime-checkable protocol of one of :class:`_Operations`' operations alone."""
    return runtime_checkable(types.new_class(f"_Does_{operation}", (Protocol,),
                                             exec_body=lambda ns: ns.update({operation: vars(_Operations)[operation]})))


#: What every engine adapter does (EngineAdmin without its lifecycle, which older adapters lack), one
#: protocol each: an adapter refused names each it lacks.
_OPERATIONS = {operation: _doing(operation)
               for operation in ("incarnation", "begin", "receive_bucket", "end", "cleanup", "reclaim", "generate")}


class _Lifecycle:
    """An engine adapter written before :class:`~lorapub.ports.EngineAdmin` declared ``close()`` and
    ``release()``, as the deployment holds it: every call goes to the adapter, and the lifecycle method
    it lacks is a no-op (one it has is its own). Made once, when the engine is admitted; what the
    runtime holds then is an EngineAdmin, called directly. The embedder's own reads of anything else
    pass through to its adapter; the runtime reads nothing that way (it asks by type)."""

    def __init__(self, inner: _Operations) -> None:
        self.inner = inner
        self.name: str = inner.name

    def __repr__(self) -> str:
        return repr(self.inner)

    def __getattr__(self, name: str) -> object:  # the embedder's own reads of its adapter: a pass-through
        if name == "inner":  # not set yet (a copy being made): never looked up on itself
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def incarnation(self) -> str:
        return await self.inner.incarnation()

    async def begin(self, request: SendBegin) -> str:
        return await self.inner.begin(request)

    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        return await self.inner.receive_bucket(token, index, payload)

    async def end(self, token: AttemptToken) -> ReadyLocal:
        return await self.inner.end(token)

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        return await self.inner.cleanup(token, lora_name)

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        return await self.inner.reclaim(lora_name, reclaim_id)

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]:
        return await self.inner.generate(payload)

    async def close(self) -> None:
        if isinstance(self.inner, Closes):
            await self.inner.close()

    async def release(self) -> None:
        if isinstance(self.inner, Releases):
            await self.inner.release()


async def _inventory(self: _Lifecycle) -> Inventory:
    assert isinstance(self.inner, ReportsInventory)
    return await self.inner.inventory()


async def _limits(self: _Lifecycle) -> EngineLimits:
    assert isinstance(self.inner, ReportsLimits)
    return await self.inner.limits()


def _end_timings(self: _Lifecycle, token: AttemptToken) -> EndTimings | None:
    assert isinstance(self.inner, ReportsEndTimings)
    return self.inner.end_timings(token)


def _transport(self: _Lifecycle) -> Transport:
    assert isinstance(self.inner, TakesTransport)
    return self.inner.transport


def _use_transport(self: _Lifecycle, transport: Transport) -> None:
    assert isinstance(self.inner, TakesTransport)
    self.inner.use_transport(transport)


def _can_use_transport(self: _Lifecycle, transport: Transport) -> bool:
    assert isinstance(self.inner, ChecksTransport)
    return self.inner.can_use_transport(transport)


#: The optional protocols an adapter admitted without its lifecycle keeps, and their members: its
#: wrapper has each protocol's only where the adapter is one, so that ``isinstance`` on those
#: protocols answers of the wrapper as of the adapter.
_OPTIONAL: dict[type, dict[str, object]] = {
    ReportsInventory: {"inventory": _inventory},
    ReportsLimits: {"limits": _limits},
    ReportsEndTimings: {"end_timings": _end_timings},
    TakesTransport: {"transport": property(_transport), "use_transport": _use_transport},
    ChecksTransport: {"can_use_transport": _can_use_transport},
}


@functools.cache
def _lifecycle_class(protocols: frozenset[type]) -> type[_Lifecycle]:
    """:class:`_Lifecycle` with the members of exactly ``protocols`` of the optional ones (forwarded)."""
    namespace = {name: member for protocol in protocols for name, member in _OPTIONAL[protocol].items()}
    return type("_Lifecycle", (_Lifecycle,), namespace) if namespace else _Lifecycle


def with_lifecycle(engine: object, known: object = None) -> EngineAdmin:
    """``engine`` as the runtime holds it: itself where it is an :class:`~lorapub.ports.EngineAdmin`,
    else (an adapter without ``close()``/``release()``) wrapped once in :class:`_Lifecycle` — or
    ``known``, where that is already this adapter's wrapper (the same adapter added again)."""
    if isinstance(engine, EngineAdmin):
        return engine
    if isinstance(known, _Lifecycle) and known.inner is engine:
        return known
    assert isinstance(engine, _Operations), "with_lifecycle follows check_operations"
    return _lifecycle_class(frozenset(p for p in _OPTIONAL if isinstance(engine, p)))(engine)


def check_operations(key: object, engine: object) -> None:
    """``engine`` does every EngineAdmin operation (its lifecycle may be missing: supplied), else
    INVALID_INPUT naming what it lacks."""
    if isinstance(engine, EngineAdmin):
        return
    missing = [operation for operation, doing in _OPERATIONS.items() if not isinstance(engine, doing)]
    if not missing:
        return
    hint = (" — it is an engine of the switched-off path (OverwriteAdmin): with enabled=True pass "
            "lorapub.adapters.sglang_wire.SGLangWireEngine adapters"
            if isinstance(engine, OverwriteAdmin) else "")
    raise InvalidInput(
        f"engine {key!r} ({type(engine).__name__}) is not a lorapub.ports.EngineAdmin: it lacks "
        f"{', '.join(missing)}{hint}"
    )


def name_of(offered: object) -> str:
    """The name an adapter offered alone (``add_engine``) gives itself, checked: it names stash folders,
    routes and log fields."""
    name = offered.name if isinstance(offered, _Named) else None
    check_id("engine name", name)
    assert isinstance(name, str)
    return name


def check_engines(engines: object) -> dict[str, EngineAdmin]:
    """The deployment's engine map, checked; an adapter without ``close()``/``release()`` is admitted
    with no-ops for them (:func:`with_lifecycle`)."""
    if not isinstance(engines, Mapping) or not engines:
        raise InvalidInput("engines must be a non-empty mapping of engine name -> engine adapter")
    for key, engine in engines.items():
        check_id("engine name", key)  # it names stash folders, routes and log fields
        name = engine.name if isinstance(engine, _Named) else None
        if name != key:
            raise InvalidInput(
                f"engine map key {key!r} differs from the adapter's name {name!r}; the registry addresses "
                "engines by name, so they must match"
            )
        if _declares(engine, "bucket_source_factory"):
            # the per-engine hook lorapub read before the Transport: ignoring it would send the bytes another way
            raise InvalidInput(
                f"engine {key!r} ({type(engine).__name__}) declares bucket_source_factory, which lorapub no longer "
                "reads: name how buckets travel once, as a lorapub.ports.Transport on the deployment "
                "(Deployment(engines, transport=...)), and make the engine a lorapub.ports.TakesTransport "
                "(transport, use_transport) that posts each bucket the Transport's bucket_request way"
            )
        check_operations(key, engine)
    return {key: with_lifecycle(engine) for key, engine in engines.items()}


def hand_transport(engines: Mapping[str, EngineAdmin], transport: object) -> Transport | None:
    """The deployment's transport, handed to every engine that takes one (None: engines that take
    none, which are sent safetensors bytes). Without ``transport``, the one the engines already
    send with (their default, or one an earlier deployment gave them): they must agree."""
    takers = {name: e for name, e in engines.items() if isinstance(e, TakesTransport)}
    if transport is not None and _declares(transport, "stateless"):
        warnings.warn(f"transport {type(transport).__name__} sets `stateless`, which lorapub no longer reads: "
                      "transports are compared with their own __eq__ (define it to let equal transports merge; "
                      "without it a transport equals only itself)", DeprecationWarning, stacklevel=3)
    if transport is not None and not isinstance(transport, Transport):
        raise InvalidInput(f"transport must be a lorapub.ports.Transport (e.g. lorapub.adapters.sglang_wire.HTTPBytes()), "
                           f"got {type(transport).__name__}")
    if not takers:
        if transport is not None:
            raise InvalidInput(f"transport={transport!r} was given, but no engine takes a transport "
                               f"({', '.join(sorted(engines))}: not lorapub.ports.TakesTransport)")
        return None
    if len(takers) != len(engines):
        raise InvalidInput("every engine of a deployment receives buckets one way: "
                           f"{', '.join(sorted(takers))} take a transport, {', '.join(sorted(set(engines) - set(takers)))} "
                           "do not")
    if transport is None:
        first = min(takers)
        transport = takers[first].transport
        for name, engine in sorted(takers.items()):
            if engine.transport != transport:
                raise InvalidInput(f"engines {first} and {name} send buckets different ways ({transport!r}, "
                                   f"{engine.transport!r}); name the transport once: Deployment(engines, transport=...)")
    # Every engine is asked before any is handed the transport: one given another earlier (by another
    # deployment) refuses here, and no engine of this failed deployment is left holding it.
    for name, engine in sorted(takers.items()):
        if isinstance(engine, ChecksTransport) and not engine.can_use_transport(transport):  # optional
            raise InvalidInput(f"engine {name} already sends buckets {engine.transport!r}; it cannot also send them "
                               f"{transport!r} (one transport per engine adapter: build another for this deployment)")
    for engine in takers.values():
        engine.use_transport(transport)  # an engine without can_use_transport may still refuse, naming itself
    return transport


def check_status_address(status: object) -> tuple[str, int] | None:
    if status is None:
        return None
    if (not isinstance(status, tuple) or len(status) != 2 or not isinstance(status[0], str)
            or not isinstance(status[1], int) or isinstance(status[1], bool) or not 0 <= status[1] < 65536):
        raise InvalidInput(f"status must be (host, port), e.g. ('127.0.0.1', 9464) (port 0: any free one), got {status!r}")
    return status


def transport_name(transport: Transport | None) -> str:
    """How bucket bytes travel, as events and metrics label it: the ``kind`` a transport's begin names
    to the engine (``http``, ``shm``, ``torch``: the engine's own series say the same); ``inline``:
    handed to in-process engines."""
    return "inline" if transport is None else str(getattr(transport, "kind", None) or type(transport).__name__)


async def answer_within(name: str, what: str, deadline: float, call: Awaitable[_T]) -> _T:
    """An engine's answer within ``deadline``: none is OUTCOME_UNKNOWN naming the engine."""
    try:
        async with asyncio.timeout(deadline):
            return await call
    except TimeoutError:
        raise OutcomeUnknown(f"engine {name} did not say {what} within {deadline:g}s; try again once it answers",
                             engine=name) from None


async def check_limits(name: str, engine: EngineAdmin, capacity: int, deadline: float,
                       max_lag: int | None = None) -> None:
    """Engine ``name`` must hold ``capacity`` pinned managed versions at once (EngineCapacityError naming it).
    The message suggests a lower capacity only where one is still allowed (2 or more, and max_lag + 2 or more)."""
    if not isinstance(engine, ReportsLimits):
        log.info("engine %s does not report its LoRA limits; capacity %d is not checked there", name, capacity)
        return
    limits = await answer_within(name, "its LoRA limits", deadline, engine.limits())
    holds = limits.managed_capacity()
    if holds is not None and holds < capacity:
        raise EngineCapacityError(
            f"engine {name} holds at most {holds} pinned managed versions (max_loaded_loras="
            f"{limits.max_loaded_loras}, max_loras_per_batch={limits.max_loras_per_batch}: SGLang keeps one "
            f"batch slot unpinned), fewer than capacity={capacity}; start it with --max-loras-per-batch "
            f"{capacity + 1} --max-loaded-loras {capacity + 1} (or more)" + _lower(holds, max_lag),
            engine=name, limits=limits, capacity=capacity,
        )


async def release_adapter(name: str, engine: EngineAdmin) -> None:
    """Close the connections an adapter lorapub owns has open, keeping it usable (its ``release()``:
    an adapter refused at admission must leak nothing, yet may be offered again)."""
    try:
        await engine.release()
    except Exception as e:  # noqa: BLE001 - best effort: the refusal is what the caller must see
        log.warning("releasing engine %s: %s", name, e)


async def close_adapter(name: str, engine: EngineAdmin, what: str = "closing engine") -> None:
    """End an adapter's connections for good (its ``close()``), best effort: a failure is logged."""
    try:
        await engine.close()
    except Exception as e:  # noqa: BLE001 - closing is best effort: the rest still closes
        log.warning("%s %s: %s", what, name, e)


def _lower(holds: int, max_lag: int | None) -> str:
    """The other way out, where there is one: the capacity this engine holds, if lorapub allows it."""
    if holds < 2:
        return " (capacity 2 is the least lorapub runs with)"
    if max_lag is None or holds >= max_lag + 2:
        return f", or lower capacity to {holds}"
    return f", or lower capacity and max_lag together (capacity {holds} serves max_lag={holds - 2} at most)"


async def check_admission(name: str, engine: EngineAdmin, fleet: Fleet, deadline: float) -> None:
    """What an engine must pass to serve the deployment whose registry said ``fleet``: room for its
    capacity (at its max_lag) and the same protected name prefix."""
    await check_limits(name, engine, fleet.capacity, deadline, fleet.max_lag)
    await check_protects(name, engine, fleet.name_prefix, deadline)


async def check_protects(name: str, engine: EngineAdmin, prefix: str, deadline: float) -> None:
    """An engine that says which names it protects must protect the deployment's: one launched for
    another prefix would let its versions be unloaded, overwritten or reloaded."""
    if not isinstance(engine, ReportsInventory):
        return
    try:
        protected = (await answer_within(name, "its inventory", deadline, engine.inventory())).managed_prefix
    except EngineError as e:
        if e.details.get("status") not in (401, 403):
            raise
        # A rollout worker holds only the API key (docs/embedding.md) and the inventory is an admin
        # route: the check is the publisher's, whose deployment holds the admin key and runs it.
        log.info("engine %s: its managed-adapter prefix is not checked here: its inventory needs the admin key, "
                 "which this adapter does not hold (a worker with api_key= only); the deployment that publishes, "
                 "holding the admin key, checks it", name)
        return
    if protected is not None and protected != prefix:
        raise EngineError(
            f"engine {name} protects adapters named {protected!r}…, but this deployment names its versions "
            f"{prefix!r}…: launch it with {MANAGED_PREFIX_ENV}={prefix} (or give the deployment "
            f"name_prefix={protected!r})", engine=name,
        )


#: check_epoch checks a deployment's epoch beside the keys the epoch numbers (the registry in this
#: process checks it too, beneath the runtime).
__getattr__ = moved(__name__, {"check_epoch": "lorapub.core.identity"})
