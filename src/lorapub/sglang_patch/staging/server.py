"""The staging's glue to a patched SGLang server: its TokenizerManager as the engine, the staging of
the server life, and the Starlette request forms the routes receive.

Both forms of lorapub's patch (runtime: :mod:`lorapub.sglang_patch.routes`; diffs: ``http_server.py``)
build the staging with :func:`for_server` and answer with :func:`starlette_receive` and
:func:`starlette_json`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from lorapub.core.identity import MANAGED_PREFIX
from lorapub.sglang_patch.staging import test_switch
from lorapub.sglang_patch.staging.engine import EngineStaging

__all__ = ["CURRENT", "SGLangHooks", "for_server", "max_loaded_loras", "starlette_json", "starlette_receive"]


#: The staging of this server life (set by :func:`for_server`; lorapub/sglang_patch/provenance.py reads it).
CURRENT: EngineStaging | None = None


class SGLangHooks:
    """The patched SGLang server's TokenizerManager as :class:`~lorapub.sglang_patch.staging.engine.EngineHooks`
    (``tm`` is read at each call: the server creates it after the routes are added). The request
    classes are SGLang's own, taken from the globals of the methods that use them."""

    def __init__(self, tokenizer_manager: Callable[[], Any], serialize: Callable[[Any], bytes] | None = None) -> None:
        self._tm = tokenizer_manager
        self._serialize = serialize

    def adapters(self) -> dict[str, dict[str, Any]]:
        registry = self._tm().lora_registry
        counters = getattr(registry, "_counters", {})  # SGLang's per-adapter request counts (both releases)
        return {name: {"lora_id": ref.lora_id, "pinned": bool(ref.pinned), "lora_path": ref.lora_path,
                       "refs": counters[ref.lora_id].value() if ref.lora_id in counters else 0}
                for name, ref in registry.get_all_adapters().items()}

    def max_loaded_loras(self) -> int | None:
        return max_loaded_loras(self._tm())

    def managed_prefix(self) -> str:
        return getattr(type(self._tm()), "lorapub_managed_prefix", MANAGED_PREFIX)

    async def load_dir(self, lora_name: str, path: str) -> str | None:
        tm = self._tm()
        request = type(tm).load_lora_adapter.__globals__["LoadLoRAAdapterReqInput"]
        result = await tm.load_lora_adapter(request(lora_name=lora_name, lora_path=path, pinned=True), None)
        return None if result.success else str(result.error_message)

    async def load_tensors(self, lora_name: str, tensors: dict[str, Any], config: dict[str, Any],
                           checksums: dict[str, str]) -> str | None:
        tm = self._tm()
        request = type(tm).load_lora_adapter_from_tensors.__globals__["LoadLoRAAdapterFromTensorsReqInput"]
        serialize = self._serialize
        if serialize is None:  # SGLang's own: what Engine.load_lora_adapter_from_tensors sends each TP rank
            from sglang.srt.utils import MultiprocessingSerializer

            serialize = MultiprocessingSerializer.serialize
        ranks = int(getattr(getattr(tm, "server_args", None), "tp_size", 1) or 1)
        payload = await asyncio.to_thread(serialize, tensors)
        kwargs = dict(lora_name=lora_name, config_dict=config, serialized_named_tensors=[payload] * ranks, pinned=True)
        if "expected_checksums" in getattr(request, "__struct_fields__", getattr(request, "__dataclass_fields__", ())):
            kwargs["expected_checksums"] = checksums  # every TP rank re-checks each tensor's SHA-256
        result = await tm.load_lora_adapter_from_tensors(request(**kwargs), None)
        return None if result.success else str(result.error_message)


def max_loaded_loras(tm: Any) -> int | None:
    """SGLang's ``--max-loaded-loras`` (None: no limit) of the server of ``tm`` (SGLang's TokenizerManager)."""
    get_lora = type(tm)._resolve_lora_path.__globals__.get("get_lora")
    limit: int | None
    if get_lora is not None:  # 0.5.23 keeps LoRA settings in their own config
        limit = get_lora().max_loaded_loras
    else:
        limit = tm.server_args.max_loaded_loras
    return limit


def for_server(tokenizer_manager: Callable[[], Any], incarnation: str) -> EngineStaging:
    """The staging of a patched SGLang server (both forms of the patch build it this way). Its stash
    is freed when the server's process exits normally; after a kill, by the next life on the host."""
    import atexit

    staging = EngineStaging(SGLangHooks(tokenizer_manager), incarnation=incarnation,
                            before_dir_load=test_switch.switch_from_env())  # None unless a test set it
    global CURRENT
    CURRENT = staging  # the provenance stamps of this server read its digests and incarnation
    atexit.register(staging.close)
    return staging


async def starlette_receive(staging: EngineStaging, request: Any) -> tuple[int, dict[str, Any]]:
    """A bucket from a Starlette/FastAPI request (SGLang's server): streamed, never buffered twice."""
    length = request.headers.get("content-length")
    return await staging.receive(dict(request.query_params), request.stream(),
                                 int(length) if length and length.isdigit() else None)


async def starlette_json(request: Any) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None
