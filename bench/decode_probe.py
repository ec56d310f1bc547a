"""A decode probe for bench/run.py: one streamed request per engine for a whole run, beside the workload.

The workload's own signal is its completions, one per turn of 32 tokens: an engine's longest gap between
two of them is 0.6-0.9 s with nothing published, so a stall of a few milliseconds cannot show there. A
streamed request gets a token at every decode step of its engine, so the gaps between its tokens are the
engine's step times: a publication that holds the scheduler shows as a longer gap inside its window, at
the resolution of one step. The probe asks for no adapter (the base model) and many tokens with the end
token ignored, so it decodes for the whole run; a stream that ends early (the old path's pause aborts it)
is sent again at once, and the gap across the two counts as a gap. Its requests are counted apart from
the workload's: sent, ended (a stream that finished, or that the old path's pause cut), cut (by the end
of the run) and failed (refused, or broken before any token).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

import aiohttp

__all__ = ["DecodeProbe", "probe_gap", "PROBE_TOKENS"]

#: Tokens a probe stream asks for: more than a run decodes (about 12 s at 20-70 ms a step).
PROBE_TOKENS = 4096


class DecodeProbe:
    """``start()`` one stream per engine URL; ``stop()`` cuts them. ``ticks``: engine name -> the
    instants (``time.monotonic()``) its stream's events arrived; ``counts``: sent, ended (before the
    run did), cut (by the run's end) and failed."""

    def __init__(self, urls: dict[str, str], prompt: list[int]) -> None:
        self.urls = {name: url.rstrip("/") for name, url in urls.items()}
        self.prompt = prompt
        self.ticks: dict[str, list[float]] = {name: [] for name in urls}
        self.counts = {"sent": 0, "ended": 0, "cut": 0, "failed": 0}
        self._tasks: list[asyncio.Task] = []
        self._http: aiohttp.ClientSession | None = None
        self._stopping = False
        self._rids: dict[str, str] = {}  # engine -> its stream's request id now

    async def start(self, first_token_within: float = 5.0) -> None:
        """Every engine's stream sent; returns once each has its first token (or after ``first_token_within``)."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._tasks = [asyncio.create_task(self._stream(name, url)) for name, url in self.urls.items()]
        deadline = time.monotonic() + first_token_within
        while time.monotonic() < deadline and not all(self.ticks.values()):
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Cut every stream, and ask each engine to abort it (a disconnect alone may leave it decoding
        into the next run)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is None:
            return
        try:
            for name, rid in self._rids.items():
                try:
                    async with self._http.post(self.urls[name] + "/abort_request", json={"rid": rid},
                                               timeout=aiohttp.ClientTimeout(total=5)):
                        pass
                except Exception:  # noqa: BLE001 - the disconnect aborts it too
                    pass
        finally:
            await self._http.close()

    async def _tokens(self, url: str) -> int:
        """PROBE_TOKENS, or fewer where the engine's context (its /v1/models ``max_model_len``) is shorter."""
        assert self._http is not None
        try:
            async with self._http.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                limit = int((await r.json())["data"][0]["max_model_len"])
        except Exception:  # noqa: BLE001 - unknown: ask for PROBE_TOKENS (a refusal is counted as failed)
            return PROBE_TOKENS
        return max(1, min(PROBE_TOKENS, limit - len(self.prompt) - 1))

    async def _stream(self, name: str, url: str) -> None:
        assert self._http is not None
        body = {"input_ids": self.prompt, "stream": True,
                "sampling_params": {"max_new_tokens": await self._tokens(url), "temperature": 0, "ignore_eos": True}}
        ticks = self.ticks[name]
        while not self._stopping:
            self.counts["sent"] += 1
            self._rids[name] = body["rid"] = f"lorapub-probe-{uuid.uuid4().hex}"
            got = 0
            try:
                async with self._http.post(url + "/generate", json=body) as r:
                    if r.status == 200:
                        async for line in r.content:
                            if line.startswith(b"data:"):
                                if line.startswith(b"data: [DONE]"):
                                    break
                                ticks.append(time.monotonic())
                                got += 1
            except asyncio.CancelledError:  # the run ended: the stream is cut
                self.counts["cut"] += 1
                raise
            except Exception:  # noqa: BLE001 - counted and shown, never silent
                pass
            if got:
                self.counts["ended"] += 1
            else:  # refused or broken before any token: counted, and not sent again at once
                self.counts["failed"] += 1
                await asyncio.sleep(0.05)


def probe_gap(ticks: dict[str, list[float]], window: tuple[float, float] | None = None) -> float:
    """The longest time between two consecutive probe tokens of one engine (the larger engine's);
    ``window`` keeps the gaps that overlap it. NaN without two tokens on any engine."""
    longest, seen = 0.0, False
    for ts in ticks.values():
        for a, b in zip(ts, ts[1:]):
            if window is not None and (b < window[0] or a > window[1]):
                continue
            seen = True
            longest = max(longest, b - a)
    return longest if seen else math.nan


def probe_tokens(ticks: dict[str, list[float]], windows: list[tuple[float, float]]) -> int:
    """Probe tokens of every engine that arrived inside any of ``windows`` (a token in two
    overlapping windows counts once). Set against the control's count over the same stretches it
    is a decode-rate loss: a sum over every step, not the one longest step, so one long prefill
    of the control's does not hide it."""
    return sum(1 for ts in ticks.values() for t in ts if any(a < t <= b for a, b in windows))
