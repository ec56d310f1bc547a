"""The numeric READY gate over MemoryEngine: a correct adapter passes, a config mismatch or a scaled
tensor is refused with NUMERIC_MISMATCH before any READY, the default stays and the attempt is cleaned."""

from __future__ import annotations

import pytest

from lorapub import Deployment, InvalidInput, NumericMismatch, Probe, PublicationFailed, VersionKey
from lorapub.core.version import VersionState
from lorapub.probe import compare, input_logprobs
from lorapub.runtime.runner import Deadlines
from lorapub.testing import MemoryEngine, lora_snapshot, peft_config, reference_probe
from lorapub.testing.numeric import SCALE_ENV

QUICK = Deadlines(begin=1, bucket=1, end=3, cleanup=1, commit=1, reclaim=30)


def probed(seed: int, **kw):
    snap = lora_snapshot(seed)
    return snap.with_probe(reference_probe(snap, **kw))


async def deployment(observers=(), **engine_options) -> tuple[Deployment, dict[str, MemoryEngine]]:
    engines = {n: MemoryEngine(n, **engine_options) for n in ("e0", "e1")}
    dep = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None, observers=observers).start()
    return dep, engines


def test_the_probe_is_not_part_of_the_digest():
    snap = lora_snapshot(1)
    with_probe = snap.with_probe(reference_probe(snap))
    assert with_probe.digest == snap.digest and snap.probe is None and with_probe.probe is not None
    assert with_probe.tensor_names == snap.tensor_names


def test_probe_values_are_checked():
    with pytest.raises(InvalidInput):
        Probe(((1,),), ((),))  # one token: nothing to predict
    with pytest.raises(InvalidInput):
        Probe(((1, 2),), ((-0.1, -0.2),))  # one logprob per token after the first
    with pytest.raises(InvalidInput):
        Probe(((1, 2),), ((-0.1,),), mean_tolerance=-1)
    with pytest.raises(InvalidInput):
        lora_snapshot(1).with_probe("probe")


def test_compare_names_the_worst_token():
    probe = Probe(((1, 2, 3),), ((-1.0, -2.0),), mean_tolerance=0.05, token_tolerance=0.5)
    assert compare(probe, [[-1.0, -2.04]]) is None
    m = compare(probe, [[-1.0, -2.7]])
    assert m is not None and (m.sequence, m.position, m.expected, m.observed) == (0, 2, -2.0, -2.7)
    # SGLang's shape: the first input token has no logprob
    reply = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-1.0, 2, None], [-2.0, 3, None]]}}
    assert input_logprobs(reply, 3) == [-1.0, -2.0]
    with pytest.raises(ValueError):
        input_logprobs({"meta_info": {}}, 3)


async def test_ten_correct_publications_pass_the_gate():
    dep, engines = await deployment()
    for i in range(10):
        report = await dep.publish(probed(i), f"v{i}")
        assert report.state is VersionState.PUBLISHED and "probe" in report.phases
        assert all("probe" in phases for phases in report.engine_phases.values())
    await dep.close()


async def test_a_config_mismatch_is_refused_at_ready_and_the_default_stays():
    events = []
    dep, engines = await deployment(observers=[events.append])
    first = await dep.publish(probed(1), "A")
    snap = lora_snapshot(2)
    trainer_config = {**peft_config(), "lora_alpha": 4 * 8}  # the trainer computes with another alpha
    bad = snap.with_probe(reference_probe(snap, serving_config=trainer_config))
    with pytest.raises(NumericMismatch) as caught:
        await dep.publish(bad, "B")
    e = caught.value
    assert e.code == "NUMERIC_MISMATCH" and isinstance(e, PublicationFailed)
    assert e.details["engine"] in engines and e.details["cleaned"] is True
    assert abs(e.details["expected"] - e.details["observed"]) > 0
    assert {"sequence", "position", "mean_tolerance", "token_tolerance", "version"} <= set(e.details)
    state = await dep.state()
    assert state.default == first.version
    b = state.versions[VersionKey(1, "B")]
    assert b.state is VersionState.FAILED_CLEAN
    assert all(b.lora_name not in eng.loaded for eng in engines.values())  # the attempt is cleaned
    kinds = [ev.KIND for ev in events]
    second = len(kinds) - 1 - kinds[::-1].index("publish.begun")  # B's events: no engine READY among them
    assert "publish.numeric_mismatch" in kinds[second:] and "publish.ready" not in kinds[second:]
    assert [ev.code for ev in events if ev.KIND == "publish.failed"] == ["NUMERIC_MISMATCH"]
    await dep.close()


async def test_a_scaled_tensor_is_refused_at_ready(monkeypatch):
    dep, engines = await deployment(scale_tensor="lora_B=2.0")
    with pytest.raises(NumericMismatch):
        await dep.publish(probed(3), "A")
    assert (await dep.state()).default is None
    await dep.close()
    monkeypatch.setenv(SCALE_ENV, "layers.0.self_attn.q_proj.lora_A=1.5")  # the test-only switch, by env
    dep, engines = await deployment()
    with pytest.raises(NumericMismatch):
        await dep.publish(probed(3), "A")
    monkeypatch.delenv(SCALE_ENV)
    report = await dep.publish(probed(3), "A")  # the same id and snapshot, served right: it passes
    assert report.state is VersionState.PUBLISHED
    await dep.close()


async def test_without_a_probe_nothing_is_asked():
    dep, engines = await deployment()
    report = await dep.publish(lora_snapshot(1), "A")
    assert "probe" not in report.phases and all(e.requests == 0 for e in engines.values())
    await dep.close()


@pytest.fixture
async def double_pair(tmp_path):
    from lorapub.testing import SGLangDouble

    pair = []
    for name in ("e0", "e1"):
        d = SGLangDouble(name)
        d.stash_root = str(tmp_path / f"{name}-disk")
        pair.append(await d.start())
    yield pair
    for d in pair:
        await d.stop()


async def test_the_gate_over_the_sglang_double(double_pair, monkeypatch):
    """The double answers SGLang's input_token_logprobs from what it loaded: a correct version passes,
    a config mismatch and (test-only switch) a scaled tensor are refused, the default stays."""
    from lorapub.adapters.sglang_wire import SGLangWireEngine

    engines = {d.name: SGLangWireEngine(d.name, d.url) for d in double_pair}
    dep = await Deployment(engines, epoch=1, deadlines=QUICK, reconcile_interval=None).start()
    a = await dep.publish(probed(1), "A")
    assert "probe" in a.phases
    snap = lora_snapshot(2)
    bad = snap.with_probe(reference_probe(snap, serving_config={**peft_config(), "lora_alpha": 32}))
    with pytest.raises(NumericMismatch):
        await dep.publish(bad, "B")
    monkeypatch.setenv(SCALE_ENV, "lora_B=2.0")
    with pytest.raises(NumericMismatch):
        await dep.publish(probed(3), "C")
    monkeypatch.delenv(SCALE_ENV)
    assert (await dep.state()).default == a.version
    assert (await dep.publish(probed(3), "C")).state is VersionState.PUBLISHED
    await dep.close()


MALFORMED = {
    "dict entries": lambda n: {"meta_info": {"input_token_logprobs": [{"logprob": -1.0}] * n}},
    "a number for the list": lambda n: {"meta_info": {"input_token_logprobs": 7}},
    "strings": lambda n: {"meta_info": {"input_token_logprobs": [["x", 1, None]] * n}},
    "meta_info a list": lambda n: {"meta_info": [1, 2]},
    "not an object": lambda n: ["ok"],
}


@pytest.mark.parametrize("reply", MALFORMED)
async def test_a_malformed_probe_reply_fails_the_attempt_like_a_refused_end(reply, caplog):
    """docs/provenance.md: a reply that lacks the logprobs fails the attempt as a refused ``end`` does:
    typed, cleaned, the default unmoved, and no traceback logged as an error inside lorapub."""
    dep, engines = await deployment()
    first = await dep.publish(probed(1), "A")
    for engine in engines.values():
        engine.generate = lambda payload, make=MALFORMED[reply]: _answer(make(len(payload["input_ids"])))
    with pytest.raises(PublicationFailed) as caught:
        await dep.publish(probed(2), "B")
    assert caught.value.code == "PUBLICATION_FAILED" and "probe" in caught.value.message
    assert (await dep.state()).default == first.version
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    await dep.close()


async def _answer(reply):
    return reply
