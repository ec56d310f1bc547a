"""The preparing helper process, for real, on a CPU: each load is read and processed by one SGLang
release's own LoRA code (``sglang_lora``: its ``LoRAConfig`` and ``LoRAAdapter``, compiled verbatim) in
a helper process spawned beside the "scheduler" (this test process), shipped back as one shared host
buffer through torch's own reductions (the very code path a CUDA IPC handle takes on a GPU), copied
into a buffer of the scheduler's process and installed by the scheduler's load path
(``test_prepared_load``'s stand-ins for SGLang's Scheduler and LoRAManager).

Failures: a helper killed mid-prepare, one that hangs past its deadline, and a handle shipped for a
load nobody takes any more each fail that load with a typed, named error, leave nothing behind, and the
next load runs (on a restarted helper where the old one is gone). A helper never outlives the process
that started it. Waits poll with generous bounds: spawning a helper imports torch, which takes seconds
on a loaded machine."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
import types

import pytest

from lorapub.sglang_patch import prepared_load
from lorapub.sglang_patch.prepared_load import helper as prepare_helper
from lorapub.sglang_patch.prepared_load import settings
from tests import sglang_real
from tests.helpers.waiting import PATIENCE
from tests.sglang_patch import sglang_lora
from tests.sglang_patch.test_prepared_load import Manager, Req, Scheduler

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

RELEASES = [r for r in ("0.5.17", "0.5.23") if sglang_real.release_root(r)]
#: a helper's start (spawn, import torch) on a busy 2-core machine, and anything after it
SLOW = 12 * PATIENCE
LAYERS, HIDDEN, R = 2, 16, 4


def peft_folder(root, name="adapter", seed=0, marker=None):
    """A PEFT folder as lorapub's staging writes it: q/k/v/o and gate/up/down of every layer, and lm_head."""
    folder = root / name
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(LAYERS):
        for module, out in (("self_attn.q_proj", HIDDEN), ("self_attn.k_proj", HIDDEN // 2),
                            ("self_attn.v_proj", HIDDEN // 2), ("self_attn.o_proj", HIDDEN),
                            ("mlp.gate_proj", 2 * HIDDEN), ("mlp.up_proj", 2 * HIDDEN), ("mlp.down_proj", HIDDEN)):
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(R, HIDDEN, generator=g)  # float32: cast to bf16
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, R, generator=g).to(torch.bfloat16)
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(R, HIDDEN, generator=g)
    safetensors_torch.save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": R, "lora_alpha": 2 * R,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]}))
    if marker:
        (folder / marker).write_text("")
    return str(folder)


def real_manager_cls(real):
    class RealManager(Manager):
        """The fake manager's load path, with the release's own config and weight read (SGLang's stock load)."""

        device, dtype = "cpu", torch.bfloat16
        base_hf_config = types.SimpleNamespace(num_hidden_layers=LAYERS, vocab_size=100)
        load_config = lora_backend = base_model = None

        def _load_lora_adapter(self, ref):
            try:
                self.configs[ref.lora_id] = real.LoRAConfig(ref.lora_path, base_vocab_size=100)
                self.load_lora_weights(ref)
                self.lora_refs[ref.lora_id] = ref
            except Exception as e:
                self.configs.pop(ref.lora_id, None)
                return {"success": False, "error": str(e), "lora_id": ref.lora_id}
            return {"success": True, "lora_id": ref.lora_id}

        def load_lora_weights(self, ref):  # SGLang's own: the folder's tensors through the same processing
            self.reads.append(ref.lora_id)
            adapter = real.LoRAAdapter(ref.lora_id, self.configs[ref.lora_id], self.base_hf_config, None, None)
            adapter.initialize_weights_from_tensors(
                safetensors_torch.load_file(os.path.join(ref.lora_path, "adapter_model.safetensors")))
            self.loras[ref.lora_id] = adapter

    return RealManager


def serving(release):
    """A scheduler whose loads are prepared by a real helper process running ``release``'s LoRA code."""
    root = sglang_real.release_root(release)
    real = sglang_lora.release(root)
    scheduler_cls, manager_cls = type("S", (Scheduler,), {}), real_manager_cls(real)
    prepared_load.install(scheduler_cls, manager_cls, type("Pool", (), {"load_lora_weight_to_buffer": lambda *a: None}))
    manager = manager_cls()
    scheduler = scheduler_cls(manager)
    kit = prepare_helper.kit_for(manager, processor="tests.sglang_patch.sglang_lora:process", root=root)
    client = prepare_helper.HelperClient(kit, settings.helper_deadline(), settings.helper_start_deadline())
    preparer = prepared_load.Preparer(scheduler, manager, helper=client)
    preparer.adapter_cls = real.LoRAAdapter
    preparer.read_config = lambda ref: real.LoRAConfig(ref.lora_path, base_vocab_size=100)
    scheduler.__dict__["_lorapub_preparer"] = preparer
    return scheduler, manager, preparer, real


@pytest.fixture
def stop():
    made = []
    yield made.append
    for preparer in made:
        preparer.close()


def pump(scheduler, condition, what, seconds=SLOW):
    """Run the scheduler's loop until ``condition()`` holds (a bound for a loaded machine, never a timing)."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {seconds:g} s")
        scheduler.process_input_requests([])
        scheduler.maybe_sleep_on_idle()
        time.sleep(0.005)


def replies(scheduler, n):
    pump(scheduler, lambda: len(scheduler.sent) >= n, f"reply {n}")
    return scheduler.sent[n - 1][1]


def nothing_left(manager, preparer, lora_id):
    assert lora_id not in manager.loras and lora_id not in manager.configs and lora_id not in manager.lora_refs
    assert manager.__dict__.get("_lorapub_prepared", {}) == {} and preparer.pending == [] and preparer.tokens == {}
    assert preparer.helper.wanted == set()


@pytest.mark.parametrize("release", RELEASES)
def test_a_load_through_the_helper_holds_exactly_the_weights_sglangs_own_load_gives(release, tmp_path, stop):
    scheduler, manager, preparer, real = serving(release)
    stop(preparer)
    path = peft_folder(tmp_path)
    scheduler.process_input_requests([Req("a", path)])
    out = replies(scheduler, 1)
    assert out["success"], out
    assert manager.reads == []  # SGLang's stock read never ran in this process
    got = manager.loras["a"]
    assert isinstance(got, real.LoRAAdapter) and got.config is manager.configs["a"]
    twin = real_manager_cls(real)()  # not patched: SGLang's own load, in this process
    twin.configs["a"] = real.LoRAConfig(path, base_vocab_size=100)
    twin.load_lora_weights(types.SimpleNamespace(lora_id="a", lora_path=path))
    want = twin.loras["a"]
    pairs = [(g.weights, w.weights) for g, w in zip(got.layers, want.layers)]
    pairs.append((got.embedding_layers, want.embedding_layers))
    storages = set()
    for g, w in pairs:
        assert set(g) == set(w) and g  # SGLang's normalised names (qkv_proj, gate_up_proj), all of them
        for name, t in w.items():
            expect = t.to(torch.bfloat16)  # the pool's dtype, as the install casts once
            assert g[name].dtype == expect.dtype and g[name].shape == expect.shape, name
            assert torch.equal(g[name], expect), name
            storages.add(g[name].untyped_storage().data_ptr())
    assert len(storages) == 1  # views of one buffer of this process
    assert any("qkv_proj" in n for n in got.layers[0].weights)
    stats = preparer.helper.stats()
    assert stats["live"] == 0  # the helper freed its buffer once the copy was taken
    # glibc keeps what the helper frees, so the next load reuses touched pages (docs/sglang-patch.md)
    assert stats["heap_kept"] is (sys.platform == "linux" and platform.libc_ver()[0] == "glibc")
    # one torch thread, as SGLang's scheduler process has (settings.HELPER_THREADS_ENV)
    assert stats["threads"] == 1


def test_a_helper_killed_mid_prepare_fails_the_load_and_the_next_load_runs_on_a_new_helper(tmp_path, stop, caplog):
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    slow = peft_folder(tmp_path, "slow", marker="slow")
    scheduler.process_input_requests([Req("a", slow)])
    started = os.path.join(slow, "started")
    pump(scheduler, lambda: os.path.exists(started), "the helper's preparation")
    first = preparer.helper.process.pid
    os.kill(first, signal.SIGKILL)
    out = replies(scheduler, 1)
    assert not out["success"]
    assert "died" in out["error"] and "restarted helper" in out["error"] and str(first) in out["error"]
    assert any(r.levelname == "ERROR" and "HelperDied" in r.getMessage() for r in caplog.records)
    nothing_left(manager, preparer, "a")
    assert manager.reads == []  # no silent fallback to a load on the scheduler thread
    scheduler.process_input_requests([Req("b", peft_folder(tmp_path, "next", seed=1))])
    assert replies(scheduler, 2)["success"]
    assert preparer.helper.process.pid != first and "b" in manager.loras


def test_a_helper_that_hangs_is_killed_at_its_deadline_and_the_load_fails(tmp_path, stop, monkeypatch):
    monkeypatch.setenv(settings.HELPER_DEADLINE_ENV, "2")
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    assert preparer.helper.deadline_s == 2.0
    scheduler.process_input_requests([Req("a", peft_folder(tmp_path, "hang", marker="hang"))])
    hung = preparer.helper.process.pid
    out = replies(scheduler, 1)
    assert not out["success"] and "within 2 s" in out["error"] and "killed" in out["error"]
    nothing_left(manager, preparer, "a")
    pump(scheduler, lambda: not _running(hung), "the hung helper's end")
    scheduler.process_input_requests([Req("b", peft_folder(tmp_path, "next", seed=1))])
    assert replies(scheduler, 2)["success"]


def test_a_handle_for_an_abandoned_load_is_refused_and_its_buffer_freed_by_the_helper(tmp_path, stop):
    """A CUDA IPC handle for a reclaimed version: shipped after nobody wants it, never opened."""
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    slow = peft_folder(tmp_path, "slow", marker="slow")
    scheduler.process_input_requests([Req("a", slow)])
    pump(scheduler, lambda: os.path.exists(os.path.join(slow, "started")), "the helper's preparation")
    assert preparer.abandon("a")  # its request answered elsewhere, or its adapter unloaded meanwhile
    assert not preparer.abandon("other")
    (tmp_path / "slow" / "go").write_text("")
    out = replies(scheduler, 1)
    assert not out["success"] and "reclaimed version" in out["error"]
    nothing_left(manager, preparer, "a")
    assert preparer.helper.stats()["live"] == 0
    # opening a stale shipment directly is refused, typed, before anything is mapped
    stale = prepare_helper.Shipped(99, b"never unpickled", (), 256, {})
    with pytest.raises(prepare_helper.StaleHandle, match="reclaimed version"):
        preparer.helper.open(stale)
    scheduler.process_input_requests([Req("b", peft_folder(tmp_path, "next", seed=1))])
    assert replies(scheduler, 2)["success"]  # the same helper serves the next load
    assert preparer.helper.stats()["live"] == 0


def _running(pid):
    """``pid`` exists and is not a zombie (an ended child not yet reaped still has an entry)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SCHEDULER_PROCESS = """
import sys, types, time
from lorapub.sglang_patch.prepared_load import helper
kit = helper.Kit(device="cpu", dtype=None, processor="tests.sglang_patch.sglang_lora:process")
client = helper.HelperClient(kit, 60, 600)
client.start()
client._ensure_ready(helper.Job(0, "", "start", ""))
print(client.process.pid, flush=True)
time.sleep(600)
"""


def test_the_helper_exits_when_the_scheduler_process_ends(tmp_path):
    """However the scheduler's process ends (here: killed, so no exit handler runs), its helper follows."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    parent = subprocess.Popen([sys.executable, "-c", SCHEDULER_PROCESS], stdout=subprocess.PIPE, env=env,
                              cwd=sglang_real.REPO)
    try:
        line = parent.stdout.readline()
        helper_pid = int(line)
        assert _running(helper_pid)
    finally:
        parent.kill()
        parent.wait()
    end = time.monotonic() + SLOW
    while _running(helper_pid):
        assert time.monotonic() < end, "the helper outlived its scheduler's process"
        time.sleep(0.05)


def test_a_helper_that_ended_between_loads_is_replaced_without_failing_a_load(tmp_path, stop):
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    scheduler.process_input_requests([Req("a", peft_folder(tmp_path))])
    assert replies(scheduler, 1)["success"]
    idle = preparer.helper.process.pid
    os.kill(idle, signal.SIGKILL)
    pump(scheduler, lambda: not preparer.helper.process.is_alive(), "the idle helper's end")
    scheduler.process_input_requests([Req("b", peft_folder(tmp_path, "next", seed=1))])
    assert replies(scheduler, 2)["success"]  # no load was in flight: none fails
    assert preparer.helper.process.pid != idle


def test_a_helper_dying_while_idle_fails_no_load_even_when_the_load_reaches_it_first(tmp_path, stop):
    """Seen live: a helper killed while idle took seconds to end (its CUDA context's teardown), and the
    next load was sent to it before it was gone. A load the helper never took is resent once to the
    helper that replaces it; a load it took and died on still fails (the test above)."""
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    scheduler.process_input_requests([Req("a", peft_folder(tmp_path))])
    assert replies(scheduler, 1)["success"]
    dying = preparer.helper.process.pid
    os.kill(dying, signal.SIGSTOP)  # alive to the client, but it takes nothing any more
    try:
        scheduler.process_input_requests([Req("b", peft_folder(tmp_path, "next", seed=1))])
        pump(scheduler, lambda: preparer.tokens, "the load's hand-over to the helper")
        time.sleep(0.2)  # the job is (most likely) in the stopped helper's pipe now; either way none may fail
    finally:
        os.kill(dying, signal.SIGKILL)
    out = replies(scheduler, 2)
    assert out["success"], out
    assert "b" in manager.loras and preparer.helper.process.pid != dying
    assert preparer.helper.wanted == set()


def test_a_helper_killed_while_it_starts_fails_no_load(tmp_path, stop):
    """Seen live: the helper started after a death was killed before it was ready, and the load waiting
    for it failed. A helper that dies starting took no load: the load goes once to its replacement."""
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    starting = preparer.helper.process.pid  # started with the preparer, not yet ready (it imports torch)
    os.kill(starting, signal.SIGSTOP)  # it never gets ready
    try:
        scheduler.process_input_requests([Req("a", peft_folder(tmp_path))])
        pump(scheduler, lambda: preparer.tokens, "the load waiting for the helper to be ready")
        time.sleep(0.2)
    finally:
        os.kill(starting, signal.SIGKILL)
    out = replies(scheduler, 1)
    assert out["success"], out
    assert "a" in manager.loras and preparer.helper.process.pid != starting
    assert preparer.helper.wanted == set()


def test_a_helper_started_with_the_scheduler_is_the_one_its_first_load_runs_on(tmp_path, stop, caplog):
    """``prestart`` (the scheduler's construction calls it, before SGLang builds the model) spawns the
    helper before its kit exists; the preparer takes that very process and sends it the kit, and the
    load through it holds the adapter. Live, a helper started only once the server was up made its first
    load wait 16-17 s."""
    import logging

    prepare_helper._take_prestarted()  # none left over from another test in this process
    prepare_helper.prestart()
    prepare_helper.prestart()  # one at most
    [(early, _)] = prepare_helper._prestarted
    with caplog.at_level(logging.INFO, logger="lorapub.sglang_patch.prepared_load"):
        scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    assert preparer.helper.process.pid == early.pid and prepare_helper._prestarted == []
    assert any("took the preparing helper process started with the scheduler" in r.getMessage() for r in caplog.records)
    scheduler.process_input_requests([Req("a", peft_folder(tmp_path))])
    assert replies(scheduler, 1)["success"] and "a" in manager.loras


def test_an_early_helper_that_died_before_it_was_taken_is_replaced_by_a_new_one(tmp_path, stop):
    prepare_helper._take_prestarted()
    prepare_helper.prestart()
    [(early, _)] = prepare_helper._prestarted
    early.kill()
    early.join(SLOW)
    scheduler, manager, preparer, _ = serving(RELEASES[-1])
    stop(preparer)
    assert preparer.helper.process.pid != early.pid
    scheduler.process_input_requests([Req("a", peft_folder(tmp_path))])
    assert replies(scheduler, 1)["success"] and "a" in manager.loras


@pytest.mark.parametrize("args, early", [
    (dict(enable_lora=True), True),
    (dict(enable_lora=None, lora_paths=["a=/x"]), True),
    (dict(enable_lora=False), False),  # no LoRA: no helper
    (dict(enable_lora=True, tp_size=2), False),  # several ranks keep SGLang's own load
    (dict(enable_lora=True, dp_size=2), False),
    (dict(enable_lora=True, device="cpu"), False),
])
def test_the_schedulers_construction_starts_the_helper_only_where_loads_will_be_prepared(monkeypatch, args, early):
    started = []
    monkeypatch.setattr(prepare_helper, "prestart", lambda: started.append(True))
    monkeypatch.delenv(prepared_load.ENV, raising=False)
    made = []

    class Stock:
        def __init__(self, server_args, port_args, gpu_id):
            made.append((server_args, port_args, gpu_id))

    prepared_load._wrap_init(Stock)
    server_args = types.SimpleNamespace(**{"tp_size": 1, "pp_size": 1, "dp_size": 1, "device": "cuda", **args})
    Stock(server_args, "ports", gpu_id=0)
    assert made == [(server_args, "ports", 0)]  # SGLang's own construction, as called
    assert started == ([True] if early else [])
    monkeypatch.setenv(prepared_load.ENV, "0")  # switched off: never
    Stock(server_args, "ports", 0)
    assert started == ([True] if early else [])


#: each memory-pool buffer of the test adapter's modules: (input size, output size, stacked parts)
POOL_MODULES = {"qkv_proj": (HIDDEN, 2 * HIDDEN, 3), "o_proj": (HIDDEN, HIDDEN, 1),
                "gate_up_proj": (HIDDEN, 4 * HIDDEN, 2), "down_proj": (HIDDEN, HIDDEN, 1)}


def real_pool(pool_cls):
    """An empty memory pool of the release's own fill (``sglang_lora.pool_class``) with buffers of SGLang's
    shapes for the test adapter, at a max rank above the adapter's (the fill writes part of each slot),
    and each layer's LoRA modules."""
    return sglang_lora.shaped_pool(pool_cls, POOL_MODULES, layers=LAYERS, max_r=2 * R, slots=3, vocab=100,
                                   lm_head_hidden=HIDDEN)


@pytest.mark.parametrize("release", RELEASES)
def test_the_helper_makes_every_later_versions_slot_image_from_the_fill_recorded_at_the_first(release, tmp_path, stop):
    """Slot images by default, through the real helper process and the release's own slot fill: the first
    version's image comes from SGLang's fill, recorded on the preparing thread; every later version of
    the same layout arrives with its image made by the helper (in the same shipped buffer as its weights),
    equal to what SGLang's fill makes of it, resident in a free slot at its install; a restarted helper is
    taught the plan again."""
    scheduler, manager, preparer, _ = serving(release)
    stop(preparer)
    assert preparer.slot_images
    stock_pool = sglang_lora.pool_class(sglang_real.release_root(release))
    pool_cls = type("Pool", (stock_pool,), {"__module__": sglang_lora.__name__})  # where its EMPTY_SLOT is
    prepared_load.install(type("S", (Scheduler,), {}), type("M", (Manager,), {}), pool_cls)  # fills from images
    pool, manager.lora_modules = real_pool(pool_cls)
    manager.memory_pool, manager.lm_head_module = pool, sglang_lora.LoRAModule()
    for n, name in enumerate(("v1", "v2", "v3"), 1):
        if name == "v3":
            preparer.helper.stop("a restart between versions")
        scheduler.process_input_requests([Req(name, peft_folder(tmp_path, name, seed=n))])
        assert replies(scheduler, n)["success"]
        adapter = manager.loras[name]
        image = adapter.__dict__[prepared_load.IMAGE_ATTR]
        weights = adapter.layers[0].weights
        made_by_helper = image.flats[0].untyped_storage().data_ptr() == next(iter(weights.values())).untyped_storage().data_ptr()
        assert made_by_helper is (name != "v1"), name
        twin, _ = real_pool(pool_cls)
        stock_pool.load_lora_weight_to_buffer(twin, name, 0, adapter, manager.lora_modules, None, manager.lm_head_module)
        want = [b[0] for b in prepared_load.slot_image.slot_buffers(twin)]
        assert [torch.equal(a, b) for a, b in zip(image.sources, want)] == [True] * len(want), name
        # resident at its install, in the slot its first batch would take: that batch copies nothing
        assert pool.uid_to_buffer_id[name] == n - 1 and pool.buffer_id_to_uid[n - 1] == name
        got = [b[n - 1] for b in prepared_load.slot_image.slot_buffers(pool)]
        assert [torch.equal(a, b) for a, b in zip(got, want)] == [True] * len(want), name
    assert preparer.helper.stats()["plans"] == 1 and len(preparer.helper.plans) == 1
