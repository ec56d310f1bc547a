"""lorapub's SGLang engine adapter on a fresh contract double, as the conformance suite sees it:
:class:`SGLangUnderTest`.
See docs/testing.md, "`check_engine_admin`: the conformance suite".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorapub.ports import Transport
from lorapub.testing.sglang_double.server import SGLangDouble

if TYPE_CHECKING:
    from lorapub.adapters.sglang_wire import SGLangWireEngine  # aiohttp: imported when started

__all__ = ["SGLangUnderTest", "DEFAULT_TIMEOUT", "LOST_REPLY_AFTER"]

#: Seconds the adapter waits for an answer: a loaded 2-core machine answers well within it, so an
#: ordinary answer that comes late is never taken for a lost one.
DEFAULT_TIMEOUT = 30.0
#: Seconds it waits for the one reply :meth:`SGLangUnderTest.drop_next_reply` drops (that reply
#: never comes in time, so this is only how long the suite waits to see it lost).
LOST_REPLY_AFTER = 1.0


class SGLangUnderTest:
    """lorapub's SGLang engine adapter (:class:`~lorapub.adapters.sglang_wire.SGLangWireEngine`)
    against a fresh :class:`SGLangDouble`, as the conformance suite sees it
    (:class:`~lorapub.testing.conformance.EngineUnderTest`)."""

    def __init__(self, double: SGLangDouble, admin: SGLangWireEngine) -> None:
        self.double = double
        self.admin = admin

    @classmethod
    async def start(
        cls, stash_dir: str, name: str = "e0", *, request_timeout: float = DEFAULT_TIMEOUT,
        transport: Transport | None = None, api_key: str | None = None, admin_api_key: str | None = None,
    ) -> "SGLangUnderTest":
        """A fresh double staging on its own disk ``stash_dir`` and the adapter on it, sending buckets
        ``transport``'s way (None: HTTP bodies; a shared-memory or shared-folder transport's folder
        is the double's too); with keys, the server requires them and the adapter holds them."""
        from lorapub.adapters.sglang_wire import SGLangWireEngine

        double = SGLangDouble(name, decode_delay=0.005, api_key=api_key, admin_api_key=admin_api_key)
        double.stash_root = stash_dir  # the engine's own disk
        double.shm_dir = getattr(transport, "shm_dir", None)
        await double.start()
        admin = SGLangWireEngine(
            name, double.url, request_timeout=request_timeout, probe_timeout=request_timeout,
            load_timeout=request_timeout, api_key=api_key, admin_api_key=admin_api_key,
        )
        if transport is not None:
            admin.use_transport(transport)
        return cls(double, admin)

    async def served(self) -> set[str]:
        return set(self.double.registered())

    def physical_unloads(self, lora_name: str) -> int:
        return self.double.physical_unloads.count(lora_name)

    def native_refs(self, lora_name: str) -> int:
        return self.double.refs(lora_name) or 0

    def generate_requests(self) -> int:
        return self.double.generate_requests

    def generation(self, lora_name: str, *, long: bool = False) -> dict[str, Any]:
        return {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 60 if long else 2}, "lora_path": lora_name}

    def fail_next(self, op: str) -> None:
        self.double.inject(op, "error", status=500)

    def drop_next_reply(self, op: str) -> None:
        # Only the call whose reply is dropped waits LOST_REPLY_AFTER; every other keeps its timeout.
        if op == "generate":  # the request runs on; its reply comes after the client gave up
            self.double.inject(op, "slow", delay=2 * LOST_REPLY_AFTER)
            self._next_call_waits("generate", self.admin.client, "request_timeout")
        else:  # the work is done, the reply never comes
            self.double.inject(op, "drop")
            self._next_call_waits("end", self.admin, "load_timeout")

    def _next_call_waits(self, method: str, owner: object, timeout: str) -> None:
        """The adapter's next ``method`` call gives up after LOST_REPLY_AFTER (``owner.timeout``, for that call only)."""
        call = getattr(self.admin, method)

        async def once(*args: Any, **kwargs: Any) -> Any:
            self.admin.__dict__.pop(method, None)  # one call only
            kept = getattr(owner, timeout)
            setattr(owner, timeout, LOST_REPLY_AFTER)
            try:
                return await call(*args, **kwargs)
            finally:
                setattr(owner, timeout, kept)

        setattr(self.admin, method, once)

    def restart(self) -> None:
        self.double.restart()

    async def close(self) -> None:
        await self.admin.close()
        await self.double.stop()
