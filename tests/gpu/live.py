"""Acceptance on live SGLang servers: lorapub's own adapter, registry, publisher, reclaimer and
session service against real, patched SGLang processes on one GPU. No stand-in engine.

    python3 -m tests.gpu.live --out report.json [--root DIR]

Servers (one GPU, three processes): E0 and E1 run lorapub's runtime patch; U runs stock
SGLang with only the read-only ``/lorapub/state`` route, for the clean A-only/B-only
baselines and for the patched-versus-unpatched comparisons. Every section records its
figures or the error it met; ``verdicts()`` turns the report into pass/fail lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import tempfile
import time
import traceback
from collections import Counter
from typing import Any

import aiohttp

from lorapub import CapacityError, Deadlines, Deployment, EngineError, LorapubError, deploy
from lorapub.adapters.sglang_overwrite import SGLangOverwriteAdmin
from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine
from lorapub.wire.routes import RECLAIM_HEADER
from lorapub.demo.workload import WorkloadSpec, run_workload
from tests.gpu import servers as srv
from tests.gpu import provenance_live
from tests.gpu.fixtures import adapter_snapshot, fixture_paths

SEED = 1234
VOCAB = 1024
MAX_NEW = 12  # greedy tokens scored per request
# SGLang 0.5.17's scheduler crashes when a decode batch mixes a request with token_ids_logprob and one
# without ("'list' object has no attribute 'tolist'", seen on the live server), so the numerics use the
# chosen tokens' logprobs only, and their ids: a different token is never "within eps".
ID_WEIGHT = 1000.0
PROMPT_LEN = 96
TOOL_LEN = 12
RUN_TIMEOUT_S = 20  # SGLANG_REQ_RUNNING_TIMEOUT: a request running longer ends with 503 (the 5xx path)
CONTEXT = 16384
DEADLINES = Deadlines(begin=30, bucket=60, end=60, cleanup=60, commit=10, reclaim=120)


# -- raw HTTP ---------------------------------------------------------------------------------
class Http:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.s = session

    async def post(self, url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 120) -> tuple[int, Any]:
        async with self.s.post(url + path, json=body, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def state(self, url: str) -> dict:
        async with self.s.get(url + "/lorapub/state") as r:
            return await r.json()

    async def refs(self, url: str, name: str) -> int | None:
        entry = (await self.state(url))["adapters"].get(name)
        return None if entry is None else entry["refs"]

    async def flush(self, url: str) -> None:
        for _ in range(50):
            status, _ = await self.post(url, "/flush_cache", {})
            if status == 200:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{url}: /flush_cache kept failing")

    async def load(self, url: str, name: str, path: str, pinned: bool = True) -> tuple[int, Any]:
        return await self.post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": pinned})

    async def unload(self, url: str, name: str, reclaim_id: str | None = None, timeout: float = 120) -> tuple[int, Any]:
        headers = {RECLAIM_HEADER: reclaim_id} if reclaim_id else {}
        return await self.post(url, "/unload_lora_adapter", {"lora_name": name}, headers, timeout)

    async def generate(self, url: str, ids: list[int], lora: str | None, max_new: int = MAX_NEW, *,
                       sp: dict | None = None, timeout: float = 120, **extra) -> tuple[int, Any]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **(sp or {})},
                "return_logprob": True, **extra}
        if lora:
            body["lora_path"] = lora
        return await self.post(url, "/generate", body, timeout=timeout)


def request_body(ids: list[int], max_new: int = MAX_NEW) -> dict:
    return {"input_ids": list(ids), "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
            "return_logprob": True}


def vec(out: dict) -> list[float]:
    """The greedy tokens' logprobs, then their ids (weighted: another token is never within eps)."""
    meta = out["meta_info"]
    values = [_logprob(entry) for entry in meta.get("output_token_logprobs") or []]
    values += [ID_WEIGHT * int(t) for t in out.get("output_ids") or []]
    if not values:
        raise ValueError(f"no logprobs in the response: {sorted(meta)}")
    return values


def _logprob(entry: Any) -> float:
    """SGLang returns (logprob, token_id, text) triples; accept a bare number or a dict too."""
    if isinstance(entry, dict):
        return float(entry.get("logprob"))
    if isinstance(entry, (list, tuple)):
        return float(entry[0])
    return float(entry)


def max_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


# -- lorapub's engines, instrumented only to count calls and to inject a fault -------------------
class Instrumented:
    """Forwards every call to lorapub's SGLangWireEngine; counts them; can hold or fail ``end``.
    Its transport is the inner engine's (the deployment hands it over)."""

    def __init__(self, inner: SGLangWireEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: Counter = Counter()
        self.end_gate: asyncio.Event | None = None
        self.fail_end = 0
        self.ready = asyncio.Event()

    async def _call(self, op: str, *args):
        self.calls[op] += 1
        return await getattr(self.inner, op)(*args)

    @property
    def transport(self):
        return self.inner.transport

    def use_transport(self, transport) -> None:
        self.inner.use_transport(transport)

    async def incarnation(self):
        return await self._call("incarnation")

    async def begin(self, request):
        return await self._call("begin", request)

    async def receive_bucket(self, token, index, payload):
        return await self._call("receive_bucket", token, index, payload)

    async def end(self, token):
        self.calls["end"] += 1
        if self.fail_end:
            self.fail_end -= 1
            raise EngineError(f"{self.name}: injected failure at end")
        if self.end_gate is not None:
            await self.end_gate.wait()
        receipt = await self.inner.end(token)
        self.ready.set()
        return receipt

    async def cleanup(self, token, lora_name):
        return await self._call("cleanup", token, lora_name)

    async def reclaim(self, lora_name, reclaim_id):
        return await self._call("reclaim", lora_name, reclaim_id)

    async def generate(self, payload):
        self.calls["generate"] += 1
        return await self.inner.generate(payload)

    async def state(self):
        return await self.inner.state()


def wanted(section: str) -> bool:
    """LORAPUB_GPU_SECTIONS (comma-separated: helper, epsilon, which brings the core sections, wire,
    provenance) runs only those; unset, all of them."""
    only = os.environ.get("LORAPUB_GPU_SECTIONS")
    return not only or section in {x.strip() for x in only.split(",")}


# -- the run -----------------------------------------------------------------------------------
class Run:
    def __init__(self, root: str, out_dir: str, paths: dict[str, str], report_path: str | None = None) -> None:
        self.root, self.out_dir, self.paths, self.report_path = root, out_dir, paths, report_path
        self.report: dict[str, Any] = {"sections": {}, "errors": {}}
        self.snaps = {k: adapter_snapshot(paths[k]) for k in "ABC"}
        self.rng = random.Random(SEED)
        self.baseline_cache: dict[tuple, list[float]] = {}

    async def section(self, name: str, coro) -> None:
        t0 = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            self.report["sections"][name] = await coro
        except BaseException as e:  # keep going: one section's failure must not hide the others' figures
            self.report["errors"][name] = "".join(traceback.format_exception(e))[-4000:]
            print(self.report["errors"][name], flush=True)
        self.report.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 2)
        self.save()

    def save(self) -> None:
        """Written after every section: a run cut short still leaves what it measured."""
        if self.report_path:
            with open(self.report_path, "w") as f:
                json.dump(self.report, f, indent=1, default=str)

    # -- baselines on U ----------------------------------------------------------------------
    async def baseline(self, version: str, ids: list[int]) -> list[float]:
        key = (version, tuple(ids))
        if key not in self.baseline_cache:
            await self.http.flush(self.U.url)
            status, out = await self.http.generate(self.U.url, ids, f"only-{version}")
            assert status == 200, (status, out)
            self.baseline_cache[key] = vec(out)
        return self.baseline_cache[key]

    async def epsilon(self) -> dict:
        U, http = self.U, self.http
        for v in "ABC":
            status, body = await http.load(U.url, f"only-{v}", self.paths[v], pinned=False)
            assert status == 200, body
        prompt = self.prompt
        runs = []
        for _ in range(3):
            await http.flush(U.url)
            runs.append(vec((await http.generate(U.url, prompt, "only-A"))[1]))
        instability = max(max_diff(r, runs[0]) for r in runs)
        self.baseline_cache[("A", tuple(prompt))] = runs[0]
        base_b = await self.baseline("B", prompt)
        separation = max_diff(runs[0], base_b)
        cache_delta = 0.0
        for split in (16, 48, PROMPT_LEN - 1):
            await http.flush(U.url)
            await http.generate(U.url, prompt[:split], "only-A")
            status, warm = await http.generate(U.url, prompt, "only-A")
            cache_delta = max(cache_delta, max_diff(vec(warm), runs[0]))
        await http.flush(U.url)
        batched = await asyncio.gather(*(http.generate(U.url, prompt if i == 0 else tokens(self.rng, PROMPT_LEN), "only-A")
                                         for i in range(8)))
        batch_delta = max_diff(vec(batched[0][1]), runs[0])
        # A served by lorapub on E0/E1 (fresh caches) against the clean A-only server
        cross = 0.0
        for e in (self.E0, self.E1):
            await http.flush(e.url)
            status, out = await http.generate(e.url, prompt, self.names["A"])
            assert status == 200, out
            self.report["sample_meta_info"] = {k: str(v)[:300] for k, v in out["meta_info"].items()}
            cross = max(cross, max_diff(vec(out), runs[0]))
        # Fixed rule, decided before the scenario runs: bf16 noise of SGLang itself, with margin.
        eps = max(10 * instability, 3 * cache_delta, 3 * batch_delta, 3 * cross, 1e-3)
        self.eps = eps
        return {"instability": instability, "cached_vs_cold": cache_delta, "batched_vs_alone": batch_delta,
                "engine_vs_clean_server": cross, "separation_A_B": separation, "epsilon": eps,
                "rule": "max(10*instability, 3*cached_vs_cold, 3*batched_vs_alone, 3*engine_vs_clean_server, 1e-3)",
                "separated": separation > 10 * eps}

    # -- the S_old / S_mid / S_new scenario ------------------------------------------------------
    async def scenario(self) -> dict:
        dep, engines, http = self.dep, self.engines, self.http
        sessions = {n: dep.session(n) for n in ("S_old", "S_mid", "S_new")}
        contexts = {n: list(self.prompt) for n in sessions}
        checks: list[dict] = []
        self.sessions, self.contexts = sessions, contexts

        async def checked_turn(name: str, engine: str, label: str) -> dict:
            s = sessions[name]
            s.engine = engines[engine]
            out = await s.generate(request_body(contexts[name]))
            version = s.binding.version.version_id
            other = "B" if version == "A" else "A"
            got = vec(out)
            checks.append({"session": name, "turn": label, "engine": engine, "version": version,
                           "cached_tokens": out["meta_info"].get("cached_tokens"),
                           "diff": max_diff(got, await self.baseline(version, contexts[name])),
                           "diff_other": max_diff(got, await self.baseline(other, contexts[name]))})
            return out

        first = await checked_turn("S_old", "e0", "first")
        # publish B while S_old keeps going; E1's end is held so that only E0 is READY for a while
        engines["e1"].end_gate = asyncio.Event()
        engines["e0"].ready.clear()
        progress: list[float] = []
        stop = asyncio.Event()
        old_ids = contexts["S_old"] + first["output_ids"] + tokens(self.rng, TOOL_LEN)

        async def keep_old_going():
            while not stop.is_set():
                await sessions["S_old"].generate(request_body(old_ids, 8))
                progress.append(time.monotonic())

        background = asyncio.create_task(keep_old_going())
        t_pub = time.monotonic()
        publishing = asyncio.create_task(dep.publish(self.snaps["B"], "B"))
        await asyncio.wait_for(engines["e0"].ready.wait(), 60)
        state = await dep.state()
        default_while_e0_ready = state.default.version_id
        await checked_turn("S_mid", "e1", "first (E0 READY only)")
        await checked_turn("S_mid", "e0", "second (E0 READY only)")
        engines["e1"].end_gate.set()
        self.pubs["B"] = await publishing
        engines["e1"].end_gate = None
        t_pub_end = time.monotonic()
        stop.set()
        await background
        await checked_turn("S_new", "e1", "first (after commit)")
        marks = [t_pub] + [p for p in progress if t_pub <= p <= t_pub_end] + [t_pub_end]
        for k in range(2):  # tool turns on both engines
            for name in sessions:
                contexts[name] = contexts[name] + tokens(self.rng, TOOL_LEN)
                engine = "e0" if (k + len(name) + ord(name[2])) % 2 else "e1"
                out = await checked_turn(name, engine, f"tool turn {k + 1}")
                contexts[name] = contexts[name] + out["output_ids"]
        for name in sessions:  # resume: the agentic layer sends the same request again, on either engine
            await checked_turn(name, "e1", "resume (same request again)")
            await checked_turn(name, "e0", "resume on the other engine")
        return {"checks": checks, "bindings": {n: s.binding.version.version_id for n, s in sessions.items()},
                "default_while_only_e0_ready": default_while_e0_ready,
                "S_old_requests_during_B_publication": len(marks) - 2,
                "S_old_longest_gap_during_B_publication_ms": 1000 * max(b - a for a, b in zip(marks, marks[1:])),
                "publication_B": report_of(self.pubs["B"])}

    # -- KV isolation both ways ------------------------------------------------------------------
    async def kv_isolation(self) -> dict:
        http, out = self.http, {}
        prompt = tokens(random.Random(SEED + 1), PROMPT_LEN)

        def isolated(first_cached: int) -> bool:
            return first_cached == 0

        for server, first_v, second_v in ((self.E0, "A", "B"), (self.E1, "B", "A")):
            await http.flush(server.url)  # an independent initial cache on each engine
            gen = lambda v: http.generate(server.url, prompt, self.names[v])  # noqa: E731
            (_, w1), (_, w2), (_, one), (_, two) = [await gen(v) for v in (first_v, first_v, second_v, second_v)]
            cold = await self.baseline(second_v, prompt)
            out[f"{server.name}: {first_v} warm then {second_v}"] = {
                f"{first_v}_first_cached": w1["meta_info"]["cached_tokens"],
                f"{first_v}_repeat_cached": w2["meta_info"]["cached_tokens"],
                f"first_{second_v}_cached": one["meta_info"]["cached_tokens"],
                f"first_{second_v}_vs_cold": max_diff(vec(one), cold),
                f"repeat_{second_v}_cached": two["meta_info"]["cached_tokens"],
                f"repeat_{second_v}_vs_cold": max_diff(vec(two), cold),
                "isolated": isolated(one["meta_info"]["cached_tokens"]),
                # negative control: the same check on a pair that shares its cache must say "not isolated"
                "negative_control_same_version_isolated": isolated(w2["meta_info"]["cached_tokens"]),
            }
        await http.flush(self.E0.url)
        (_, b1), (_, b2) = [await http.generate(self.E0.url, prompt, None) for _ in range(2)]
        out["negative_control_base_model_repeat_cached"] = b2["meta_info"]["cached_tokens"]
        return out

    # -- C rejected, A reclaimed, a partial failure cleaned ---------------------------------------------
    async def lifecycle(self) -> dict:
        dep, engines, http, out = self.dep, self.engines, self.http, {}
        before = {n: Counter(e.calls) for n, e in engines.items()}
        states_before = {n: (await e.state())["adapters"] for n, e in engines.items()}
        try:
            await dep.publish(self.snaps["C"], "C")
            out["C_while_A_bound"] = "accepted"
        except CapacityError as e:
            out["C_while_A_bound"] = e.code
        out["engine_calls_for_C"] = {n: dict(e.calls - before[n]) for n, e in engines.items()}
        states_after = {n: (await e.state())["adapters"] for n, e in engines.items()}
        out["engine_state_unchanged_by_C"] = all(states_after[n].keys() == states_before[n].keys() for n in engines)
        for name in ("S_old", "S_mid"):
            await self.sessions[name].close()
        await dep.settle()
        state = await dep.state()
        name_a = self.names["A"]
        out["A_after_sessions_closed"] = state.versions[self.pubs["A"].version].state.value
        out["A_loaded_after"] = {e.name: name_a in (await http.state(e.url))["adapters"] for e in (self.E0, self.E1)}
        out["A_physical_unloads"] = {e.name: e.unload_events(name_a) for e in (self.E0, self.E1)}
        status, body = await http.generate(self.E0.url, self.prompt, name_a)
        out["late_request_for_A"] = {"status": status, "error": str(body)[:200],
                                     "reloaded": name_a in (await http.state(self.E0.url))["adapters"],
                                     "reload_logged": "Reloading evicted adapter" in self.E0.log()}
        engines["e1"].fail_end = 1
        try:
            await dep.publish(self.snaps["C"], "C")
            out["C_with_e1_failure"] = "published"
        except LorapubError as e:
            out["C_with_e1_failure"] = e.code
        state = await dep.state()
        c = next(v for v in state.versions.values() if v.key.version_id == "C")
        out["C_state"] = c.state.value
        out["default_after_failure"] = state.default.version_id
        out["C_left_on_engines"] = {e.name: [n for n in (await http.state(e.url))["adapters"] if "@1-C-" in n]
                                    for e in (self.E0, self.E1)}
        s_new = self.sessions["S_new"]
        s_new.engine = engines["e0"]
        after = await s_new.generate(request_body(self.contexts["S_new"]))
        out["S_new_after_failure_diff"] = max_diff(vec(after), await self.baseline("B", self.contexts["S_new"]))
        self.pubs["C2"] = await dep.publish(self.snaps["C"], "C2")
        await s_new.close()
        await dep.settle()
        state = await dep.state()
        out["B_after_S_new_closed"] = state.versions[self.pubs["B"].version].state.value
        out["publications"] = {k: report_of(r) for k, r in self.pubs.items()}
        return out

    # -- the three patch behaviours, patched (E0) and unpatched (U) side by side ------------------------
    async def patch_behaviour(self) -> dict:
        http, out = self.http, {}
        for v in "ABC":  # the baselines are done: free U's slots
            await http.unload(self.U.url, f"only-{v}")
        probe = "relax_policy_lora@97-probe-000000000000"
        for server in (self.E0, self.U):
            row: dict = {}
            status, body = await http.load(server.url, probe, self.paths["A"], pinned=True)
            row["load"] = status
            status, body = await http.unload(server.url, probe)  # an ordinary unload, no reclaim id
            row["ordinary_unload_of_managed_pinned"] = {"status": status, "still_loaded": probe in (await http.state(server.url))["adapters"]}
            if row["ordinary_unload_of_managed_pinned"]["still_loaded"]:
                await http.unload(server.url, probe, reclaim_id="reclaim-probe")
            status, body = await http.generate(server.url, self.prompt, probe)  # a request after reclaim
            row["request_after_reclaim"] = {"status": status, "error": str(body)[:160] if status != 200 else None,
                                            "reloaded": probe in (await http.state(server.url))["adapters"],
                                            "reload_logged": f"Reloading evicted adapter: {probe}" in server.log()}
            if row["request_after_reclaim"]["reloaded"]:
                await http.unload(server.url, probe, reclaim_id="cleanup-probe")
            out[f"{server.name} ({'patched' if server.patched else 'unpatched'})"] = row
        rate = await self.decode_rate(self.E0)
        out["decode_tokens_per_s"] = rate
        results = await asyncio.gather(self.prevalidation(self.E0, rate), self.prevalidation(self.U, rate),
                                       return_exceptions=True)
        for server, r in zip((self.E0, self.U), results):
            key = f"prevalidation {server.name} ({'patched' if server.patched else 'unpatched'})"
            out[key] = r if not isinstance(r, BaseException) else {"error": "".join(traceback.format_exception(r))[-1500:]}
        return out

    async def decode_rate(self, server) -> float:
        t0 = time.monotonic()
        status, _ = await self.http.generate(server.url, self.prompt[:16], None, max_new=512, sp={"ignore_eos": True})
        return 512 / (time.monotonic() - t0)

    async def prevalidation(self, server, rate: float) -> dict:
        """RFC pre-validation on one server: refs on every terminal path, unload held by a running request.

        The two adapters are loaded unpinned: SGLang refuses to pin every slot of the batch."""
        row: dict = {}
        try:
            await self._prevalidation(server, rate, row)
        except BaseException as e:  # keep what was measured before the failure (an unpatched server may die)
            row["error"] = "".join(traceback.format_exception(e))[-800:]
            row["server_alive"] = server.alive()
        finally:
            if server.patched and server.alive():
                for name in list((await self.http.state(server.url))["adapters"]):
                    if "@9" in name:  # free the slots for the online run
                        await self.http.unload(server.url, name, reclaim_id="teardown-prevalidation")
        return row

    async def _prevalidation(self, server, rate: float, row: dict) -> None:
        http, url = self.http, server.url
        mx = f"relax_policy_lora@96-paths-{'%012d' % server.port}"
        m1 = f"relax_policy_lora@95-prevalidate-{'%06d' % server.port}"
        reclaim = "reclaim-prevalidation" if server.patched else None
        assert (await http.load(url, mx, self.paths["A"], pinned=False))[0] == 200
        ids = self.prompt[:16]
        trace = [("loaded", await http.refs(url, mx))]
        status, _ = await http.generate(url, list(range(1, 40)) * 430, mx, max_new=4)  # 16770 tokens > context
        await asyncio.sleep(0.5)
        trace.append((f"400 over context length (status {status})", await http.refs(url, mx)))
        # a client that disconnects mid-stream
        try:
            async with http.s.post(url + "/generate", json={"input_ids": ids, "lora_path": mx, "stream": True,
                                                             "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
                async for _ in r.content.iter_any():
                    break
        except Exception as e:  # noqa: BLE001 - we close it ourselves
            trace.append(("disconnect error", repr(e)))
        await asyncio.sleep(4.0)  # SGLang aborts a disconnected stream after 2 s
        trace.append(("client disconnected mid-stream", await http.refs(url, mx)))
        rid = f"abort-me-{server.port}"
        aborted = asyncio.create_task(http.generate(url, ids, mx, max_new=3000, sp={"ignore_eos": True}, rid=rid))
        await asyncio.sleep(1.0)
        await http.post(url, "/abort_request", {"rid": rid})
        status, body = await aborted
        await asyncio.sleep(0.5)
        finish = (body.get("meta_info", {}).get("finish_reason") or {}).get("type") if isinstance(body, dict) else None
        trace.append((f"aborted by /abort_request (status {status}, finish {finish})", await http.refs(url, mx)))
        row["mx_refs_trace"] = trace
        row["log_state_deleted_outputs"] = server.log().count("but the state was deleted in TokenizerManager")
        # r_503 dies at the running timeout (a 503 through the batch-output path); r_long, started 2 s
        # later, runs 2 s past it and ends the same way; r_short ends normally in between.
        assert (await http.load(url, m1, self.paths["A"], pinned=False))[0] == 200
        t0 = time.monotonic()
        endless = {"ignore_eos": True}
        r_503 = asyncio.create_task(http.generate(url, ids, m1, max_new=CONTEXT - 64, sp=endless))
        await asyncio.sleep(2.0)
        long_tokens = CONTEXT - 64
        r_long = asyncio.create_task(http.generate(url, ids, m1, max_new=long_tokens, sp=endless))
        await asyncio.sleep(0.5)
        refs = [("r_503 + r_long running", await http.refs(url, m1))]
        row["m1_refs_trace"] = refs
        status, _ = await http.generate(url, ids, m1, max_new=8)
        refs.append((f"r_short ended ({status})", await http.refs(url, m1)))
        status_503, body_503 = await r_503
        t_503 = time.monotonic() - t0
        await asyncio.sleep(0.2)
        refs.append((f"r_503 ended ({status_503})", await http.refs(url, m1)))
        t_unload = time.monotonic() - t0
        unloading = asyncio.create_task(http.unload(url, m1, reclaim_id=reclaim))
        await asyncio.sleep(0.3)
        row["unload_started_s"] = round(t_unload, 2)
        row["r_503_status"] = status_503
        st = await http.state(url)
        held = {"unload_done": unloading.done(), "still_registered": m1 in st["adapters"],
                "pending": m1 in st.get("pending_unloads", {}), "r_long_running": not r_long.done()}
        row["while_r_long_runs"] = held
        long_status, long_body = await r_long
        t_long = time.monotonic() - t0
        unload_status, unload_body = await unloading
        t_unloaded = time.monotonic() - t0
        row.update({
            "m1_refs_trace": refs, "r_503_status": status_503, "r_503_ended_s": round(t_503, 2),
            "unload_started_s": round(t_unload, 2), "while_r_long_runs": held,
            "r_long": {"status": long_status, "tokens": long_tokens, "ended_s": round(t_long, 2),
                       "error": str(long_body)[:200] if long_status != 200 else None},
            "unload": {"status": unload_status, "returned_s": round(t_unloaded, 2)},
            "physical_unloads_logged": server.unload_events(m1),
            "unload_returned_after_r_long": t_unloaded >= t_long - 0.05,
        })
        # the leaked-ref name: a patched server unloads it; an unpatched one blocks in wait_for_unload
        try:
            status, _ = await http.unload(url, mx, reclaim_id=reclaim and "reclaim-mx", timeout=8)
            row["unload_mx"] = status
        except asyncio.TimeoutError:
            row["unload_mx"] = "blocked (wait_for_unload never returned within 8 s)"
        row["server_alive"] = server.alive()

    # -- online: lorapub, switch off (pause/flush/overwrite) and a control, one workload ------------------
    async def online(self) -> dict:
        spec = WorkloadSpec(sessions=192, arrival_interval=0.02, turns=(6, 10), prompt_len=(64, 256),
                            tool_output_len=(8, 32), max_new_tokens=32, tool_latency=0.2, seed=SEED)
        engines = self.fresh_engines("online")
        # a fresh epoch: epoch 1's last version leaves the engines first (a test teardown, with its reclaim id)
        for e in (self.E0, self.E1):
            await self.http.unload(e.url, self.pubs["C2"].lora_name, reclaim_id="teardown-epoch-1")
        dep = await Deployment(engines, epoch=2, transport=HTTPBytes(),
                               deadlines=DEADLINES, bucket_cap_bytes=64 << 10).start()
        await dep.publish(self.snaps["A"], "A")
        runs = {}
        bound = lambda s: s.binding.lora_name if s.binding else None  # noqa: E731
        runs["control"] = await self.one_run(spec, dep.session, engines, publish=None, dep=dep, version_of=bound)
        runs["lorapub"] = await self.one_run(spec, dep.session, engines, publish=lambda: dep.publish(self.snaps["B"], "B"),
                                             dep=dep, version_of=bound)
        await dep.settle()
        state = await dep.state()
        runs["lorapub"]["A_after_run"] = next(v.state.value for v in state.versions.values() if v.key.version_id == "A")
        admins = {n: SGLangOverwriteAdmin(n, s.url) for n, s in (("e0", self.E0), ("e1", self.E1))}
        legacy = await deploy(admins, epoch=3, enabled=False, stash_dir=os.path.join(self.root, "legacy"))
        self.to_close += [dep, legacy, *(e.inner for e in engines.values()), *admins.values()]
        await legacy.publish(self.snaps["A"], "A")
        # the fixed name serves whatever was loaded last: its version is the publisher's update count
        runs["switch_off"] = await self.one_run(spec, legacy.session, engines, publish=lambda: legacy.publish(self.snaps["B"], "B"),
                                                dep=None, version_of=lambda s: legacy.publisher.updates)
        for run in runs.values():
            run.pop("_records", None), run.pop("_sessions", None)
        return {"spec": {k: getattr(spec, k) for k in ("sessions", "arrival_interval", "turns", "prompt_len",
                                                        "tool_output_len", "max_new_tokens", "tool_latency")},
                "runs": runs, "compare": compare(runs)}

    async def relax_route(self) -> dict:
        """On SGLang 0.5.17 with Relax's patch: Relax's same-name replace route
        (/update_lora_from_distributed) refuses a name lorapub manages, and the version stays served."""
        out = {}
        for s in (self.E0, self.E1):
            loaded = [n for n in (await self.http.state(s.url))["adapters"] if n.startswith("relax_policy_lora@")]
            if not loaded:
                out[s.name] = {"error": "no managed version loaded to check against"}
                continue
            name = loaded[0]
            status, text = await _post(s.url + "/update_lora_from_distributed", {
                "lora_name": name, "config_dict": {"r": 8}, "names": [], "dtypes": [], "shapes": [], "pinned": True})
            state = await self.http.state(s.url)
            out[s.name] = {"lora_name": name, "status": status, "answer": text[:300],
                           "refused_managed": status == 400 and "managed by lorapub" in text,
                           "still_loaded": name in state["adapters"], "sglang": state.get("sglang")}
        return out

    async def wire(self) -> dict:
        """The adapter's bytes over the wire into the patched servers (engine-side staging): for
        each transport, publish A's snapshot as a new version to E0/E1 and compare both engines'
        outputs with A loaded from disk on U (within eps); the stash is freed after reclaim."""
        from lorapub.adapters.sglang_wire import SameHostIPC

        out: dict = {}
        transports = {"http_bytes_dir": HTTPBytes(load="dir"), "http_bytes_tensors": HTTPBytes(load="tensors"),
                      "same_host_ipc_tensors": SameHostIPC()}
        base = await self.baseline("A", self.prompt)
        for epoch, (label, transport) in enumerate(transports.items(), start=10):
            for e in (self.E0, self.E1):  # a fresh epoch: what earlier runs left loaded leaves first
                for name in list((await self.http.state(e.url))["adapters"]):
                    await self.http.unload(e.url, name, reclaim_id=f"teardown-{name}")
            engines = {n: SGLangWireEngine(n, s.url, probe_timeout=60) for n, s in (("e0", self.E0), ("e1", self.E1))}
            row: dict = {}
            try:
                dep = await Deployment(engines, epoch=epoch, deadlines=DEADLINES, bucket_cap_bytes=64 << 10,
                                       reconcile_interval=None, transport=transport).start()
                t0 = time.monotonic()
                pub = await dep.publish(self.snaps["A"], "W")
                row["publish_ms"] = round((time.monotonic() - t0) * 1000, 1)
                row["phases_ms"] = {p: round(v * 1000, 1) for p, v in pub.phases.items()}
                diffs = {}
                for n, srv_ in (("e0", self.E0), ("e1", self.E1)):
                    await self.http.flush(srv_.url)
                    status, body = await self.http.generate(srv_.url, self.prompt, pub.lora_name)
                    assert status == 200, (status, body)
                    diffs[n] = max_diff(vec(body), base)
                row["diff_vs_disk_loaded_A"] = diffs
                row["within_eps"] = all(d <= self.eps for d in diffs.values())
                row["stash_after_publish"] = {n: (await self.http.state(s_.url)).get("staging")
                                              for n, s_ in (("e0", self.E0), ("e1", self.E1))}
                await dep.publish(self.snaps["B"], "W2")  # W retires unbound: reclaimed
                await dep.settle()
                await dep.reconcile()
                state = await dep.state()
                row["W_after"] = next(v.state.value for v in state.versions.values() if v.key.version_id == "W")
                row["stash_after_reclaim"] = {n: (await self.http.state(s_.url)).get("staging")
                                              for n, s_ in (("e0", self.E0), ("e1", self.E1))}
                row["W_stash_freed"] = all(
                    st is not None and not any(k.split("#")[0] == f"{epoch}-W" for k in st.get("attempts", {}))
                    for st in row["stash_after_reclaim"].values())
                await dep.close()
            except BaseException as e:
                row["error"] = "".join(traceback.format_exception(e))[-2000:]
            finally:
                for eng in engines.values():
                    await eng.close()
            out[label] = row
        return out

    async def router(self) -> dict:
        """Behind the real SGLang router (cache_aware), as Relax deploys it: generations go to
        the router with each session's exact lora_path; publication and reclaim go to the
        workers directly. Reports the cached-token ratio per version."""
        import subprocess
        import sys

        from lorapub.adapters.sglang_router import RouterRouting, SGLangRouter, router_command

        for e in (self.E0, self.E1):  # a fresh epoch: what earlier sections left loaded leaves first
            for name in list((await self.http.state(e.url))["adapters"]):
                await self.http.unload(e.url, name, reclaim_id=f"teardown-{name}")
        port = 30400
        cmd = router_command([self.E0.url, self.E1.url], port=port, python=sys.executable,
                             extra=("--prometheus-host", "127.0.0.1", "--prometheus-port", "29555", "--log-level", "warn"))
        log = open(os.path.join(self.out_dir, "router.log"), "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        router = SGLangRouter(f"http://127.0.0.1:{port}")
        try:
            t0 = time.monotonic()
            while True:
                try:
                    workers = await router.workers()
                    if len(workers) == 2:
                        break
                except LorapubError:
                    pass
                if proc.poll() is not None or time.monotonic() - t0 > 60:
                    raise RuntimeError(f"router did not come up (rc {proc.poll()})")
                await asyncio.sleep(0.2)
            boot = time.monotonic() - t0
            engines = self.fresh_engines("router")
            dep = await Deployment(engines, epoch=4, transport=HTTPBytes(), deadlines=DEADLINES,
                                   bucket_cap_bytes=64 << 10, router=RouterRouting(router)).start()
            await dep.publish(self.snaps["A"], "A")
            spec = WorkloadSpec(sessions=96, arrival_interval=0.04, turns=(4, 8), prompt_len=(64, 256),
                                tool_output_len=(8, 32), max_new_tokens=16, tool_latency=0.1, seed=SEED + 4)
            bound = lambda s: s.binding.lora_name if s.binding else None  # noqa: E731
            run = await self.one_run(spec, dep.session, engines, publish=lambda: dep.publish(self.snaps["B"], "B"),
                                     dep=dep, version_of=bound)
            await dep.settle()
            per_version: dict = {}
            for r in run.pop("_records", []):
                pv = per_version.setdefault(r["version"], {"requests": 0, "prompt": 0, "cached": 0})
                pv["requests"] += 1
                pv["prompt"] += r["prompt"]
                pv["cached"] += r["cached"]
            for pv in per_version.values():
                pv["cached_token_ratio"] = round(pv["cached"] / pv["prompt"], 3) if pv["prompt"] else None
            state = await dep.state()
            await dep.close()
            versions_per_session: dict = {}
            for r in run.pop("_sessions", []):
                versions_per_session.setdefault(r[0], set()).add(r[1])
            run["sessions_on_more_than_one_version"] = sum(1 for v in versions_per_session.values() if len(v) > 1)
            return {"router_boot_s": round(boot, 2), "workers": workers, "run": run, "per_version": per_version,
                    "A_after_run": next(v.state.value for v in state.versions.values() if v.key.version_id == "A"),
                    "command": " ".join(cmd[1:])}
        finally:
            await router.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()

    def fresh_engines(self, tag: str) -> dict:
        return {n: Instrumented(SGLangWireEngine(n, s.url, probe_timeout=60)) for n, s in (("e0", self.E0), ("e1", self.E1))}

    async def one_run(self, spec, session_factory, engines, *, publish, dep, version_of) -> dict:
        occupancy: list[int] = []
        stop = asyncio.Event()
        active = Counter()

        async def sample():
            while not stop.is_set():
                if dep is not None:
                    occupancy.append((await dep.state()).slots_held)
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        workload = asyncio.create_task(run_workload(spec, session_factory, version_of=version_of))
        pub: dict = {}
        if publish is not None:
            await asyncio.sleep(2.0)
            t_pub = time.monotonic()
            result = await publish()
            t_end = time.monotonic()
            pub = {"start_s": t_pub - t0, "seconds": t_end - t_pub}
            if hasattr(result, "phases"):
                pub.update(report_of(result))
            else:
                pub["paused_s"] = result
        result = await workload
        stop.set()
        await sampler
        window = (t0 + pub.get("start_s", 2.0), t0 + pub.get("start_s", 2.0) + max(pub.get("seconds", 0.0), 0.5) + 1.0)
        recs = result.records
        return {
            "requests": len(recs), "failures": result.failures,
            "errors": dict(Counter(r.error for r in recs if not r.ok)),
            "latency_ms": {str(q): 1000 * result.latency(q) for q in (50, 95, 99)},
            "longest_gap_ms": {k: 1000 * v for k, v in result.longest_gap().items()},
            "longest_gap_in_publication_window_ms": {k: 1000 * v for k, v in result.longest_gap(window).items()},
            "mixed_version_sessions": result.mixed_version_sessions(),
            "max_concurrent_sessions": max_concurrent(recs),
            "cached_token_ratio": result.cached_ratio(result.started, result.ended),
            "cached_token_ratio_in_window": result.cached_ratio(*window),
            "slots_held_max": max(occupancy) if occupancy else None,
            "publication": pub, "seconds": result.ended - result.started,
            "_records": [{"version": r.version, "prompt": r.prompt_tokens, "cached": r.cached_tokens}
                         for r in recs if r.ok and r.prompt_tokens and r.turn > 0],
            "_sessions": [(r.session, r.version) for r in recs if r.ok],
        }

    async def prepare_helper(self) -> dict:
        """The preparing helper process beside E1's scheduler (docs/sglang-patch.md, "Prepared loads"): killed
        while idle, the next load still succeeds (a new helper); killed while it prepares, that load fails
        cleanly or lands, a retry lands, and the server serves both adapters throughout."""
        E1, http = self.E1, self.http
        started = re.compile(r"started the preparing helper process \(pid (\d+)\)")

        def helpers() -> list[int]:
            return [int(m.group(1)) for m in started.finditer(E1.log())]

        def alive(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().split(")")[-1].split()[0] != "Z"
            except OSError:
                return False

        out: dict[str, Any] = {"helpers_at_start": helpers()}
        first = out["helpers_at_start"][-1]
        os.kill(first, signal.SIGKILL)
        for _ in range(100):
            if not alive(first):
                break
            await asyncio.sleep(0.05)
        status, body = await http.load(E1.url, "helper-x", self.paths["B"], pinned=False)
        out["idle_kill_then_load"] = [status, str(body)[:300]]
        status, gen = await http.generate(E1.url, tokens(self.rng, 32), "helper-x")
        out["idle_kill_then_generate"] = status
        out["helper_after_idle_kill"] = helpers()[-1] if helpers() else None
        await http.unload(E1.url, "helper-x")
        second = helpers()[-1]
        load = asyncio.ensure_future(http.load(E1.url, "helper-y", self.paths["B"], pinned=False))
        await asyncio.sleep(0.01)
        os.kill(second, signal.SIGKILL)
        status, body = await load
        out["kill_while_preparing"] = [status, str(body)[:300]]
        if status != 200:  # failed cleanly: the retry lands on a new helper
            status, body = await http.load(E1.url, "helper-y", self.paths["B"], pinned=False)
        out["retry_load"] = [status, str(body)[:300]]
        status, gen = await http.generate(E1.url, tokens(self.rng, 32), "helper-y")
        out["retry_generate"] = status
        await http.unload(E1.url, "helper-y")
        out["helpers_at_end"] = helpers()
        # whether the kill really met a preparation: its load failed naming the helper, or landed on a third
        # helper; with the acceptance's tiny adapters (3-6 ms) it can land after the load, which then
        # tests only that the server keeps serving (the CPU test kills one mid-preparation for certain)
        out["kill_met_a_preparation"] = out["kill_while_preparing"][0] != 200 or len(set(out["helpers_at_end"])) >= 3
        out["server_alive"] = E1.alive()
        return out

    async def main(self) -> dict:
        out_dir = self.out_dir
        env = {"SGLANG_REQ_RUNNING_TIMEOUT": str(RUN_TIMEOUT_S)}
        self.E0 = srv.start("e0", self.paths["base"], 30100, out_dir, patched=True, env=env, context_length=CONTEXT)
        self.E1 = srv.start("e1", self.paths["base"], 30200, out_dir, patched=True, env=env, context_length=CONTEXT)
        self.U = srv.start("u", self.paths["base"], 30300, out_dir, patched=False, env=env, context_length=CONTEXT)
        all_servers = [self.E0, self.E1, self.U]
        if wanted("provenance"):  # F: patched, with the test-only scale and swap switches on
            self.F = srv.start("f", self.paths["base"], 30500, out_dir, patched=True, env={**env, **provenance_live.F_ENV},
                               context_length=CONTEXT)
            all_servers.append(self.F)
        self.to_close: list = []  # deployments (stopped first), then the engines they drove
        try:
            await srv.wait_healthy(all_servers)
            self.report["boot_s"] = {s.name: round(s.boot_s, 1) for s in all_servers}
            self.report["warm_up_s"] = await srv.warm_up(all_servers, self.paths["C"])
            print("servers up:", self.report["boot_s"], "warm:", self.report["warm_up_s"], flush=True)
            async with aiohttp.ClientSession() as session:
                self.http = Http(session)
                self.report["server_state"] = {s.name: await self.http.state(s.url) for s in all_servers}
                if wanted("helper"):  # first: the servers hold nothing of lorapub's yet
                    await self.section("prepare_helper", self.prepare_helper())
                self.engines = self.fresh_engines("scenario")
                self.dep = await Deployment(self.engines, epoch=1, transport=HTTPBytes(),
                                            deadlines=DEADLINES, bucket_cap_bytes=64 << 10).start()
                self.to_close += [self.dep, *(e.inner for e in self.engines.values())]
                self.pubs = {"A": await self.dep.publish(self.snaps["A"], "A")}
                self.names = {"A": self.pubs["A"].lora_name}
                self.prompt = tokens(self.rng, PROMPT_LEN)
                if wanted("epsilon"):
                    await self.section("epsilon", self.epsilon())
                    if not hasattr(self, "eps"):
                        return self.report
                    await self.section("scenario", self.scenario())
                    if "B" in self.pubs:
                        self.names["B"] = self.pubs["B"].lora_name
                        await self.section("kv_isolation", self.kv_isolation())
                        await self.section("lifecycle", self.lifecycle())
                    await self.section("patch_behaviour", self.patch_behaviour())
                    if "C2" in self.pubs:
                        await self.section("online", self.online())
                if os.environ.get("LORAPUB_GPU_RELAX"):
                    await self.section("relax_route", self.relax_route())
                if os.environ.get("LORAPUB_GPU_WIRE") and wanted("wire"):
                    await self.section("wire", self.wire())
                if os.environ.get("LORAPUB_GPU_ROUTER"):
                    await self.section("router", self.router())
                if wanted("provenance"):
                    await self.dep.close()  # its epoch's A would be swept by the section's newer epochs
                    servers = {"e0": self.E0, "e1": self.E1, "f": self.F}
                    await self.section("provenance", provenance_live.ProvenanceSection(
                        self.http, servers, self.paths["probes"], self.paths, DEADLINES).main())
        finally:
            for obj in sorted(self.to_close, key=lambda o: not hasattr(o, "settle")):  # deployments first
                try:
                    await asyncio.wait_for(obj.close(), 30)
                except Exception as e:  # noqa: BLE001 - the report is what matters now
                    print(f"closing {obj!r} failed: {e!r}", flush=True)
            self.report["servers_alive_at_end"] = {s.name: s.alive() for s in all_servers}
            srv.stop(all_servers)
        return self.report


async def _post(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.text()


def report_of(pub) -> dict:
    return {"version": str(pub.version), "lora_name": pub.lora_name, "ms": round(pub.seconds * 1000, 1),
            "phases_ms": {p: round(v * 1000, 1) for p, v in pub.phases.items()}}


def max_concurrent(records) -> int:
    spans: dict[str, list[float]] = {}
    for r in records:
        span = spans.setdefault(r.session, [r.started, r.ended])
        span[0], span[1] = min(span[0], r.started), max(span[1], r.ended)
    events = sorted([(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()])
    now = best = 0
    for _, delta in events:
        now += delta
        best = max(best, now)
    return best


def compare(runs: dict) -> dict:
    """Each figure of lorapub and of the switched-off path as excess over the control, and lorapub's
    as a ratio to the switched-off baseline."""
    out: dict = {}
    control, base, ours = runs.get("control"), runs.get("switch_off"), runs.get("lorapub")
    if not (control and base and ours):
        return out

    def worst_gap(run):
        return max(run["longest_gap_in_publication_window_ms"].values(), default=float("nan"))

    figures = {"gap_in_publication_window_ms": worst_gap, "p99_ms": lambda r: r["latency_ms"]["99"],
               "p95_ms": lambda r: r["latency_ms"]["95"], "p50_ms": lambda r: r["latency_ms"]["50"],
               "failures": lambda r: r["failures"], "cached_token_ratio": lambda r: r["cached_token_ratio"]}
    for name, fig in figures.items():
        c, b, o = fig(control), fig(base), fig(ours)
        out[name] = {"control": c, "switch_off": b, "lorapub": o, "switch_off_excess": b - c, "lorapub_excess": o - c,
                     "lorapub_ratio_to_switch_off": (o / b) if b else None,
                     "lorapub_excess_ratio_to_switch_off_excess": ((o - c) / (b - c)) if (b - c) else None}
    return out


def core_verdicts(s: dict) -> dict[str, bool]:
    """The sections LORAPUB_GPU_SECTIONS=epsilon brings: numerics, scenario, KV isolation,
    lifecycle, the patch's behaviour, online."""
    v: dict[str, bool] = {}
    eps = s.get("epsilon", {}).get("epsilon", 0)
    v["epsilon measured on SGLang, A/B separated by > 10 eps"] = bool(s.get("epsilon", {}).get("separated"))
    sc = s.get("scenario", {})
    checks = sc.get("checks", [])
    v["every turn within eps of its bound version, on both engines"] = bool(checks) and all(
        c["diff"] <= eps for c in checks) and {c["engine"] for c in checks} == {"e0", "e1"}
    v["and far from the other version"] = bool(checks) and all(c["diff_other"] > 10 * eps for c in checks)
    v["S_old, S_mid (only E0 READY) bound A; S_new bound B"] = sc.get("bindings") == {"S_old": "A", "S_mid": "A", "S_new": "B"} \
        and sc.get("default_while_only_e0_ready") == "A"
    v["tool turns and resume covered"] = {"tool turn 1", "tool turn 2", "resume (same request again)"} <= {c["turn"] for c in checks}
    kv = s.get("kv_isolation", {})
    pairs = [x for k, x in kv.items() if isinstance(x, dict)]
    v["KV isolated both ways, first request equals cold, repeats hit their own cache"] = len(pairs) == 2 and all(
        x["isolated"] and all(x[k] <= eps for k in x if k.endswith("_vs_cold")) and
        all(x[k] > 0 for k in x if k.startswith("repeat_") and k.endswith("_cached")) for x in pairs)
    v["KV negative controls: the same check fails where the cache is shared"] = len(pairs) == 2 and not any(
        x["negative_control_same_version_isolated"] for x in pairs) and kv.get("negative_control_base_model_repeat_cached", 0) > 0
    lc = s.get("lifecycle", {})
    sent = {op for calls in lc.get("engine_calls_for_C", {"e0": {"begin": 1}}).values() for op in calls}
    v["C rejected for capacity with nothing sent"] = lc.get("C_while_A_bound") == "CAPACITY_ERROR" and lc.get(
        "engine_state_unchanged_by_C") is True and not sent & {"begin", "receive_bucket", "end", "cleanup", "reclaim"}
    v["A reclaimed after its sessions closed, unloaded once per engine"] = lc.get("A_after_sessions_closed") == "RECLAIMED" \
        and lc.get("A_physical_unloads") == {"e0": 1, "e1": 1} and not any(lc.get("A_loaded_after", {"x": 1}).values())
    late = lc.get("late_request_for_A", {})
    v["a request for reclaimed A is rejected, never reloaded"] = late.get("status") == 400 and not late.get("reloaded")
    v["partial failure cleaned on both engines, default kept"] = lc.get("C_state") == "FAILED_CLEAN" and \
        lc.get("default_after_failure") == "B" and lc.get("C_left_on_engines") == {"e0": [], "e1": []} and \
        lc.get("S_new_after_failure_diff", 1) <= eps
    pb = s.get("patch_behaviour", {})
    e0 = pb.get("e0 (patched)", {})
    u = pb.get("u (unpatched)", {})
    v["patched: ordinary unload of a managed pinned adapter refused (unpatched: removed)"] = \
        e0.get("ordinary_unload_of_managed_pinned", {}).get("still_loaded") is True and \
        u.get("ordinary_unload_of_managed_pinned", {}).get("still_loaded") is False
    v["patched: a request for a reclaimed managed adapter rejected, not reloaded (unpatched: reloaded)"] = \
        e0.get("request_after_reclaim", {}).get("status") == 400 and not e0.get("request_after_reclaim", {}).get("reloaded") \
        and u.get("request_after_reclaim", {}).get("reloaded") is True
    pv = pb.get("prevalidation e0 (patched)", {})
    trace = [refs for _, refs in pv.get("m1_refs_trace", [])]
    v["patched: refs 2 -> 2 after r_short -> 1 after a 503 ending; unload held while r_long runs; unloaded once after it"] = \
        trace == [2, 2, 1] and pv.get("r_503_status") == 503 and pv.get("while_r_long_runs", {}).get("unload_done") is False \
        and pv.get("while_r_long_runs", {}).get("r_long_running") is True and pv.get("r_long", {}).get("status") == 503 \
        and pv.get("unload", {}).get("status") == 200 and pv.get("physical_unloads_logged") == 1 \
        and pv.get("unload_returned_after_r_long") is True
    mx = [refs for label, refs in pv.get("mx_refs_trace", []) if isinstance(refs, int) or refs is None]
    v["patched: 400, disconnect and abort leave refs at 0; unload completes"] = mx == [0, 0, 0, 0] and pv.get("unload_mx") == 200
    on = s.get("online", {})
    runs = on.get("runs", {})
    ours = runs.get("lorapub", {})
    v["online: >= 64 concurrent sessions, B published under load, no failures, no mixed versions, <= 2 slots"] = \
        ours.get("max_concurrent_sessions", 0) >= 64 and ours.get("failures") == 0 and ours.get("mixed_version_sessions") == 0 \
        and (ours.get("slots_held_max") or 99) <= 2 and "B" in ours.get("publication", {}).get("version", "")
    v["online: A reclaimed after the run"] = ours.get("A_after_run") == "RECLAIMED"
    v["online: switch-off and control runs side by side"] = bool(on.get("compare"))
    return v


def verdicts(r: dict) -> dict[str, bool]:
    s = r.get("sections", {})
    v: dict[str, bool] = {}
    if wanted("epsilon") or "epsilon" in s:
        v.update(core_verdicts(s))
    if s.get("router") is not None or os.environ.get("LORAPUB_GPU_ROUTER"):
        rt = s.get("router") or {}
        run = rt.get("run", {})
        pv = rt.get("per_version", {})
        v["router: sessions through the real SGLang router, B published under load, no failures, one version per session"] = \
            run.get("failures") == 0 and run.get("sessions_on_more_than_one_version") == 0 and len(pv) == 2 \
            and "B" in run.get("publication", {}).get("version", "")
        v["router: cached-token ratio reported per version, A reclaimed after"] = all(
            x.get("cached_token_ratio") is not None for x in pv.values()) and rt.get("A_after_run") == "RECLAIMED"
    if s.get("relax_route") is not None or os.environ.get("LORAPUB_GPU_RELAX"):
        rr = s.get("relax_route") or {}
        v["relax: the 0.5.17+relax build serves; its same-name replace route refuses a managed version, which stays loaded"] = \
            len(rr) == 2 and all(x.get("refused_managed") and x.get("still_loaded") and x.get("sglang") == "0.5.17+relax"
                                 for x in rr.values())
    if s.get("wire") is not None or os.environ.get("LORAPUB_GPU_WIRE"):
        w = s.get("wire") or {}
        v["wire: HTTP bytes and same-host IPC staged in the engine, numerics within eps of a disk-loaded copy"] = \
            len(w) == 3 and all(x.get("within_eps") for x in w.values())
        v["wire: W reclaimed after, stashes freed"] = len(w) == 3 and all(
            x.get("W_after") == "RECLAIMED" and x.get("W_stash_freed") for x in w.values())
    if s.get("provenance") is not None or wanted("provenance"):
        v.update(provenance_live.verdicts(s.get("provenance")))
    if s.get("prepare_helper") is not None or wanted("helper"):
        h = s.get("prepare_helper") or {}
        kill = h.get("kill_while_preparing") or [None, ""]
        v["helper: a load after the preparing helper was killed lands on a new one; a load it was preparing "
          "fails cleanly (naming the helper) or lands; the server serves throughout"] = \
            (h.get("idle_kill_then_load") or [None])[0] == 200 and h.get("idle_kill_then_generate") == 200 \
            and (kill[0] == 200 or "helper" in kill[1]) and (h.get("retry_load") or [None])[0] == 200 \
            and h.get("retry_generate") == 200 and bool(h.get("server_alive")) \
            and len(set(h.get("helpers_at_end") or [])) >= 2
    v["no section raised"] = not r.get("errors") and not any(
        isinstance(x, dict) and "error" in x for x in (s.get("provenance") or {}).values())
    return v


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root")
    parser.add_argument("--fixtures", required=True, help="folder with base/ and lora_A|B|C built by tests.gpu.fixtures")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="lorapub-live-")
    paths = fixture_paths(args.fixtures)
    run = Run(root, os.path.dirname(os.path.abspath(args.out)), paths, args.out)
    t0 = time.monotonic()
    report = asyncio.run(run.main())
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["env"] = env_report()
    report["verdicts"] = verdicts(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    for name, ok in report["verdicts"].items():
        print(f"[{'pass' if ok else 'FAIL'}] {name}")
    return 0 if all(report["verdicts"].values()) else 1


def env_report() -> dict:
    out = {"python": platform.python_version()}
    try:
        import torch

        out.update(torch=torch.__version__, cuda=torch.version.cuda,
                   device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception:  # noqa: BLE001
        pass
    try:
        from lorapub.sglang_patch import verify

        out["sglang"] = verify()
    except Exception as e:  # noqa: BLE001
        out["sglang"] = repr(e)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
