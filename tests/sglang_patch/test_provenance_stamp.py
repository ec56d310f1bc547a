"""The stamp the patch adds to meta_info (docs/provenance.md, "Stamp"): the wrapper both forms install
on TokenizerManager._wait_one_response, against each release's own signature."""

import ast
import asyncio
import types

import pytest

from lorapub.sglang_patch import provenance
from lorapub.sglang_patch.staging import server
from lorapub.sglang_patch.targets import TM_FILE, PatchMismatch, function_source

from tests.sglang_patch.test_lifecycle_gaps import root_of

NAME = "relax_policy_lora@1-7-abcdef"


class FakeTM:
    server_args = types.SimpleNamespace(host="127.0.0.1", port=30000)

    async def _wait_one_response(self, obj, request=None):
        for i in range(2):
            yield {"text": str(i), "meta_info": {"id": obj.rid}}


def run(tm, obj):
    async def collect():
        return [out async for out in tm._wait_one_response(obj, None)]
    return asyncio.run(collect())


@pytest.mark.parametrize("release", ["0.5.17", "0.5.23"])
def test_each_release_has_the_signature_the_wrapper_relies_on(release):
    src = function_source(TM_FILE, "TokenizerManager", "_wait_one_response", root_of(release))
    args = [a.arg for a in ast.parse(src.strip()).body[0].args.args]
    assert args == ["self", "obj", "request"]


def test_managed_responses_carry_the_stamp_and_others_none(monkeypatch):
    class TM(FakeTM):
        pass

    provenance.install(TM)
    provenance.install(TM)  # idempotent
    staging = types.SimpleNamespace(digests={NAME: "d" * 64}, incarnation="life-1")
    monkeypatch.setattr(server, "CURRENT", staging)
    monkeypatch.delenv(provenance.ENGINE_NAME_ENV, raising=False)
    outs = run(TM(), types.SimpleNamespace(rid="r", lora_path=NAME, lora_id="7"))
    assert [o["meta_info"]["lorapub"] for o in outs] == [
        {"lora_name": NAME, "digest": "d" * 64, "engine": "127.0.0.1:30000", "incarnation": "life-1", "lora_id": "7"}
    ] * 2
    for other in (None, "my_own_adapter"):
        outs = run(TM(), types.SimpleNamespace(rid="r", lora_path=other, lora_id="3"))
        assert all("lorapub" not in o["meta_info"] for o in outs)
    assert TM.lorapub_stamps is True and not getattr(FakeTM, "lorapub_stamps", False)


def test_a_changed_signature_is_refused():
    class TM:
        async def _wait_one_response(self, request, obj):
            yield {}

    with pytest.raises(PatchMismatch):
        provenance.install(TM)


def test_each_response_carries_its_time_to_first_token_once_it_has_one(monkeypatch):
    """SGLang's own request times (created at arrival, first token when the first output came back):
    the wrapper reads the request's state before SGLang drops it, and adds nothing without them."""
    stats = types.SimpleNamespace(created_time=100.0, first_token_time=0.0)

    class TM(FakeTM):
        async def _wait_one_response(self, obj, request=None):
            yield {"text": "0", "meta_info": {}}  # no first token yet
            stats.first_token_time = 100.25
            self.rid_to_state.pop(obj.rid, None)  # SGLang drops the state when the request ends
            yield {"text": "1", "meta_info": {}}

    provenance.install(TM)
    monkeypatch.setattr(server, "CURRENT", None)
    tm = TM()
    tm.rid_to_state = {"r": types.SimpleNamespace(time_stats=stats)}
    outs = run(tm, types.SimpleNamespace(rid="r", lora_path=NAME, lora_id="7"))
    assert provenance.TTFT_KEY not in outs[0]["meta_info"]
    assert outs[1]["meta_info"][provenance.TTFT_KEY] == pytest.approx(0.25)
    tm.rid_to_state = {}  # a release that keeps no state under the rid: no figure, no error
    stats.first_token_time = 0.0
    assert all(provenance.TTFT_KEY not in o["meta_info"] for o in run(tm, types.SimpleNamespace(rid="r", lora_path=None)))


@pytest.mark.parametrize("release", ["0.5.17", "0.5.23"])
def test_each_release_keeps_the_request_times_the_wrapper_reads(release):
    import os

    root = root_of(release)
    tm_source = open(os.path.join(root, TM_FILE)).read()
    assert "time_stats: APIServerReqTimeStats" in tm_source and "state = self.rid_to_state[obj.rid]" in tm_source
    stats = open(os.path.join(root, "srt", "observability", "req_time_stats.py")).read()
    cls = stats[stats.index("class APIServerReqTimeStats"):]
    assert "created_time: float" in cls and "first_token_time: float" in cls
