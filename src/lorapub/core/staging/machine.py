"""The engine-side staging as a pure state machine: commands in, (new state, reply, effects) out.
No I/O, no clock, no threads: times and what the engine holds come in as values, and what must be
done to bytes, folders, groups and loads goes out as effects for
:class:`~lorapub.sglang_patch.staging.engine.EngineStaging` to run; one door, :func:`handle`.
See docs/design.md, "The staging machine".
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping

import attrs
from pyrsistent import PMap, PSet, pmap, pset

from lorapub.core.door import Table, on
from lorapub.core.identity import AttemptToken
from lorapub.core.staging.messages import (
    Abandon,
    Accepted,
    Aged,
    Arrive,
    Begin,
    Cleaned,
    Cleanup,
    Close,
    Collect,
    CollectFailed,
    CloseBuffer,
    Discard,
    DropGroup,
    Effect,
    End,
    Finish,
    Forget,
    Free,
    Freed,
    Join,
    JoinGroup,
    Kept,
    Leave,
    Load,
    Loaded,
    LoadFailed,
    Lost,
    PrepareFolder,
    Proceed,
    Receipt,
    Receipted,
    Receive,
    ReceiveBytes,
    Refusal,
    Release,
    ReleaseBytes,
    Releasing,
    Stored,
    Sweep,
    Verify,
    Wait,
    invalid,
    refusal,
)

__all__ = ["COMMANDS", "Outcome", "Phase", "ProtocolError", "Staged", "StagingState", "handle", "idle_attempts",
           "new_state"]


class ProtocolError(RuntimeError):
    """A command the engine's own protocol never sends (a locked step while a load holds the attempt)."""


class Phase(enum.Enum):
    RECEIVING = "receiving"  # begun: buckets arrive (also after a failed load: every bucket still held)
    LOADING = "loading"  # an end checked every bucket and its load runs (it holds the attempt's lock)
    LOADED = "loaded"  # the end loaded the adapter; the staged bytes are released
    FAILED = "failed"  # a bucket did not verify or a collective failed: later buckets and ends are refused


def _pmap(value: Any) -> PMap[Any, Any]:
    return value if isinstance(value, PMap) else pmap(value)


def _pset(value: Any) -> PSet[Any]:
    return value if isinstance(value, PSet) else pset(value)


def _effects(value: Iterable[Effect]) -> tuple[Effect, ...]:
    return tuple(value)


@attrs.frozen
class Staged:
    """One staged attempt. ``held``: bucket index -> bytes kept; ``arriving``: index -> bytes whose
    landing a receive or a collective holds; ``collecting``: the arriving buckets a collective
    receives (outside the attempt's lock)."""

    token: AttemptToken
    lora_name: str
    digest: str
    sizes: tuple[int, ...]  # the plan's bytes of each bucket
    load: str  # "dir" | "tensors"
    transport: str  # "http" | "shm" | "torch"
    last_driven: float
    phase: Phase = Phase.RECEIVING
    held: PMap[int, int] = attrs.field(default=pmap(), converter=_pmap)
    arriving: PMap[int, int] = attrs.field(default=pmap(), converter=_pmap)
    collecting: PSet[int] = attrs.field(default=pset(), converter=_pset)
    receipt: Receipt | None = None
    failed: str | None = None
    driving: int = 0  # operations on it running or waiting for its lock

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes it may still take: what is arriving, and while it receives the plan's size of every
        bucket neither held nor arriving."""
        rest = 0
        if self.phase is Phase.RECEIVING:
            rest = sum(n for i, n in enumerate(self.sizes) if i not in self.held and i not in self.arriving)
        return sum(self.arriving.values()) + rest

    @property
    def missing(self) -> list[int]:
        return [i for i in range(len(self.sizes)) if i not in self.held]

    def _abort_reason(self, incarnation: str) -> str | None:
        """Freed before it loaded: every party of its collective is told to stop waiting."""
        return None if self.receipt is not None else f"{incarnation}: attempt {self.token} cleaned up"


@attrs.frozen
class StagingState:
    """One server life's staging. ``max_bytes``: the byte budget (None: none); ``idle_timeout``:
    seconds an attempt may go undriven before a sweep ages it out (``inf``: never)."""

    incarnation: str
    max_bytes: int | None = None
    idle_timeout: float = float("inf")
    attempts: PMap[AttemptToken, Staged] = attrs.field(default=pmap(), converter=_pmap)
    tombstones: PSet[AttemptToken] = attrs.field(default=pset(), converter=_pset)
    aged_out: int = 0
    closed: bool = False

    @property
    def held_bytes(self) -> int:
        return sum(a.held_bytes for a in self.attempts.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(a.reserved_bytes for a in self.attempts.values())


def new_state(incarnation: str, max_bytes: int | None = None, idle_timeout: float = float("inf")) -> StagingState:
    return StagingState(incarnation, max_bytes, idle_timeout)


@attrs.frozen
class Outcome:
    state: StagingState
    reply: Any = None
    effects: tuple[Effect, ...] = attrs.field(default=(), converter=_effects)



# -- transitions --------------------------------------------------------------------------------------
def _with(state: StagingState, attempt: Staged) -> StagingState:
    return attrs.evolve(state, attempts=state.attempts.set(attempt.token, attempt))


def _without(state: StagingState, token: AttemptToken, *, tombstone: bool) -> StagingState:
    attempts = state.attempts.discard(token)
    tombstones = state.tombstones.add(token) if tombstone else state.tombstones
    return attrs.evolve(state, attempts=attempts, tombstones=tombstones)


def _other_life(state: StagingState, incarnation: Any) -> Refusal | None:
    if incarnation != state.incarnation:
        return refusal(f"message for engine life {incarnation!r}; this life is {state.incarnation!r}", "STAGE_LIFE")
    return None


def _live(state: StagingState, token: AttemptToken) -> Staged | Refusal:
    if token in state.tombstones:
        return refusal(f"attempt {token} was cleaned up here; refusing to recreate it", "STAGE_TOMBSTONE")
    found = state.attempts.get(token)
    if found is None:
        return refusal(f"attempt {token} was never begun in this engine life", "STAGE_UNKNOWN")
    return found


def _locked(attempt: Staged, step: str) -> None:
    if attempt.phase is Phase.LOADING:
        raise ProtocolError(f"{step} of {attempt.token} while its load holds it")


def _enter(state: StagingState, attempt: Staged, now: float) -> StagingState:
    return _with(state, attrs.evolve(attempt, driving=attempt.driving + 1, last_driven=now))


def begin(state: StagingState, c: Begin) -> Outcome:
    if c.token in state.tombstones:
        return Outcome(state, refusal(f"attempt {c.token} was cleaned up here; late begin refused", "STAGE_TOMBSTONE"))
    wrong = _other_life(state, c.incarnation)
    if wrong is not None:
        return Outcome(state, wrong)
    found = state.attempts.get(c.token)
    if found is not None:  # a duplicate begin: the same answer, nothing set up twice
        state = _with(state, attrs.evolve(found, last_driven=c.now))
        if found.digest != c.digest:
            return Outcome(state, refusal(f"attempt {c.token} was begun here with digest {found.digest[:12]}"))
        return Outcome(state, Accepted(True))
    if c.problem is not None:
        return Outcome(state, c.problem)
    if c.lora_name in c.loaded:
        return Outcome(state, refusal(f"{c.lora_name} is already loaded"))
    if c.slot_limit is not None and len(c.loaded) >= int(c.slot_limit):
        return Outcome(state, refusal(f"no free LoRA slot ({len(c.loaded)} of {c.slot_limit} loaded)",
                                      "STAGE_CAPACITY"))
    total = sum(c.sizes)
    held, reserved = state.held_bytes, state.reserved_bytes
    if state.max_bytes is not None and held + reserved + total > state.max_bytes:
        return Outcome(state, refusal(f"staging {total} bytes would exceed {state.max_bytes} ({held} held, {reserved} "
                                      "more reserved by attempts still receiving)", "STAGE_CAPACITY"))
    if c.late_problem is not None:
        return Outcome(state, c.late_problem)
    attempt = Staged(c.token, c.lora_name, c.digest, tuple(c.sizes), c.load, c.transport, c.now)
    effects: list[Effect] = []
    if c.transport == "torch":
        effects.append(JoinGroup(c.token))
    if c.load == "dir":
        effects.append(PrepareFolder(c.token))
    return Outcome(_with(state, attempt), Accepted(False), effects)


def abandon(state: StagingState, c: Abandon) -> Outcome:
    found = state.attempts.get(c.token)
    if found is None:
        return Outcome(state)
    effects = [Free(c.token, found._abort_reason(state.incarnation))]
    return Outcome(_without(state, c.token, tombstone=False), None, effects)


def receive(state: StagingState, c: Receive) -> Outcome:
    if c.token in state.tombstones:
        return Outcome(state, refusal(f"attempt {c.token} was cleaned up here; late bucket refused", "STAGE_TOMBSTONE"))
    wrong = _other_life(state, c.incarnation) or c.problem
    if wrong is not None:
        return Outcome(state, wrong)
    found = _live(state, c.token)
    if isinstance(found, Refusal):
        return Outcome(state, found)
    return Outcome(_enter(state, found, c.now), Proceed())


def arrive(state: StagingState, c: Arrive) -> Outcome:
    a = _live(state, c.token)  # a cleanup may have come while the caller waited for the lock
    if isinstance(a, Refusal):
        return Outcome(state, a)
    _locked(a, "a bucket")
    if a.phase is Phase.FAILED:
        return Outcome(state, refusal(f"attempt {c.token} failed here: {a.failed}", "STAGE_FAILED"))
    if not 0 <= c.index < len(a.sizes):
        return Outcome(state, invalid(f"bucket index {c.index} is not in the plan of {c.token}"))
    if c.index in a.held:  # a duplicate: nothing stored twice, no second collective
        return Outcome(state, Accepted(True))
    if a.phase is Phase.LOADED:
        return Outcome(state, refusal(f"attempt {c.token} is already loaded; bucket {c.index} is late"))
    planned = a.sizes[c.index]
    if c.fmt == "torch":
        if a.transport != "torch":
            return Outcome(state, invalid(f"attempt {c.token} was begun for the {a.transport} transport"))
        if c.index in a.collecting:  # a duplicate while the first runs: its outcome, never a second collective
            return Outcome(state, Join())
        a = attrs.evolve(a, arriving=a.arriving.set(c.index, planned), collecting=a.collecting.add(c.index))
        return Outcome(_with(state, a), Proceed(), [Collect(c.token, c.index)])
    if c.index in a.arriving:  # its collective runs: a bucket lands once, one way
        return Outcome(state, invalid(f"bucket {c.index} of {c.token} is arriving through its collective"))
    nbytes = planned
    if c.fmt == "raw" and c.length is not None and c.length != planned:
        return Outcome(state, invalid(f"bucket {c.index} has {planned} bytes in the plan, the body says {c.length}"))
    if c.fmt == "safetensors":  # a blob of its own size: the plan's bytes and a header
        if c.length is None or c.length > planned + (100 << 20):
            return Outcome(state, invalid("a safetensors bucket needs a Content-Length within its plan's size"))
        nbytes = c.length
        over = state.held_bytes + state.reserved_bytes - planned + nbytes
        if state.max_bytes is not None and over > state.max_bytes:
            return Outcome(state, refusal(f"bucket {c.index}'s {nbytes} bytes would exceed {state.max_bytes}",
                                          "STAGE_CAPACITY"))
    a = attrs.evolve(a, arriving=a.arriving.set(c.index, nbytes))
    return Outcome(_with(state, a), Proceed(), [ReceiveBytes(c.token, c.index, c.fmt)])


def _landed(a: Staged, index: int, now: float, **changes: Any) -> Staged:
    return attrs.evolve(a, arriving=a.arriving.discard(index), collecting=a.collecting.discard(index),
                        last_driven=max(a.last_driven, now), **changes)


def stored(state: StagingState, c: Stored) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None or c.token in state.tombstones:  # cleaned up while the bytes arrived: keep nothing
        if a is not None:
            state = _with(state, _landed(a, c.index, c.now))
        return Outcome(state, refusal(f"attempt {c.token} was cleaned up while bucket {c.index} arrived",
                                      "STAGE_TOMBSTONE"), [CloseBuffer(c.token, c.index)])
    if c.index in a.held or a.phase in (Phase.LOADING, Phase.LOADED):
        raise ProtocolError(f"bucket {c.index} of {c.token} stored twice")
    a = _landed(a, c.index, c.now, held=a.held.set(c.index, c.nbytes))
    return Outcome(_with(state, a), Accepted(False), [Verify(c.token, c.index)])


def lost(state: StagingState, c: Lost) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None:
        return Outcome(state)
    return Outcome(_with(state, _landed(a, c.index, c.now)))


def collect_failed(state: StagingState, c: CollectFailed) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None:
        return Outcome(state)
    a = _landed(a, c.index, c.now, phase=Phase.FAILED if a.phase is Phase.RECEIVING else a.phase, failed=c.reason)
    return Outcome(_with(state, a), None, [DropGroup(c.token, f"{state.incarnation}: {c.reason}")])


def end(state: StagingState, c: End) -> Outcome:
    found = _other_life(state, c.incarnation) or _live(state, c.token)
    if isinstance(found, Refusal):
        return Outcome(state, found)
    return Outcome(_enter(state, found, c.now), Proceed())


def finish(state: StagingState, c: Finish) -> Outcome:
    a = _live(state, c.token)
    if isinstance(a, Refusal):
        return Outcome(state, a)
    _locked(a, "an end")
    if a.receipt is not None:  # a duplicate end: the same receipt, nothing loaded twice
        return Outcome(state, Receipted(a.receipt, True))
    if a.phase is Phase.FAILED:
        return Outcome(state, refusal(f"attempt {c.token} failed here: {a.failed}", "STAGE_FAILED"))
    missing = a.missing
    if missing:
        return Outcome(state, refusal(f"buckets {missing[:8]} of {c.token} never arrived", "STAGE_INCOMPLETE"))
    return Outcome(_with(state, attrs.evolve(a, phase=Phase.LOADING)), Proceed(), [Load(c.token)])


def load_failed(state: StagingState, c: LoadFailed) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None:  # the life closed during the load
        return Outcome(state, c.refusal)
    if a.phase is not Phase.LOADING:
        raise ProtocolError(f"a load outcome for {c.token}, whose load does not run")
    if c.fails and c.refusal is not None:
        a = attrs.evolve(a, phase=Phase.FAILED, failed=c.refusal.message)
    else:
        a = attrs.evolve(a, phase=Phase.RECEIVING)
    return Outcome(_with(state, a), c.refusal)


def loaded(state: StagingState, c: Loaded) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None:  # the life closed during the load (the server goes, and its adapters with it)
        return Outcome(state, refusal(f"attempt {c.token} was freed during its load", "STAGE_TOMBSTONE"))
    if a.phase is not Phase.LOADING:
        raise ProtocolError(f"a load outcome for {c.token}, whose load does not run")
    # The adapter is registered: the attempt keeps its receipt whatever came meanwhile, so the
    # cleanup that waits for this load answers it as loaded (and its caller unloads it).
    a = attrs.evolve(a, phase=Phase.LOADED, receipt=c.receipt, held=pmap())
    effects: list[Effect] = [ReleaseBytes(c.token), DropGroup(c.token, None)]
    if c.token in state.tombstones:
        return Outcome(_with(state, a), refusal(f"attempt {c.token} was cleaned up during its load; the cleanup "
                                                "answers the adapter it loaded", "STAGE_TOMBSTONE"), effects)
    return Outcome(_with(state, a), Receipted(c.receipt, False), effects)


def cleanup(state: StagingState, c: Cleanup) -> Outcome:
    state = attrs.evolve(state, tombstones=state.tombstones.add(c.token))  # from now on begin / bucket / end refused
    found = state.attempts.get(c.token)
    if found is None:
        return Outcome(state, Cleaned(None))
    return Outcome(_enter(state, found, c.now), Wait())


def discard(state: StagingState, c: Discard) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None:  # freed meanwhile (another cleanup, a release)
        return Outcome(state, Cleaned(None))
    _locked(a, "a cleanup")
    return Outcome(_without(state, c.token, tombstone=True), Cleaned(a.receipt),
                   [Free(c.token, a._abort_reason(state.incarnation))])


def release(state: StagingState, c: Release) -> Outcome:
    if c.loaded:
        return Outcome(state, refusal(f"{c.lora_name} is still loaded; unload it first"))
    tokens = tuple(t for t, a in state.attempts.items() if a.lora_name == c.lora_name)
    for token in tokens:
        state = _enter(state, state.attempts[token], c.now)
    return Outcome(state, Releasing(tokens))


def forget(state: StagingState, c: Forget) -> Outcome:
    a = state.attempts.get(c.token)
    if a is not None:
        _locked(a, "a release")
        if _holds_adapter(a, c.adapters):  # its end loaded the name while the release waited
            return Outcome(state, Kept(c.token))
    abort = a._abort_reason(state.incarnation) if a is not None else None
    return Outcome(_without(state, c.token, tombstone=True), Freed(c.token), [Free(c.token, abort)])


def leave(state: StagingState, c: Leave) -> Outcome:
    a = state.attempts.get(c.token)
    if a is None:
        return Outcome(state)
    return Outcome(_with(state, attrs.evolve(a, driving=max(0, a.driving - 1), last_driven=max(a.last_driven, c.now))))


def _idle(state: StagingState, a: Staged, now: float) -> bool:
    """Nobody drove it for ``idle_timeout`` and no operation on it runs or waits (nor a collective)."""
    return not a.driving and not a.arriving and now - a.last_driven >= state.idle_timeout


def idle_attempts(state: StagingState, now: float) -> list[Staged]:
    """The attempts a sweep at ``now`` would age out, before it asks which adapters are loaded."""
    if state.closed:
        return []
    return [a for a in state.attempts.values() if _idle(state, a, now)]


def _holds_adapter(a: Staged, adapters: Mapping[str, Any] | None) -> bool:
    """Its end loaded the adapter registered under its name now (adapters unknown: so it may)."""
    if a.receipt is None:
        return False
    if adapters is None:
        return True
    return a.lora_name in adapters and adapters[a.lora_name] == a.receipt.lora_id


def sweep(state: StagingState, c: Sweep) -> Outcome:
    aged, effects = [], []
    for a in idle_attempts(state, c.now):
        if _holds_adapter(a, c.adapters):  # aging never unloads: the registry reclaims or cleans it up
            continue
        state = _without(state, a.token, tombstone=True)  # as a cleanup: late begin / bucket / end refused
        state = attrs.evolve(state, aged_out=state.aged_out + 1)
        aged.append(Aged(a.token, a.lora_name, c.now - a.last_driven, a.receipt is not None))
        effects.append(Free(a.token, a._abort_reason(state.incarnation)))
    return Outcome(state, tuple(aged), effects)


def close(state: StagingState, c: Close) -> Outcome:
    effects = [Free(a.token, a._abort_reason(state.incarnation)) for a in state.attempts.values()]
    return Outcome(attrs.evolve(state, attempts=pmap(), closed=True), None, effects)


#: The door's table: each command type and its transition, ``(state, command: ThatCommand) -> Outcome``.
COMMANDS: Table[StagingState, Outcome] = Table(
    "staging",
    on(Begin, begin), on(Abandon, abandon), on(Receive, receive), on(Arrive, arrive), on(Stored, stored),
    on(Lost, lost), on(CollectFailed, collect_failed), on(End, end), on(Finish, finish), on(Loaded, loaded),
    on(LoadFailed, load_failed), on(Cleanup, cleanup), on(Discard, discard), on(Release, release),
    on(Forget, forget), on(Leave, leave), on(Sweep, sweep), on(Close, close),
)


def handle(state: StagingState, command: object) -> Outcome:
    """The one door: apply ``command`` to ``state`` (InvalidInput: not a staging command)."""
    return COMMANDS(state, command)
