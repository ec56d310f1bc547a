"""What a deployment checks before it takes its engines: the engine map, the one transport handed to
every engine, the status endpoint's address. See docs/design.md, "Runtime wiring".
"""

from __future__ import annotations

from typing import Mapping

from lorapub.core.identity import check_id
from lorapub.errors import InvalidInput
from lorapub.ports import EngineAdmin, OverwriteAdmin, TakesTransport, Transport

__all__ = ["check_engines", "hand_transport", "check_status_address", "transport_name"]


def check_engines(engines: object) -> dict[str, EngineAdmin]:
    if not isinstance(engines, Mapping) or not engines:
        raise InvalidInput("engines must be a non-empty mapping of engine name -> engine adapter")
    for key, engine in engines.items():
        check_id("engine name", key)  # it names stash folders, routes and log fields
        name = getattr(engine, "name", None)
        if name != key:
            raise InvalidInput(
                f"engine map key {key!r} differs from the adapter's name {name!r}; the registry addresses "
                "engines by name, so they must match"
            )
        if not isinstance(engine, EngineAdmin):
            missing = [m for m in ("incarnation", "begin", "receive_bucket", "end", "cleanup", "reclaim", "generate")
                       if not callable(getattr(engine, m, None))]
            hint = (" — it is an engine of the switched-off path (OverwriteAdmin): with enabled=True pass "
                    "lorapub.adapters.sglang_wire.SGLangWireEngine adapters"
                    if isinstance(engine, OverwriteAdmin) else "")
            raise InvalidInput(
                f"engine {key!r} ({type(engine).__name__}) is not a lorapub.ports.EngineAdmin: it lacks "
                f"{', '.join(missing)}{hint}"
            )
    return dict(engines)


def hand_transport(engines: Mapping[str, EngineAdmin], transport: object) -> Transport | None:
    """The deployment's transport, handed to every engine that takes one (None: engines that take
    none, which are sent safetensors bytes). Without ``transport``, the one the engines already
    send with (their default, or one an earlier deployment gave them): they must agree."""
    takers = {name: e for name, e in engines.items() if isinstance(e, TakesTransport)}
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
    for engine in takers.values():
        engine.use_transport(transport)  # one given another transport earlier refuses, naming itself
    return transport


def check_status_address(status: object) -> tuple[str, int] | None:
    if status is None:
        return None
    if (not isinstance(status, tuple) or len(status) != 2 or not isinstance(status[0], str)
            or not isinstance(status[1], int) or isinstance(status[1], bool) or not 0 <= status[1] < 65536):
        raise InvalidInput(f"status must be (host, port), e.g. ('127.0.0.1', 9464) (port 0: any free one), got {status!r}")
    return status


def transport_name(transport: Transport | None) -> str:
    return "inline" if transport is None else type(transport).__name__
