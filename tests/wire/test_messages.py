"""The staging routes' bodies have one codec each (lorapub.wire.messages), shared by the publisher's
adapter, the engine-side staging and lorapub's double: every body survives its codec and JSON text
unchanged, and anything malformed is refused with the typed refusal (``Refused``, 400 STAGE_INVALID),
never another exception."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapub.core.identity import AttemptToken, VersionKey
from lorapub.core.manifest import BucketPlan, Manifest, TensorEntry
from lorapub.core.staging.messages import Receipt, Refusal
from lorapub.wire.messages import (
    AdapterEntry,
    AttemptReport,
    BeginBody,
    BeginSent,
    BucketParams,
    BucketSent,
    CleanupBody,
    CleanupReply,
    EndBody,
    EndReply,
    ReleaseBody,
    ReleaseReply,
    ShmControl,
    StageReply,
    StagingReport,
    StateReply,
    TorchControl,
    TorchOptions,
    receipt_from_json,
    receipt_to_json,
)
from lorapub.wire.refusal import Refused, bad, refuse
from lorapub.wire.routes import FORMATS, LOAD_FORMS, SHM_NAME, TRANSPORTS

ids = st.from_regex(r"[A-Za-z0-9_.:-]{1,16}", fullmatch=True)
tokens = st.builds(AttemptToken, st.builds(VersionKey, st.integers(0, 2**40), ids), st.integers(0, 2**40))
digests = st.text("0123456789abcdef", min_size=64, max_size=64)
scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=8)
seconds = st.floats(0, 1e6, allow_nan=False)


@st.composite
def plans(draw: Any) -> BucketPlan:
    sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6))
    entries = [TensorEntry(f"layers.{i}.lora_A.weight", draw(st.sampled_from(["bfloat16", "float32", "uint8"])), (n,), n,
                           hashlib.sha256(f"{i}/{n}".encode()).hexdigest()) for i, n in enumerate(sizes)]
    manifest = Manifest.build(entries, draw(st.dictionaries(st.sampled_from(["r", "lora_alpha"]), st.integers(1, 64))))
    return BucketPlan.for_manifest(manifest, draw(st.integers(1, 600)))


transports = st.builds(lambda kind, extra: {"kind": kind, **extra}, st.sampled_from(TRANSPORTS),
                       st.dictionaries(st.sampled_from(["host", "port", "backend", "dir"]), scalars, max_size=3))
receipts = st.builds(Receipt, st.text(), st.text(), st.text(), scalars, scalars, st.sampled_from(LOAD_FORMS), seconds, seconds)
begins = st.builds(BeginBody, tokens, st.text() | st.none(), st.text(), digests, plans(), transports,
                   st.sampled_from(LOAD_FORMS))
counts = st.integers(0, 2**40)
attempt_reports = st.builds(AttemptReport, tokens, st.text(), st.sampled_from(["receiving", "failed", "loaded"]),
                            st.lists(st.integers(0, 99), max_size=4).map(tuple), counts, counts, st.booleans(),
                            st.booleans(), st.sampled_from(TRANSPORTS), st.sampled_from(LOAD_FORMS), seconds,
                            st.booleans())
staging_reports = st.builds(StagingReport, st.dictionaries(st.text(), attempt_reports, max_size=3), counts, counts,
                            counts, counts, seconds | st.just(float("inf")), counts)
states = st.builds(StateReply, st.text(),
                   st.dictionaries(st.text(), st.builds(AdapterEntry, scalars, scalars, st.booleans(), counts), max_size=3),
                   st.dictionaries(st.text(), scalars, max_size=2), st.none() | counts, st.booleans(),
                   st.none() | st.text(), st.booleans(), st.none() | staging_reports, st.none() | st.text(),
                   st.none() | st.text())
@st.composite
def torch_controls(draw: Any) -> TorchControl:
    world = draw(st.integers(2, 64))
    rank = draw(st.integers(1, world - 1))
    return TorchControl(rank, world, draw(st.integers(0, world - 1).filter(lambda src: src != rank)))


torch_options = st.builds(TorchOptions, st.text(min_size=1), st.integers(1, 65535), st.sampled_from(["gloo", "nccl"]),
                          st.sampled_from(["cpu", "cuda:0"]), st.floats(0.001, 1e6))
bodies = st.one_of(
    states, torch_options, st.builds(ShmControl, st.from_regex(SHM_NAME, fullmatch=True)), torch_controls(),
    begins,
    st.builds(EndBody, tokens, st.text() | st.none()),
    st.builds(CleanupBody, tokens),
    st.builds(ReleaseBody, st.text()),
    st.builds(StageReply, st.text(), st.booleans()),
    st.builds(EndReply, receipts, st.booleans()),
    st.builds(CleanupReply, st.text(), st.none() | receipts),
    st.builds(CleanupReply, st.text(), st.none(), st.just(False)),
    st.builds(ReleaseReply, st.text(), st.lists(st.text(), max_size=4).map(tuple)),
)


def _over_the_wire(value: object) -> Any:
    return json.loads(json.dumps(value))


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_every_body_survives_its_codec_and_json_text(body):
    assert type(body).from_json(_over_the_wire(body.to_json())) == body


@given(receipts)
def test_a_receipt_survives_its_codec(receipt):
    assert receipt_from_json(_over_the_wire(receipt_to_json(receipt))) == receipt


@given(st.builds(BucketParams, tokens, st.integers(-5, 2**31), st.text() | st.none(), st.sampled_from(FORMATS)))
def test_bucket_parameters_survive_the_query_string(params):
    query = params.to_params()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in query.items())  # a URL's query, as sent
    assert BucketParams.from_params(query) == params


@given(st.integers(400, 599), st.text(), st.text())
def test_a_refusals_body_survives_its_codec(status, code, message):
    back = Refused.from_json(status, _over_the_wire(Refused(status, code, message).to_json()))
    assert (back.status, back.code, back.message) == (status, code, message)


@given(st.builds(Refusal, st.integers(400, 599), st.text(), st.text()))
def test_the_machines_refusal_and_the_raised_one_are_one_refusal(value):
    assert Refused.of(value).value() == value


DECODERS = [BeginBody.from_json, EndBody.from_json, CleanupBody.from_json, ReleaseBody.from_json,
            StageReply.from_json, EndReply.from_json, CleanupReply.from_json, ReleaseReply.from_json,
            StateReply.from_json, StagingReport.from_json, AttemptReport.from_json, AdapterEntry.from_json,
            ShmControl.from_json, TorchControl.from_json, TorchOptions.from_json, receipt_from_json, lambda v: Refused.from_json(409, v)]


@pytest.mark.parametrize("decode", DECODERS)
@given(value=json_values)
def test_anything_malformed_is_refused_with_the_typed_refusal(decode, value):
    try:
        decode(value)
    except Refused as e:
        assert (e.status, e.code) == (400, "STAGE_INVALID")


@given(st.dictionaries(st.sampled_from(["epoch", "version_id", "seq", "index", "format", "incarnation"]),
                       st.text(max_size=8)))
def test_malformed_bucket_parameters_are_refused_with_the_typed_refusal(params):
    try:
        BucketParams.from_params(params)
    except Refused as e:
        assert (e.status, e.code) == (400, "STAGE_INVALID")


#: For each body, a field it cannot do without, and a value that field never takes.
BROKEN = [
    (begins, "token", {"epoch": -1}), (begins, "plan", {"buckets": []}), (begins, "digest", "ABC"),
    (begins, "lora_name", 7), (begins, "transport", {"kind": "carrier-pigeon"}), (begins, "transport", [1]),
    (begins, "load", "disk"), (st.builds(EndBody, tokens, st.text()), "token", None),
    (st.builds(CleanupBody, tokens), "token", "t"), (st.builds(ReleaseBody, st.text()), "lora_name", None),
    (st.builds(StageReply, st.text()), "incarnation", 7), (st.builds(StageReply, st.text()), "duplicate", "yes"),
    (st.builds(EndReply, receipts), "lora_name", None), (st.builds(EndReply, receipts), "timings", {"load": "1s"}),
    (st.builds(CleanupReply, st.text(), receipts), "loaded", {"lora_name": "x"}),
    (st.builds(ReleaseReply, st.text()), "freed", "all"),
    (states, "incarnation", None), (states, "adapters", {"a": 1}), (states, "max_loaded_loras", "8"),
    (states, "staging", {"attempts": {"t": {"token": "t"}}}), (states, "managed_prefix", 3),
    (st.builds(ShmControl, st.from_regex(SHM_NAME, fullmatch=True)), "name", "../etc/passwd"),
    (torch_controls(), "rank", 0), (torch_controls(), "world_size", 1), (torch_controls(), "src", -1),
    (torch_options, "port", 0), (torch_options, "backend", "mpi"), (torch_options, "timeout", -1),
    (torch_options, "device", None), (torch_options, "host", None),
]


@pytest.mark.parametrize("strategy, field, value", BROKEN, ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(BROKEN)])
@settings(max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_body_with_a_broken_field_is_refused(strategy, field, value, data):
    body = data.draw(strategy)
    sent = _over_the_wire(body.to_json())
    sent[field] = value
    with pytest.raises(Refused) as e:
        type(body).from_json(sent)
    assert (e.value.status, e.value.code) == (400, "STAGE_INVALID")
    del sent[field]
    if field in ("token", "plan", "digest", "lora_name", "incarnation", "name", "rank", "world_size", "host", "port"):
        with pytest.raises(Refused):
            type(body).from_json(sent)


@given(tokens, json_values, json_values, json_values)
def test_a_begin_keeps_what_the_staging_compares_as_it_came(token, incarnation, lora_name, digest):
    """The life, the name and the digest are handed to the staging machine as sent (a duplicate begin is
    answered before the rest is looked at); only the token is needed to read the body at all."""
    sent = BeginSent.from_json({"token": {"epoch": token.version.deployment_epoch,
                                          "version_id": token.version.version_id, "seq": token.seq},
                                "incarnation": incarnation, "lora_name": lora_name, "digest": digest})
    assert (sent.token, sent.incarnation, sent.lora_name, sent.digest) == (token, incarnation, lora_name, digest)
    with pytest.raises(Refused):  # no plan
        sent.checked()


def test_a_bucket_names_its_token_first():
    with pytest.raises(Refused, match="not an attempt token"):
        BucketSent.from_params({"index": "0"})
    sent = BucketSent.from_params({"epoch": "1", "version_id": "A", "seq": "2", "index": "x"})
    assert sent.incarnation is None
    with pytest.raises(Refused, match="bucket index 'x' is not an int"):
        sent.checked()


def test_a_cleanup_reply_that_does_not_say_what_was_loaded_means_unload():
    assert CleanupReply.from_json({"incarnation": "l"}) == CleanupReply("l", None, said=False)
    assert CleanupReply("l", None, said=False).must_unload
    assert not CleanupReply("l", None).must_unload
    with pytest.raises(ValueError):
        CleanupReply("l", Receipt("l", "n", "d", 1, "/p", "dir"), said=False)


def test_the_staging_answers_a_refusal_in_its_one_body():
    for e in (bad("no"), refuse("taken", "STAGE_CAPACITY")):
        assert e.to_json() == {"error": {"message": e.message, "code": e.code}}
    with pytest.raises(Refused):
        Refused.from_json(401, {"error": "Unauthorized"})  # SGLang's own middleware: not a staging refusal


async def test_the_diff_forms_literal_state_is_a_state_reply(tmp_path):
    """The 0.5.17 diff form's state route is source in SGLang's own file (a literal answer): it decodes as
    the StateReply the runtime form and the double build."""
    import types
    import uuid

    from lorapub.sglang_patch import release_0517
    from lorapub.sglang_patch.staging import EngineStaging

    class Counter:
        def value(self) -> int:
            return 2

    ref = types.SimpleNamespace(lora_id="id-1", lora_path="/p", pinned=True)
    registry = types.SimpleNamespace(get_all_adapters=lambda: {"n": ref}, _counters={"id-1": Counter()})
    tm = types.SimpleNamespace(lora_registry=registry, server_args=types.SimpleNamespace(max_loaded_loras=4),
                               _lorapub_pending_unloads=lambda: {"old": "id-0"})
    staging = EngineStaging(types.SimpleNamespace(adapters=dict, max_loaded_loras=lambda: None), incarnation="life",
                            stash_root=str(tmp_path))
    route = types.SimpleNamespace(get=lambda path: (lambda f: f))
    namespace = {"uuid": uuid, "app": route, "auth_level": lambda level: (lambda f: f),
                 "AuthLevel": types.SimpleNamespace(ADMIN_OPTIONAL=None), "_LORAPUB_STAGING": staging,
                 "_global_state": types.SimpleNamespace(tokenizer_manager=tm)}
    try:
        exec(release_0517.HTTP_ROUTE, namespace)
        answer = _over_the_wire(await namespace["lorapub_state"]())
    finally:
        staging.close()
    state = StateReply.from_json(answer)
    assert state.adapters == {"n": AdapterEntry("id-1", "/p", True, 2)} and state.pending_unloads == {"old": "id-0"}
    assert (state.sglang, state.patch, state.managed_patch, state.max_loaded_loras) == ("0.5.17", "diff", True, 4)
    assert state.staging == staging.staging_report()
