"""The protocols the orchestration needs from the outside world (adapters implement them; the core
never sees them), and the types they take and return. Every engine operation either returns,
raises :class:`~lorapub.errors.EngineError` (a definite no), or raises
:class:`~lorapub.errors.OutcomeUnknown` (no answer: it may have happened). Nothing else.
See docs/embedding.md, "Your engine: implement `lorapub.ports.EngineAdmin`".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, TypeVar, runtime_checkable

import attrs

from lorapub.core.attempt import Phase, ReadyLocal
from lorapub.core.effects import SendBegin
from lorapub.core.identity import AttemptToken, SessionKey, VersionKey
from lorapub.core.commands import Command, Returns
from lorapub.core.registry import RegistryState, Result
from lorapub.core.session import Binding
from lorapub.core.version import VersionState

R = TypeVar("R")

__all__ = [
    "EngineAdmin", "Closes", "Releases", "ChecksTransport",
    "EndTimings", "ReportsEndTimings", "EngineLimits", "ReportsLimits", "HeldAdapter", "StagedAttempt", "Inventory", "ReportsInventory",
    "OverwriteAdmin", "GenerationTarget", "RoutedSession", "Routing", "BucketSource", "Registry", "RegistryStore", "CopyStore", "Clock", "AttemptToken",
    "Phase", "ReadyLocal", "SendBegin", "VersionState",
]


@runtime_checkable
class EngineAdmin(Protocol):
    """One serving engine (E0, E1…), addressed by its stable ``name``.

    Its lifecycle: :meth:`close` (its deployment closes, or removes it, with ``own_engines=True``) and
    :meth:`release` (``Deployment.start()`` or ``add_engine`` refused it). An adapter written before
    these two were declared is still admitted: the deployment supplies no-ops for the ones it lacks
    (docs/embedding.md)."""

    name: str

    async def incarnation(self) -> str:
        """Identity of the engine's current process life; changes on every restart."""

    async def begin(self, request: SendBegin) -> str:
        """Fix identity, attempt and bucket plan; check resources. Returns the incarnation (PREPARED)."""

    async def receive_bucket(self, token: AttemptToken, index: int, payload: bytes) -> str:
        """Store bucket ``index`` of ``token`` in the attempt's own stash; returns the incarnation.

        A duplicate is a no-op that answers the same way (never a second transfer)."""

    async def end(self, token: AttemptToken) -> ReadyLocal:
        """Verify the manifest, fresh-load the adapter pinned, probe the exact version."""

    async def cleanup(self, token: AttemptToken, lora_name: str) -> str:
        """Drop the attempt's stash and any load of it; refuse it forever. Returns the incarnation."""

    async def reclaim(self, lora_name: str, reclaim_id: str) -> None:
        """Unregister the exact name, wait for the native request refs to reach 0, unload once."""

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]:
        """One backend generation, sent once: never resent by the transport. The reply is the
        engine's JSON (SGLang's ``/generate`` answer)."""

    async def close(self) -> None:
        """End the adapter's connections for good: called once its deployment (or ``remove_engine``)
        is done with it, with ``own_engines=True``. Nothing is sent through it afterwards. A no-op
        where there is nothing to close."""

    async def release(self) -> None:
        """Close lorapub's own connections but leave the adapter usable (its next call opens new ones):
        what a refused ``Deployment.start()`` or ``add_engine`` does, so that a refusal leaks nothing
        and the same adapter may be offered again. A no-op where there is nothing to close."""


@runtime_checkable
class Closes(Protocol):
    """An adapter with :meth:`EngineAdmin.close`: what the deployment asks of one written before
    EngineAdmin declared it (it wraps such an adapter, and calls its ``close`` only where it has one)."""

    async def close(self) -> None: ...


@runtime_checkable
class Releases(Protocol):
    """An adapter with :meth:`EngineAdmin.release` (as :class:`Closes`, for ``release``)."""

    async def release(self) -> None: ...


@attrs.frozen
class EngineLimits:
    """What an engine can hold: SGLang's ``--max-loaded-loras`` and ``--max-loras-per-batch``
    (None: not set, or not known)."""

    max_loaded_loras: int | None = None
    max_loras_per_batch: int | None = None

    def managed_capacity(self) -> int | None:
        """How many pinned managed versions it holds at once: SGLang refuses to pin every slot of
        the batch's LoRA memory pool (one stays for the base model and unpinned adapters), and
        loads no more than ``max_loaded_loras``."""
        bounds = [n for n in (self.max_loaded_loras,
                              None if self.max_loras_per_batch is None else self.max_loras_per_batch - 1)
                  if n is not None]
        return min(bounds) if bounds else None


@runtime_checkable
class ReportsLimits(Protocol):
    """An :class:`EngineAdmin` that can say what it holds at most (checked against the
    deployment's ``capacity`` at start and when the engine joins). Optional: an engine without
    it is not checked (the deployment logs that)."""

    async def limits(self) -> EngineLimits: ...


@attrs.frozen
class EndTimings:
    """Where one ``end`` spent its time on an engine, in seconds: the engine's own phases (what its
    staging reports, e.g. ``verify_wait`` and ``load``), then the adapter's: the staging call
    (``stage``), the exact-version probe (``probe``), the state check (``state``). The publication
    report carries them per engine, each named ``end.<phase>`` (:meth:`phases`)."""

    engine: Mapping[str, float] = attrs.field(factory=dict)
    stage: float | None = None
    probe: float | None = None
    state: float | None = None

    def phases(self) -> dict[str, float]:
        """As the publication report's ``engine_phases`` names them: ``end.<phase>`` -> seconds."""
        out = {f"end.{k}": v for k, v in self.engine.items()}
        out.update({f"end.{k}": v for k, v in (("stage", self.stage), ("probe", self.probe), ("state", self.state))
                    if v is not None})
        return out


@runtime_checkable
class ReportsEndTimings(Protocol):
    """An :class:`EngineAdmin` that keeps where its recent ``end`` calls spent their time (the
    publication report's ``engine_phases`` carry them). Optional."""

    def end_timings(self, token: AttemptToken) -> EndTimings | None:
        """Where ``end`` of ``token`` spent its time, handed over once (None: not kept, or taken)."""


@attrs.frozen
class HeldAdapter:
    """One managed adapter an engine holds, and its native request refs (requests running on it)."""

    lora_name: str
    refs: int = 0
    lora_id: str | None = None
    pinned: bool = True


@attrs.frozen
class StagedAttempt:
    """An attempt staged on an engine (bytes received, not loaded or cleaned yet)."""

    token: AttemptToken
    lora_name: str
    idle_seconds: float | None = None


@attrs.frozen
class Inventory:
    """What an engine holds now: its life, its managed adapters, its staged attempts."""

    incarnation: str
    adapters: Mapping[str, HeldAdapter] = attrs.field(factory=dict)  # every adapter, managed or not
    staged: tuple[StagedAttempt, ...] = ()
    managed_prefix: str | None = None  # the names it protects (None: it does not say)
    stamps: bool = False  # its responses with a managed adapter carry a provenance stamp (docs/provenance.md)


@runtime_checkable
class ReportsInventory(Protocol):
    """An :class:`EngineAdmin` that can list what it holds (health names the requests that keep
    a version; the reconciler compares it with what the engine should hold). Optional."""

    async def inventory(self) -> Inventory: ...


@runtime_checkable
class OverwriteAdmin(Protocol):
    """One engine as the old overwrite path (switch off) drives it: pause, flush, overwrite."""

    name: str

    async def pause_generation(self) -> None: ...

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def loaded_adapters(self) -> list[str]: ...

    async def load_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def unload_adapter(self, lora_name: str) -> None: ...

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]: ...


class GenerationTarget(Protocol):
    """Where a session's generation is sent: an :class:`EngineAdmin`, or a router in front of the
    engines (:class:`lorapub.adapters.sglang_router.RoutedGeneration`)."""

    name: str

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]: ...


class RoutedSession(Protocol):
    """What a :class:`Routing` reads of a session: its key, its binding, and the target its last
    generation went to (None: none yet). Routing never writes it: the session records where it went."""

    @property
    def key(self) -> SessionKey: ...

    @property
    def binding(self) -> Binding | None: ...

    @property
    def engine(self) -> GenerationTarget | None: ...


class Routing(Protocol):
    """Where a session's generations go: lorapub's own sticky router (the default), or
    :class:`lorapub.adapters.sglang_router.RouterRouting` behind the SGLang router."""

    def pick(self, session: RoutedSession, holders: frozenset[str] | None = None) -> GenerationTarget:
        """The target of the session's next generation; ``holders``: the engines that hold its
        version now (None: not known). Raises EngineUnavailable when no engine may serve it."""
        ...


class BucketSource(Protocol):
    """The sending side of one publication's ordered bucket transfer (a transport's :meth:`Transport.source`).

    ``collective``: False for a byte transport (the source half of bucket ``i`` completes first,
    then every engine receives ``payload(token, i)``); True for a collective, whose source half
    and every engine's receive run at once (a broadcast)."""

    collective: bool = False

    async def send(self, token: AttemptToken, index: int, engines: tuple[str, ...]) -> None:
        """Complete the source half of bucket ``index`` (a collective, or staging bytes)."""

    def payload(self, token: AttemptToken, index: int) -> Any:
        """What each engine's ``receive_bucket`` gets for bucket ``index``: bytes, or a value its
        transport's :meth:`Transport.bucket_request` understands (asked only of a byte transport)."""


@attrs.frozen
class BucketPost:
    """What an engine posts to its staging for one bucket (:meth:`Transport.bucket_request`).

    ``format``: the staging route's bucket format (``lorapub.wire.routes.FORMATS``). ``body``: bytes,
    or an async iterator of buffers (a streamed body of ``length`` bytes). ``sender``: for a
    streamed body, where it is posted from (``"thread"``, ``"loop"`` or ``"auto"``); None: on the
    caller's loop. ``settle(stored, why)`` runs once the receive ends: ``stored`` when the engine
    stored the bucket, else ``why`` says what failed (None when the receive was cancelled or raised
    something untyped)."""

    format: str
    body: Any
    content_type: str = "application/octet-stream"
    length: int | None = None
    sender: str | None = None
    settle: Callable[[bool, str | None], None] | None = None


@runtime_checkable
class Transport(Protocol):
    """How a deployment's bucket bytes reach its engines' own staging: named once, on the
    deployment (``Deployment(engines, transport=...)``), which hands it to every engine that
    :class:`TakesTransport`. ``load``: how the engine loads what it staged (``"dir"`` or ``"tensors"``).

    Transports are equal when they send the same way (a transport that keeps per-attempt state
    equals only itself)."""

    load: str

    def source(self, snapshot: Any, plan: Any) -> BucketSource:
        """The publisher's half for one publication of ``snapshot`` under ``plan``."""

    def begin_options(self, request: SendBegin, engine: str) -> Mapping[str, Any]:
        """What ``engine``'s begin tells its staging about this transport (its ``transport`` field)."""

    async def bucket_request(self, token: AttemptToken, index: int, payload: Any, engine: str) -> BucketPost:
        """What ``engine`` posts for bucket ``index`` of ``token``, given the source's ``payload``."""


@runtime_checkable
class TakesTransport(Protocol):
    """An :class:`EngineAdmin` whose buckets travel its deployment's :class:`Transport`.

    It may also be a :class:`ChecksTransport` (``can_use_transport(transport) -> bool``; False:
    :meth:`use_transport` would refuse it): a deployment then asks every engine before it hands any the
    transport, so a refused deployment leaves no engine holding it."""

    name: str

    @property
    def transport(self) -> Transport: ...

    def use_transport(self, transport: Transport) -> None:
        """Send buckets ``transport``'s way; an engine already given another one refuses (InvalidInput)."""


@runtime_checkable
class ChecksTransport(Protocol):
    """A :class:`TakesTransport` engine that can say beforehand whether it would take a transport."""

    def can_use_transport(self, transport: Transport) -> bool:
        """False: :meth:`TakesTransport.use_transport` would refuse ``transport``."""


@runtime_checkable
class Registry(Protocol):
    """The single writer of versions, attempts, sessions and reclaims, through one door.

    Every command is a value from :mod:`lorapub.core.registry` and every answer a
    :class:`~lorapub.core.registry.Result`; a rejection raises its typed error.
    :class:`~lorapub.local_registry.LocalRegistry` (in process) and
    :class:`~lorapub.adapters.ray_registry.RayRegistry` (a Ray actor) implement it.
    A call whose reply is lost raises :class:`~lorapub.errors.OutcomeUnknown`; every
    command is safe to replay.
    """

    async def handle(self, command: Returns[R]) -> Result[R]: ...


class RegistryStore(Protocol):
    """Where a registry keeps its state between calls (memory, or a durable store).

    ``load`` returns the state last saved, or None for a new store. ``save`` makes ``state``
    durable before it returns; ``command`` is the command whose application turned the
    previously saved state into ``state`` (a log store keeps only the command and replays
    it through the pure core on load), or None when ``state`` is to be kept whole (a
    checkpoint). Failures raise :class:`~lorapub.errors.StoreError` (unreadable contents
    :class:`~lorapub.errors.StoreCorrupted`) naming the store; after a failed ``save`` the
    previously saved state is still the durable one. A store whose ``save`` takes only the
    state is still accepted: it is then always given the whole state.
    """

    def load(self) -> RegistryState | None: ...

    def save(self, state: RegistryState, command: Command | None = None) -> None: ...


class CopyStore(Protocol):
    """Where the publishing process also keeps the frozen copy of each version sessions may still need
    (``Deployment(copies=)``), so that a publishing process started again (a trainer's restart) takes
    them back and can still load them on an engine that joins or restarts. ``keep`` and ``retain``
    run on the event loop and must not block (send in the background); a failure there is logged and
    this process keeps its own copy. ``items`` runs once, when the deployment starts, off the loop.
    Each snapshot is a :class:`lorapub.snapshot.Snapshot` (typed ``Any`` here: the ports sit beneath it)."""

    def keep(self, key: VersionKey, snapshot: Any) -> None: ...

    def retain(self, keys: Iterable[VersionKey]) -> None: ...

    def items(self) -> list[tuple[VersionKey, Any]]: ...


class Clock(Protocol):
    """The one time source a deployment hands every part: lease renewals and the registry's lease
    deadlines, session idleness, the reconcile interval, retries' backoff, a stalled attempt's age.
    ``monotonic()`` is now, in seconds; ``sleep(seconds)`` returns once this clock has moved on by
    that much. The default reads ``time.monotonic`` and sleeps with asyncio; a test's
    ``lorapub.testing.ManualClock`` moves only when the test advances it."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...
