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
