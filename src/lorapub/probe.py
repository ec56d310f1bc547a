"""The numeric READY gate's probe: token sequences with the trainer's reference logprobs, which an
engine must reproduce under the exact version name before its READY is recorded.
See docs/provenance.md, "Numeric READY gate".
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Iterable, Mapping, Sequence

import attrs

from lorapub.errors import EngineError, InvalidInput, OutcomeUnknown
from lorapub.ports import EngineAdmin

__all__ = ["DEFAULT_MEAN_TOLERANCE", "DEFAULT_TOKEN_TOLERANCE", "Probe", "Mismatch", "probe_payload",
           "input_logprobs", "observe", "compare"]

#: Defaults, in nats. Measured live bf16 noise against a float32 reference: mean 0.004, worst token
#: 0.024 (docs/provenance.md, "Measured live"); the headroom is for deeper models' larger noise.
DEFAULT_MEAN_TOLERANCE = 0.05
DEFAULT_TOKEN_TOLERANCE = 1.0


def _sequences(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    try:
        out = tuple(tuple(int(t) if not isinstance(t, bool) else -1 for t in seq) for seq in value)
    except (TypeError, ValueError):
        raise InvalidInput(f"a probe's sequences are sequences of token ids, got {value!r:.80}") from None
    if not out or any(len(seq) < 2 or min(seq) < 0 for seq in out):
        raise InvalidInput("a probe needs at least one sequence, each of two or more token ids >= 0")
    return out


def _logprobs(value: Iterable[Iterable[float]]) -> tuple[tuple[float, ...], ...]:
    try:
        out = tuple(tuple(float(x) for x in row) for row in value)
    except (TypeError, ValueError):
        raise InvalidInput(f"a probe's expected logprobs are rows of floats, got {value!r:.80}") from None
    if any(not math.isfinite(x) or x > 1e-6 for row in out for x in row):
        raise InvalidInput("a probe's expected logprobs are finite and <= 0")
    return out


def _tolerance(instance: object, attribute: "attrs.Attribute[float]", value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= float(value) < math.inf:
        raise InvalidInput(f"Probe.{attribute.name} must be a finite number of nats >= 0, got {value!r}")


@attrs.frozen
class Probe:
    """``sequences[i]`` (token ids) and ``expected[i][j]``: the reference log p(token ``j + 1`` |
    tokens ``0..j``), one per position after the first. The engine passes when the mean absolute
    difference over every position is within ``mean_tolerance`` and no token is off by more than
    ``token_tolerance`` (nats). It travels with its :class:`~lorapub.Snapshot`, outside the digest."""

    sequences: tuple[tuple[int, ...], ...] = attrs.field(converter=_sequences)
    expected: tuple[tuple[float, ...], ...] = attrs.field(converter=_logprobs)
    mean_tolerance: float = attrs.field(default=DEFAULT_MEAN_TOLERANCE, validator=_tolerance)
    token_tolerance: float = attrs.field(default=DEFAULT_TOKEN_TOLERANCE, validator=_tolerance)

    def __attrs_post_init__(self) -> None:
        if len(self.expected) != len(self.sequences) or any(
                len(row) != len(seq) - 1 for row, seq in zip(self.expected, self.sequences)):
            raise InvalidInput("a probe has one expected logprob per token after the first of each sequence")

    @property
    def tokens(self) -> int:
        return sum(len(seq) for seq in self.sequences)


@attrs.frozen
class Mismatch:
    """What a failed probe found: the worst token (sequence, position), its expected and observed
    logprobs, the mean absolute difference, and the tolerances."""

    sequence: int
    position: int
    expected: float
    observed: float
    mean_abs: float
    mean_tolerance: float
    token_tolerance: float

    def details(self) -> dict[str, object]:
        return attrs.asdict(self)

    def describe(self) -> str:
        return (f"worst token: sequence {self.sequence} position {self.position} expected {self.expected:.4f} "
                f"observed {self.observed:.4f} (|d| {abs(self.expected - self.observed):.4f}, tolerance "
                f"{self.token_tolerance:g}); mean |d| {self.mean_abs:.4f} (tolerance {self.mean_tolerance:g})")


def probe_payload(lora_name: str, sequence: Sequence[int]) -> dict[str, Any]:
    """One prefill under the exact version name, asking SGLang for every input token's logprob."""
    return {"input_ids": list(sequence), "lora_path": lora_name,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": 0}


def _value(entry: object) -> float | None:
    """One entry's logprob (None: none, or not a number: a malformed reply, never a TypeError here)."""
    if isinstance(entry, (list, tuple)):  # SGLang: (logprob, token_id, text)
        entry = entry[0] if entry else None
    if isinstance(entry, bool) or not isinstance(entry, (int, float)):
        return None
    return float(entry)


def input_logprobs(reply: Mapping[str, Any], length: int) -> list[float]:
    """The ``length - 1`` input-token logprobs of a ``/generate`` reply (SGLang's
    ``meta_info.input_token_logprobs``; its first entry, for the first token, has none). A reply of
    any other shape is ValueError (:func:`observe` makes it the engine's ENGINE_ERROR)."""
    meta = reply.get("meta_info") if isinstance(reply, Mapping) else None
    found = meta.get("input_token_logprobs") if isinstance(meta, Mapping) else None
    items = list(found) if isinstance(found, (list, tuple)) else []
    if len(items) == length:
        items = items[1:]
    values = [_value(x) for x in items]
    bad = [x for x, v in zip(items, values) if v is None or not math.isfinite(v)]
    if len(values) != length - 1 or bad:
        if not isinstance(meta, Mapping):
            what = f"no meta_info object ({type(reply).__name__} reply)"
        elif not isinstance(found, (list, tuple)):
            what = f"no input token logprob list ({type(found).__name__} in meta_info)"
        elif len(values) != length - 1:
            what = f"{len(values)} input token logprobs for {length} tokens"
        else:
            what = f"{len(bad)} input token logprobs that are not finite numbers (e.g. {bad[0]!r:.60})"
        raise ValueError(f"the engine gave {what}; each must be a number or a (logprob, token_id, text) entry")
    return [float(v) for v in values if v is not None]


async def observe(engine: EngineAdmin, lora_name: str, probe: Probe, deadline: float) -> list[list[float]]:
    """Each of the probe's sequences run on ``engine`` under ``lora_name``: the input-token logprobs it
    computed. No answer within ``deadline`` is OUTCOME_UNKNOWN; an answer without them ENGINE_ERROR."""
    observed = []
    for seq in probe.sequences:
        try:
            async with asyncio.timeout(deadline):
                reply = await engine.generate(probe_payload(lora_name, seq))
        except TimeoutError:
            raise OutcomeUnknown(f"no answer within {deadline:g}s") from None
        try:
            observed.append(input_logprobs(reply, len(seq)))
        except ValueError as e:
            raise EngineError(f"probe: {e}") from None
    return observed


def compare(probe: Probe, observed: Sequence[Sequence[float]]) -> Mismatch | None:
    """None when ``observed`` reproduces the probe within its tolerances, else the mismatch."""
    diffs = [(abs(e - o), i, j, e, o) for i, (exp, obs) in enumerate(zip(probe.expected, observed))
             for j, (e, o) in enumerate(zip(exp, obs))]
    worst = max(diffs)
    mean = sum(d[0] for d in diffs) / len(diffs)
    if mean <= probe.mean_tolerance and worst[0] <= probe.token_tolerance:
        return None
    return Mismatch(worst[1], worst[2] + 1, worst[3], worst[4], mean, probe.mean_tolerance, probe.token_tolerance)
