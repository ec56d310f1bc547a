"""The provenance section of the live acceptance (``Run.provenance`` in ``tests/gpu/live.py``): the
numeric READY gate, the canary and the engine stamp against patched SGLang, with reference logprobs
computed by transformers + PEFT (float32) from the same saved adapters (``fixtures.build_probes``).

Servers: E0/E1 (clean) and F, patched with both test-only switches: ``LORAPUB_TEST_SCALE_TENSOR``
(scales one tensor of every ``dir`` load) and ``LORAPUB_TEST_SWAP_WEIGHTS`` (serves each new version
with the previous one's weights under the new name). See docs/provenance.md.

What it measures, in order:
  1. noise: each correct version's probe observed on E0/E1 against the float32 reference (bf16 noise);
  2. ten correct publications P0..P9 with their probes, each beside a control publication of the same
     adapter without a probe (alternating): the gate's added latency, per engine;
  3. P0's tensors served with ``lora_alpha`` doubled: refused with NUMERIC_MISMATCH, default kept;
  4. 2,000 requests from sessions, each turn's stamp checked, with the canary on: per-check cost;
  5. E0 + F with ``dir`` loads: the scaled tensor refused on F at READY;
  6. F with tensor loads: a version served with its predecessor's weights, caught on its first turn.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import traceback
from collections import Counter
from typing import Any

from lorapub import Deployment, LorapubError, NumericMismatch, ProvenanceMismatch
from lorapub.adapters.sglang_wire import HTTPBytes, SGLangWireEngine
from lorapub.probe import DEFAULT_MEAN_TOLERANCE, DEFAULT_TOKEN_TOLERANCE, Probe, observe
from tests.gpu.fixtures import adapter_snapshot

#: F's switches: the tensor the scale switch hits (one LoRA B of the first layer), and by how much.
SCALE_SWITCH = "layers.0.self_attn.v_proj.lora_B=8"
F_ENV = {"LORAPUB_TEST_SCALE_TENSOR": SCALE_SWITCH, "LORAPUB_TEST_SWAP_WEIGHTS": "1"}
STAMPED_REQUESTS = 2000
SESSIONS = 100  # 100 sessions x 20 turns, in two waves of 50 (one version each)
CANARY_INTERVAL = 0.1
TOOL_LATENCY_S = 0.05  # between a session's turns, as a rollout's tool call
CANARY_REPEATS = 20


def timed(engine):
    """``engine`` with its probe prefills (``logprob_start_len`` 0 with logprobs) timed into
    ``engine.probe_ms``. The instance's ``generate`` is replaced, not wrapped in another class:
    runtime protocol checks (Python 3.12+) look at the class."""
    inner = engine.generate
    engine.probe_ms = []

    async def generate(payload):
        is_probe = payload.get("logprob_start_len") == 0 and payload.get("return_logprob")
        t0 = time.perf_counter()
        out = await inner(payload)
        if is_probe:
            engine.probe_ms.append((time.perf_counter() - t0) * 1000)
        return out

    engine.generate = generate
    return engine


async def close(engines: dict) -> None:
    for e in engines.values():
        await e.close()


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def _summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": _q(values, 0.5), "p99": _q(values, 0.99), "max": _q(values, 1.0),
            "mean": round(statistics.fmean(values), 4) if values else None}


class ProvenanceSection:
    def __init__(self, http, servers: dict, probes_path: str, paths: dict[str, str], deadlines) -> None:
        self.http, self.servers, self.deadlines = http, servers, deadlines
        with open(probes_path) as f:
            fx = json.load(f)
        self.sequences, self.expected = fx["sequences"], fx["expected"]
        self.versions = sorted(self.expected, key=lambda k: int(k[1:]))
        self.paths = paths
        self.out: dict = {"reference": {k: fx[k] for k in ("dtype", "computed_with")},
                          "probe_tokens": sum(len(s) for s in self.sequences),
                          "default_tolerance_nats": {"mean": DEFAULT_MEAN_TOLERANCE, "token": DEFAULT_TOKEN_TOLERANCE}}

    def probe(self, version: str, **tolerances) -> Probe:
        return Probe(self.sequences, self.expected[version], **tolerances)

    def snapshot(self, version: str, *, probe: bool = True, **config):
        return adapter_snapshot(self.paths[version], probe=self.probe(version) if probe else None, **config)

    def engines(self, *names: str) -> dict:
        return {n: timed(self.engine(n)) for n in names}

    def engine(self, name: str):
        return SGLangWireEngine(name, self.servers[name].url, probe_timeout=60)

    def transport(self, load: str):
        return HTTPBytes(load=load)

    async def loaded(self, name: str) -> list[str]:
        return list((await self.http.state(self.servers[name].url))["adapters"])

    async def fresh(self, *names: str) -> None:
        for n in names:  # what earlier sections left loaded leaves first
            for lora in await self.loaded(n):
                await self.http.unload(self.servers[n].url, lora, reclaim_id=f"teardown-{lora}")

    async def step(self, name: str, coro) -> None:
        t0 = time.monotonic()
        try:
            self.out[name] = await coro
        except BaseException as e:  # noqa: BLE001 - one step's failure must not hide the others' figures
            self.out[name] = {"error": "".join(traceback.format_exception(e))[-3000:]}
        self.out[name]["seconds"] = round(time.monotonic() - t0, 2)
        print(f"   provenance.{name}: {json.dumps(self.out[name], default=str)[:600]}", flush=True)

    async def main(self) -> dict:
        await self.fresh("e0", "e1", "f")
        engines = self.engines("e0", "e1")
        dep = await Deployment(engines, epoch=30, transport=self.transport("dir"), deadlines=self.deadlines,
                               bucket_cap_bytes=64 << 10, canary_interval=CANARY_INTERVAL,
                               reconcile_interval=CANARY_INTERVAL).start()
        try:
            await self.step("gate", self.gate(dep, engines))
            await self.step("alpha_mismatch", self.alpha_mismatch(dep))
            await self.step("stamped", self.stamped(dep, engines))
            await self.step("canary_cost", self.canary_cost(dep, engines))
        finally:
            await dep.close()
            await close(engines)
        await self.step("scaled_tensor", self.scaled_tensor())
        await self.step("swapped_weights", self.swapped_weights())
        return self.out

    async def noise(self, engines: dict, lora_name: str, version: str) -> dict[str, list[float]]:
        """|observed - reference| per token, on each engine, with a probe that never refuses."""
        lenient = self.probe(version, mean_tolerance=1e9, token_tolerance=1e9)
        out = {}
        for n, e in engines.items():
            observed = await observe(e, lora_name, lenient, 60)
            out[n] = [abs(a - b) for row_o, row_e in zip(observed, lenient.expected) for a, b in zip(row_o, row_e)]
        return out

    async def gate(self, dep, engines) -> dict:
        rows, diffs = [], {n: [] for n in engines}
        for i, version in enumerate(self.versions):
            for gated in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
                vid = version if gated else f"{version}-nogate"
                row: dict = {"version": vid, "gated": gated}
                try:
                    pub = await dep.publish(self.snapshot(version, probe=gated), vid)
                    row.update(ms=round(pub.seconds * 1000, 1),
                               phases_ms={p: round(v * 1000, 1) for p, v in pub.phases.items()},
                               engine_phases_ms={e: {p: round(v * 1000, 1) for p, v in ph.items()}
                                                 for e, ph in pub.engine_phases.items()})
                    if gated:
                        for n, d in (await self.noise(engines, pub.lora_name, version)).items():
                            diffs[n] += d
                except LorapubError as e:
                    row.update(error=e.code, details=json.loads(json.dumps(e.details, default=str)), message=str(e)[:400])
                rows.append(row)
                await dep.settle()
        gated = [r for r in rows if r["gated"]]
        control = [r for r in rows if not r["gated"]]
        probe_phase = [r["phases_ms"].get("probe", 0.0) for r in gated if "phases_ms" in r]
        per_engine_probe = {n: [r["engine_phases_ms"][n].get("probe") for r in gated
                                if "engine_phases_ms" in r and n in r["engine_phases_ms"]] for n in engines}
        return {
            "publications": rows,
            "passed": sum(1 for r in gated if "error" not in r), "gated": len(gated),
            "control_failed": sum(1 for r in control if "error" in r),
            "publish_ms_gated": _summary([r["ms"] for r in gated if "ms" in r]),
            "publish_ms_control": _summary([r["ms"] for r in control if "ms" in r]),
            "probe_phase_ms": _summary(probe_phase),
            "probe_phase_ms_per_engine": {n: _summary([x for x in v if x is not None]) for n, v in per_engine_probe.items()},
            "bf16_noise_nats_per_engine": {n: _summary(d) for n, d in diffs.items()},
            "bf16_noise_mean_abs_per_engine": {n: round(statistics.fmean(d), 5) if d else None for n, d in diffs.items()},
        }

    async def alpha_mismatch(self, dep) -> dict:
        before = (await dep.state()).default
        config = self.snapshot("P0", probe=False).serving_config
        alpha = config.get("lora_alpha")
        row: dict = {"trainer_lora_alpha": alpha, "served_lora_alpha": alpha * 2, "default_before": str(before)}
        try:
            await dep.publish(self.snapshot("P0", lora_alpha=alpha * 2), "P0-alpha")
            row["outcome"] = "committed"
        except NumericMismatch as e:
            row.update(outcome=e.code, details=json.loads(json.dumps(e.details, default=str)), message=str(e)[:500])
        except LorapubError as e:
            row.update(outcome=e.code, message=str(e)[:500])
        await dep.settle()
        state = await dep.state()
        row["default_after"] = str(state.default)
        row["state"] = next((v.state.value for v in state.versions.values() if v.key.version_id == "P0-alpha"), None)
        return row

    async def stamped(self, dep, engines) -> dict:
        """STAMPED_REQUESTS turns in two waves of sessions, each on its own version; every turn's
        stamp checked by the session (a mismatch raises) and here (name, digest, engine)."""
        rng = random.Random(31)
        counts: Counter = Counter()
        lat: list[float] = []
        turns = STAMPED_REQUESTS // SESSIONS
        canary_before = {n: len(e.probe_ms) for n, e in engines.items()}
        t0 = time.monotonic()

        async def one(sid: str) -> None:
            async with dep.session(sid) as s:
                ids = [rng.randrange(1024) for _ in range(48)]
                for _ in range(turns):
                    t = time.perf_counter()
                    try:
                        out = await s.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
                    except LorapubError as e:
                        counts[f"error:{e.code}"] += 1
                        continue
                    lat.append((time.perf_counter() - t) * 1000)
                    info, binding = out.get("lorapub") or {}, s.binding
                    stamp = info.get("stamp")
                    if stamp is None:
                        counts["unstamped"] += 1
                    elif stamp.get("lora_name") == binding.lora_name and stamp.get("digest") == binding.digest \
                            and stamp.get("engine"):
                        counts["stamped_and_verified"] += 1
                    else:
                        counts["stamp_differs"] += 1
                    ids = ids + list(out.get("output_ids") or [])[-4:] + [rng.randrange(1024) for _ in range(8)]
                    await asyncio.sleep(TOOL_LATENCY_S)

        waves = []
        for wave, version in enumerate(self.versions[-2:]):  # the two newest: one wave each
            await dep.settle()
            default = (await dep.state()).default
            await asyncio.gather(*(one(f"w{wave}-s{i}") for i in range(SESSIONS // 2)))
            waves.append(str(default))
            if wave == 0:  # the second wave binds a newer version than the first
                await dep.publish(self.snapshot(version), f"{version}-2")
        seconds = time.monotonic() - t0
        return {"requests": sum(counts.values()), "counts": dict(counts), "waves_bound": waves,
                "latency_ms": _summary(lat), "seconds": round(seconds, 2),
                "canary_interval_s": CANARY_INTERVAL,
                # every probe run in the waves but the READY probe of the one publication between them
                "canary_checks_during": {n: len(e.probe_ms) - canary_before[n] - 1 for n, e in engines.items()},
                "suspect": [v.version for v in (await dep.status(probe=False)).versions if v.suspect]}

    async def canary_cost(self, dep, engines) -> dict:
        """One canary check is one probe run (lorapub.probe.observe, as the reconciler calls it):
        timed here CANARY_REPEATS times per engine on the resident default, engines idle."""
        state = await dep.state()
        version = state.versions[state.default]
        vid = version.key.version_id.removesuffix("-2")
        out = {}
        for n, e in engines.items():
            times = []
            for _ in range(CANARY_REPEATS):
                t = time.perf_counter()
                await observe(e, version.lora_name, self.probe(vid), 60)
                times.append((time.perf_counter() - t) * 1000)
            out[n] = _summary(times)
        return {"per_check_ms_idle": out, "tokens_per_check": self.out["probe_tokens"],
                "every_probe_run_ms": {n: _summary(e.probe_ms) for n, e in engines.items()}}

    async def scaled_tensor(self) -> dict:
        """E0 (clean) and F (scale switch on) with ``dir`` loads: P1 with its probe must be refused
        on F, never committed, and cleaned on both."""
        engines = self.engines("e0", "f")
        dep = await Deployment(engines, epoch=31, transport=self.transport("dir"), deadlines=self.deadlines,
                               bucket_cap_bytes=64 << 10, reconcile_interval=None).start()
        row: dict = {"switch": SCALE_SWITCH}
        try:
            try:
                await dep.publish(self.snapshot("P1"), "P1-scaled")
                row["outcome"] = "committed"
            except LorapubError as e:
                row.update(outcome=e.code, details=json.loads(json.dumps(e.details, default=str)), message=str(e)[:500])
            await dep.settle()
            await dep.reconcile()
            state = await dep.state()
            row["default_after"] = str(state.default)
            row["state"] = next((v.state.value for v in state.versions.values() if v.key.version_id == "P1-scaled"), None)
            row["left_on_engines"] = {n: await self.loaded(n) for n in engines}
        finally:
            await dep.close()
            await close(engines)
        return row

    async def swapped_weights(self) -> dict:
        """F (swap switch on), tensor loads, no probe: S2 is served with S1's weights under S2's name;
        a session bound to S2 must fail its first turn with PROVENANCE_MISMATCH."""
        engines = self.engines("f")
        dep = await Deployment(engines, epoch=32, transport=self.transport("tensors"), deadlines=self.deadlines,
                               bucket_cap_bytes=64 << 10, reconcile_interval=None).start()
        row: dict = {}
        try:
            await dep.publish(self.snapshot("P2", probe=False), "S1")
            async with dep.session("before-swap") as s:  # S1 is served with its own weights
                out = await s.generate({"input_ids": self.sequences[0][:16], "sampling_params": {"max_new_tokens": 2}})
                row["S1_first_turn"] = {"ok": True, "stamp": out["lorapub"]["stamp"]}
            await dep.publish(self.snapshot("P3", probe=False), "S2")
            turns = []
            async with dep.session("after-swap") as s:
                for turn in range(2):
                    try:
                        out = await s.generate({"input_ids": self.sequences[0][:16], "sampling_params": {"max_new_tokens": 2}})
                        turns.append({"turn": turn, "ok": True, "stamp": out["lorapub"]["stamp"]})
                    except ProvenanceMismatch as e:
                        turns.append({"turn": turn, "error": e.code, "details": json.loads(json.dumps(e.details, default=str))})
                    except LorapubError as e:
                        turns.append({"turn": turn, "error": e.code, "message": str(e)[:300]})
                row["S2_turns"] = turns
                row["S2_binding_digest"] = s.binding.digest if s.binding else None
            row["P2_digest"] = self.snapshot("P2", probe=False).digest
        finally:
            await dep.close()
            await close(engines)
        return row


def verdicts(p: dict | None) -> dict[str, bool]:
    p = p or {}
    g, a, st = p.get("gate", {}), p.get("alpha_mismatch", {}), p.get("stamped", {})
    sc, sw = p.get("scaled_tensor", {}), p.get("swapped_weights", {})
    s2 = sw.get("S2_turns") or [{}]
    return {
        "provenance: 10 correct publications pass the numeric gate (controls without a probe pass too)":
            g.get("gated") == 10 and g.get("passed") == 10 and g.get("control_failed") == 0,
        "provenance: served lora_alpha differing from the trainer's refused with NUMERIC_MISMATCH, default kept":
            a.get("outcome") == "NUMERIC_MISMATCH" and a.get("default_after") == a.get("default_before")
            and a.get("state") != "PUBLISHED",
        f"provenance: {STAMPED_REQUESTS} requests stamped and verified, 0 mismatches, canary ran and found no drift":
            st.get("counts", {}).get("stamped_and_verified") == STAMPED_REQUESTS and st.get("requests") == STAMPED_REQUESTS
            and sum(st.get("canary_checks_during", {}).values()) > 0 and not st.get("suspect"),
        "provenance: an injected scaled tensor refused at READY on its engine (NUMERIC_MISMATCH), nothing left":
            sc.get("outcome") == "NUMERIC_MISMATCH" and sc.get("details", {}).get("engine") == "f"
            and sc.get("default_after") == "None" and not any((sc.get("left_on_engines") or {"x": [1]}).values()),
        "provenance: a version served with another's weights under its name caught on its first turn":
            sw.get("S1_first_turn", {}).get("ok") is True and s2[0].get("error") == "PROVENANCE_MISMATCH",
    }
