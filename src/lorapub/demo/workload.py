"""An agentic rollout workload (sessions with tool turns) and the figures it yields.

Used by ``lorapub demo`` and the benchmark. Seeded: the same seed gives the
same arrivals, prompt lengths and turn counts.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Awaitable, Callable, Mapping, Protocol, TypeVar

import attrs

from lorapub.errors import LorapubError


@attrs.define
class RequestRecord:
    session: str
    turn: int
    started: float
    ended: float
    ok: bool
    engine: str | None = None
    lora_id: str | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    version: Any = None  # what version_of(session) named when the turn ended
    version_id: str | None = None  # the version that served it, as the result says (result["lorapub"])
    lag: int | None = None  # its commits behind the default at dispatch (result["lorapub"])
    tokens: int = 0  # new tokens it generated
    group: str | None = None
    rebinds: int = 0  # the session's rebinds to a newer version on purpose (on_stale="rebind"), so far


@attrs.define
class WorkloadSpec:
    sessions: int = 24
    arrival_interval: float = 0.02
    turns: tuple[int, int] = (3, 5)
    prompt_len: tuple[int, int] = (16, 48)
    tool_output_len: tuple[int, int] = (4, 12)
    max_new_tokens: int = 6
    tool_latency: float = 0.01
    seed: int = 0
    group_size: int = 1  # sessions per group (a GRPO prompt group): consecutive sessions share one


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    i = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[i]


@attrs.define
class WorkloadResult:
    records: list[RequestRecord]
    started: float
    ended: float

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def failures(self) -> int:
        return sum(1 for r in self.records if not r.ok)

    def latency(self, q: float) -> float:
        return percentile([r.ended - r.started for r in self.ok], q)

    def longest_gap(self, window: tuple[float, float] | None = None) -> dict[str, float]:
        """Per engine: the longest stretch with no request completing while one was pending.

        Between two consecutive completions at ``a`` and ``b``, the stretch counts from
        ``max(a, earliest start among the requests still pending at a)``: idle time with
        nothing in flight is not a stall, and a request that arrives during a stall and ends
        first does not cut it short. ``window`` keeps the stretches that overlap it.
        """
        gaps: dict[str, float] = {}
        by_engine: dict[str, list[RequestRecord]] = {}
        for r in self.ok:
            by_engine.setdefault(r.engine or "?", []).append(r)
        for engine, recs in by_engine.items():
            recs.sort(key=lambda r: r.ended)
            pending_since = [0.0] * len(recs)  # [i]: the earliest start among recs[i:]
            earliest = float("inf")
            for i in range(len(recs) - 1, -1, -1):
                earliest = pending_since[i] = min(earliest, recs[i].started)
            longest = 0.0
            for i in range(1, len(recs)):
                a, b = max(recs[i - 1].ended, pending_since[i]), recs[i].ended
                if window and (b < window[0] or a > window[1]):
                    continue
                longest = max(longest, b - a)
            gaps[engine] = longest
        return gaps

    def mixed_version_sessions(self) -> int:
        """Sessions served by more than one version, beyond the rebinds they were told of."""
        seen: dict[str, set[tuple[str | None, str | None]]] = {}
        rebinds: dict[str, int] = {}
        for r in self.ok:
            seen.setdefault(r.session, set()).add((r.engine, r.lora_id))
            rebinds[r.session] = max(rebinds.get(r.session, 0), r.rebinds)
        return sum(1 for s, versions in seen.items() if len(versions) > 1 + rebinds[s])

    def rebound_sessions(self) -> int:
        return len({r.session for r in self.ok if r.rebinds})

    def mixed_version_groups(self) -> int:
        """Groups whose members were served by more than one version, beyond the group's rebinds
        (``on_stale="rebind"`` moves a whole group on purpose; its members follow turn by turn)."""
        seen: dict[str, set[str | None]] = {}
        rebinds: dict[str, int] = {}
        for r in self.ok:
            if r.group is not None:
                seen.setdefault(r.group, set()).add(r.version_id or r.lora_id)
                rebinds[r.group] = max(rebinds.get(r.group, 0), r.rebinds)
        return sum(1 for g, versions in seen.items() if len(versions) > 1 + rebinds[g])

    def token_lags(self) -> list[tuple[int | None, int]]:
        """(lag, new tokens) of every completed request: the token-weighted lag distribution."""
        return [(r.lag, r.tokens) for r in self.ok]

    def cached_ratio(self, start: float, end: float) -> float:
        """Cached share of the prompt over ongoing sessions' turns that completed in [start, end]."""
        recs = [r for r in self.ok if r.turn > 0 and start <= r.ended <= end]
        total = sum(r.prompt_tokens for r in recs)
        return sum(r.cached_tokens for r in recs) / total if total else float("nan")


class WorkloadSession(Protocol):
    """What the workload drives: a :class:`lorapub.Session`, an overwrite deployment's session, or a
    benchmark's own (an ``engine`` attribute with a ``name``, where it has one, names the engine that served)."""

    async def generate(self, payload: Mapping[str, object]) -> dict[str, Any]: ...

    async def close(self) -> None: ...


S = TypeVar("S", bound=WorkloadSession)
S_co = TypeVar("S_co", bound=WorkloadSession, covariant=True)


class SessionFactory(Protocol[S_co]):
    """``session_factory(name)``, or ``session_factory(name, group=...)`` for a group's member
    (``Deployment.session`` is one)."""

    def __call__(self, session_id: str, /, *, group: str | None = ...) -> S_co: ...


async def run_workload(
    spec: WorkloadSpec,
    session_factory: SessionFactory[S],
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    stop: asyncio.Event | None = None,
    version_of: Callable[[S], Any] | None = None,
) -> WorkloadResult:
    """``version_of(session)`` names the version that served a turn when the engine's reply
    does not (live SGLang reports no ``lora_id``)."""
    rng = random.Random(spec.seed)
    plans = [
        (
            f"s{i:04d}",
            [rng.randrange(1, 1000) for _ in range(rng.randint(*spec.prompt_len))],
            [[rng.randrange(1, 1000) for _ in range(rng.randint(*spec.tool_output_len))] for _ in range(rng.randint(*spec.turns))],
        )
        for i in range(spec.sessions)
    ]
    records: list[RequestRecord] = []
    started = time.monotonic()

    async def one_session(name: str, prompt: list[int], tools: list[list[int]], group: str | None) -> None:
        session = session_factory(name) if group is None else session_factory(name, group=group)
        context = list(prompt)
        try:
            for turn, tool_output in enumerate(tools):
                if stop is not None and stop.is_set():
                    break
                t0 = time.monotonic()
                rec = RequestRecord(name, turn, t0, t0, False, prompt_tokens=len(context), group=group)
                try:
                    out = await session.generate(
                        {"input_ids": list(context), "sampling_params": {"max_new_tokens": spec.max_new_tokens, "temperature": 0}}
                    )
                    meta = out.get("meta_info", {})
                    served = out.get("lorapub") or {}
                    rec.ok = True
                    rec.version = version_of(session) if version_of else None
                    rec.version_id, rec.lag = served.get("version_id"), served.get("lag")
                    rec.rebinds = int(served.get("rebinds") or 0)
                    rec.lora_id = meta.get("lora_id") or rec.version or rec.version_id
                    rec.tokens = len(out.get("output_ids") or []) or int(meta.get("completion_tokens", 0) or 0)
                    rec.cached_tokens = int(meta.get("cached_tokens", 0))
                    context += list(out.get("output_ids", [])) + tool_output  # the tool turn appends its output
                except LorapubError as e:
                    rec.error = e.code
                engine = getattr(getattr(session, "engine", None), "name", None)
                rec.engine = engine
                rec.ended = time.monotonic()
                records.append(rec)
                if on_record:
                    on_record(rec)
                if not rec.ok:
                    break
                await asyncio.sleep(spec.tool_latency)
        finally:
            await session.close()

    tasks: list[asyncio.Task[None]] = []
    for i, (name, prompt, tools) in enumerate(plans):
        if stop is not None and stop.is_set():
            break
        group = f"g{i // spec.group_size:04d}" if spec.group_size > 1 else None
        tasks.append(asyncio.create_task(one_session(name, prompt, tools, group)))
        if spec.group_size <= 1 or (i + 1) % spec.group_size == 0:  # a group's members start together
            await asyncio.sleep(spec.arrival_interval)
    await asyncio.gather(*tasks)
    return WorkloadResult(records, started, time.monotonic())


async def until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(poll)
