from lorapub.core.version import VersionState
from lorapub.testing.fixtures import lora_snapshot


async def test_publish_bind_reclaim_lifecycle(deployment, doubles):
    a = await deployment.publish(lora_snapshot(1), "A")
    assert a.state is VersionState.PUBLISHED and a.collectives >= 2
    s_old = deployment.session("old")
    r1 = await s_old.generate({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}})
    b = await deployment.publish(lora_snapshot(2), "B")
    await s_old.generate({"input_ids": [1, 2, 3, 4] + r1["output_ids"], "sampling_params": {"max_new_tokens": 4}})
    s_new = deployment.session("new")
    await s_new.generate({"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 2}})
    assert s_old.binding.lora_name == a.lora_name and s_new.binding.lora_name == b.lora_name
    await s_old.close()
    await deployment.settle()
    state = await deployment.state()
    assert state.versions[a.version].state is VersionState.RECLAIMED
    for d in doubles.values():
        assert a.lora_name not in d.registered() and d.physical_unloads.count(a.lora_name) == 1
        assert b.lora_name in d.registered()
