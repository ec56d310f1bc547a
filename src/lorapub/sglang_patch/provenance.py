"""Engine-attested provenance: every response that ran with a managed adapter carries a stamp in
``meta_info["lorapub"]`` (name, digest, engine, incarnation, native ``lora_id``). Both forms of the
patch wrap ``TokenizerManager._wait_one_response`` with :func:`install`; the digest is what the
engine-side staging actually loaded under that name. See docs/provenance.md, "Stamp".
"""

from __future__ import annotations

import inspect
import os
from typing import Any, AsyncIterator, Mapping

from lorapub.core.identity import MANAGED_PREFIX
from lorapub.sglang_patch.staging import server as _server
from lorapub.sglang_patch.staging import swap

__all__ = [
    "ENGINE_NAME_ENV", "STAMP_KEY", "SWAP_ENV", "engine_name", "install", "stamp", "stamp_output"]

#: The key of ``meta_info`` that carries the stamp.
STAMP_KEY = "lorapub"
#: The engine's own name in its stamps (default: ``host:port`` of the server).
ENGINE_NAME_ENV = "LORAPUB_ENGINE_NAME"
#: TEST-ONLY: the staging loads a new version with the previous version's weights (and records that
#: version's digest, as it really loaded it). Never set it outside tests.
SWAP_ENV = swap.SWAP_ENV

def engine_name(tm: Any = None) -> str:
    name = os.environ.get(ENGINE_NAME_ENV)
    if name:
        return name
    args = getattr(tm, "server_args", None)
    if args is not None and getattr(args, "port", None) is not None:
        return f"{getattr(args, 'host', '') or 'localhost'}:{args.port}"
    return f"pid-{os.getpid()}"


def stamp(lora_name: object, lora_id: object, staging: Any, engine: str,
          prefix: str = MANAGED_PREFIX) -> dict[str, Any] | None:
    """The stamp of one response that ran with ``lora_name`` (None: not a managed adapter)."""
    if not (isinstance(lora_name, str) and prefix and lora_name.startswith(prefix)) or lora_id is None:
        return None
    digests: Mapping[str, str] = getattr(staging, "digests", {}) if staging is not None else {}
    return {
        "lora_name": lora_name,
        "digest": digests.get(lora_name),
        "engine": engine,
        "incarnation": getattr(staging, "incarnation", None),
        "lora_id": lora_id,
    }


def stamp_output(tm: Any, obj: Any, out: Any) -> None:
    if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
        return
    prefix = getattr(type(tm), "lorapub_managed_prefix", MANAGED_PREFIX)
    found = stamp(getattr(obj, "lora_path", None), getattr(obj, "lora_id", None), _server.CURRENT, engine_name(tm), prefix)
    if found is not None:
        out["meta_info"][STAMP_KEY] = found


async def _stamped(tm: Any, obj: Any, outs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        async for out in outs:
            stamp_output(tm, obj, out)
            yield out
    finally:
        aclose = getattr(outs, "aclose", None)
        if aclose is not None:
            await aclose()


def install(cls: Any) -> None:
    """Wrap ``cls._wait_one_response(obj, request=None)`` (an async iterator of outputs in 0.5.17 and
    0.5.23) so each output it yields is stamped. Idempotent."""
    original = cls.__dict__.get("_wait_one_response") or getattr(cls, "_wait_one_response", None)
    if original is None or getattr(original, "__lorapub_stamps__", False):
        return
    params = list(inspect.signature(original).parameters)
    if params[:2] != ["self", "obj"]:
        from lorapub.sglang_patch.targets import PatchMismatch

        raise PatchMismatch(f"{cls.__name__}._wait_one_response{params} is not (self, obj, request=None)")

    def _wait_one_response(self: Any, obj: Any, request: Any = None) -> AsyncIterator[Any]:
        return _stamped(self, obj, original(self, obj, request))

    setattr(_wait_one_response, "__lorapub_stamps__", True)
    setattr(_wait_one_response, "__wrapped__", original)
    cls._wait_one_response = _wait_one_response
    cls.lorapub_stamps = True
