"""The scheduler side of lorapub's patch: an adapter load is prepared off the scheduler thread, installed by
the release's own load path on a later loop iteration, and answered then; anything it cannot take keeps
SGLang's own blocking load. The classes here follow the control flow of SGLang's Scheduler and
LoRAManager (``load_lora_adapter`` -> ``_load_lora_adapter`` -> ``load_lora_weights``); the helper process
that prepares each load is stood in for here by :class:`FakeHelper` (its interface, served on the
preparing thread); ``test_prepare_helper.py`` runs the real helper process with SGLang's own LoRA
processing. On the GPU the same code is measured against live SGLang (``bench/live_load_gap.py``)."""

from __future__ import annotations

import itertools
import threading
import types
import time

import pytest

from lorapub.sglang_patch import prepared_load
from lorapub.sglang_patch.prepared_load import helper as prepare_helper

pytest.importorskip("torch")


class Config:
    def __init__(self, path):
        self.path = path
        self.hf_config = {"r": 8, "path": path}


class Adapter:
    def __init__(self, uid, config):
        self.uid, self.config, self.read_by = uid, config, threading.current_thread().name
        self.layers, self.embedding_layers = [], {}


class Manager:
    """SGLang's LoRAManager load path, reduced to what the patch relies on."""

    device = "cpu"

    def __init__(self):
        self.configs, self.loras, self.lora_refs = {}, {}, {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail_read = set()
        self.reads = []  # the threads SGLang's own weight read ran on

    def _load_lora_adapter(self, ref):
        try:
            self.configs[ref.lora_id] = Config(ref.lora_path)
            self.load_lora_weights(ref)
            self.lora_refs[ref.lora_id] = ref
        except Exception as e:
            self.configs.pop(ref.lora_id, None)
            return {"success": False, "error": str(e), "lora_id": ref.lora_id}
        return {"success": True, "lora_id": ref.lora_id, "by": threading.current_thread().name}

    def load_lora_weights(self, ref):
        self.reads.append(threading.current_thread().name)
        assert self.gate.wait(5)
        if ref.lora_path in self.fail_read:
            raise OSError(f"cannot read {ref.lora_path}")
        self.loras[ref.lora_id] = Adapter(ref.lora_id, self.configs[ref.lora_id])

    def unload(self, lora_id):
        del self.loras[lora_id], self.configs[lora_id], self.lora_refs[lora_id]


class Req:
    def __init__(self, lora_id, path=None):
        self.lora_id, self.lora_name, self.lora_path, self.pinned = lora_id, f"name-{lora_id}", path or f"/p/{lora_id}", True

    def to_ref(self):
        return types.SimpleNamespace(lora_id=self.lora_id, lora_name=self.lora_name, lora_path=self.lora_path,
                                     pinned=self.pinned)


class Scheduler:
    """SGLang's Scheduler dispatch: a control request's reply is sent when the handler returns one."""

    def __init__(self, manager, tp_size=1):
        self.tp_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(lora_manager=manager))
        self.server_args = types.SimpleNamespace(tp_size=tp_size, pp_size=1, dp_size=1)
        self.sent, self.slept, self.ran = [], 0, []

    def load_lora_adapter(self, recv_req):
        return self.tp_worker.model_runner.lora_manager._load_lora_adapter(recv_req.to_ref())

    def process_input_requests(self, recv_reqs):
        for req in recv_reqs:
            out = self.load_lora_adapter(req)
            if out is not None:
                self.send_control_output(out, req)

    def send_control_output(self, output, recv_req):
        self.sent.append((recv_req.lora_id, output))

    def maybe_sleep_on_idle(self):
        self.slept += 1

    def run_batch(self, batch, *args):
        self.ran.append(batch)
        return "result"


class Pool:
    """SGLang's LoRAMemoryPool as the slot fill sees it: per-layer buffers with one row per slot, and a fill
    that writes an adapter's weights into the rank-sized part of a slot and zeroes modules it lacks."""

    max_loras_per_batch = 3

    def __init__(self, layers=2, max_r=4, hidden=6):
        import torch

        self.pin_memory_available = True
        self.A_buffer = {m: [torch.zeros(3, max_r, hidden) for _ in range(layers)] for m in ("qkv_proj", "o_proj")}
        self.B_buffer = {m: [torch.zeros(3, hidden, max_r) for _ in range(layers)] for m in ("qkv_proj", "o_proj")}
        self.embedding_A_buffer, self.embedding_B_buffer, self.new_embeddings_buffer = {}, {}, {}
        self.lm_head_A_buffer = {"lm_head": torch.zeros(3, max_r, hidden)}
        self.lm_head_B_buffer = {}
        self.fills = []  # (uid, slot, whether it may pin host memory)

    def load_lora_weight_to_buffer(self, uid, buffer_id, lora_adapter, lora_modules, embed, lm_head):
        self.fills.append((uid, buffer_id, self.pin_memory_available))
        r = lora_adapter.config.r
        for layer_id, layer in enumerate(lora_adapter.layers):
            for module, bufs in self.A_buffer.items():
                a, b = layer.weights.get(f"{module}.lora_A"), layer.weights.get(f"{module}.lora_B")
                for view, w in ((bufs[layer_id][buffer_id][:r], a),
                                (self.B_buffer[module][layer_id][buffer_id][:, :r], b)):
                    view.zero_() if w is None else view.copy_(w)
        self.lm_head_A_buffer["lm_head"][buffer_id][:r].copy_(lora_adapter.embedding_layers["lm_head.lora_A"])


def lora(r=2, seed=0, layers=2, hidden=6):
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = [{"qkv_proj.lora_A": torch.randn(r, hidden, generator=g), "qkv_proj.lora_B": torch.randn(hidden, r, generator=g)}
               for _ in range(layers)]  # no o_proj: its slot part must be zeroed
    return types.SimpleNamespace(uid=f"u{seed}", config=types.SimpleNamespace(r=r),
                                 layers=[types.SimpleNamespace(weights=w) for w in weights],
                                 embedding_layers={"lm_head.lora_A": torch.randn(r, hidden, generator=g)})


@pytest.fixture
def classes():
    scheduler_cls = type("Scheduler", (Scheduler,), {})
    manager_cls = type("Manager", (Manager,), {})
    prepared_load.install(scheduler_cls, manager_cls, type("Pool", (Pool,), {}))
    return scheduler_cls, manager_cls


class FakeHelper:
    """The helper process's interface (``prepare_helper.HelperClient``), served on the preparing thread:
    a preparation waits for the manager's gate, fails for a path in its ``fail_read``, and ships one
    host buffer holding ``weights`` one-byte weights."""

    process = None

    def __init__(self, manager, weights=1, timings=None):
        import torch

        self.manager, self.weights, self.timings = manager, weights, timings or {}
        self.tokens, self.wanted, self.released, self.buffers = itertools.count(1), set(), [], {}
        self.torch = torch

    def new_job(self, ref):
        job = prepare_helper.Job(next(self.tokens), ref.lora_id, ref.lora_name, ref.lora_path)
        self.wanted.add(job.token)
        return job

    def prepare(self, job):
        assert self.manager.gate.wait(5)
        if job.lora_path in self.manager.fail_read:
            self.wanted.discard(job.token)
            raise prepare_helper.HelperFailed(f"cannot read {job.lora_path}")
        entries = tuple(prepare_helper.Entry("embedding_layers", f"w{i}", "uint8", (1,), 256 * i, 1)
                        for i in range(self.weights))
        self.buffers[job.token] = self.torch.arange(256 * max(1, self.weights), dtype=self.torch.uint8)
        return prepare_helper.Shipped(job.token, b"", entries, 256 * max(1, self.weights), dict(self.timings))

    def open(self, shipped):
        if shipped.token not in self.wanted:
            raise prepare_helper.StaleHandle("stale")
        return self.buffers[shipped.token]

    def release(self, token, opened):
        self.wanted.discard(token)
        self.released.append((token, opened))
        self.buffers.pop(token, None)

    def abandon(self, token):
        self.wanted.discard(token)

    def close(self):
        pass


def preparing(classes, **kw):
    scheduler_cls, manager_cls = classes
    manager = manager_cls()
    scheduler = scheduler_cls(manager, **kw)
    preparer = prepared_load.Preparer(scheduler, manager, helper=FakeHelper(manager))
    preparer.read_config = lambda ref: Config(ref.lora_path)
    preparer.new_adapter = lambda ref, config: Adapter(ref.lora_id, config)
    scheduler.__dict__["_lorapub_preparer"] = preparer
    return scheduler, manager, preparer


def run_until(scheduler, n, *, loops=2000):
    for _ in range(loops):
        scheduler.process_input_requests([])
        scheduler.maybe_sleep_on_idle()
        if len(scheduler.sent) >= n:
            return
    raise AssertionError(f"only {len(scheduler.sent)} of {n} replies were sent")


def test_the_read_runs_off_the_scheduler_thread_and_the_reply_waits_for_the_install(classes):
    scheduler, manager, preparer = preparing(classes)
    manager.gate.clear()  # the read blocks: the scheduler must keep looping
    scheduler.process_input_requests([Req("a")])
    for _ in range(50):
        scheduler.process_input_requests([])
        scheduler.maybe_sleep_on_idle()
    assert scheduler.sent == [] and "a" not in manager.loras and "a" not in manager.lora_refs
    assert scheduler.slept == 0  # an idle scheduler does not sleep on its sockets while a load prepares
    manager.gate.set()
    run_until(scheduler, 1)
    [(lora_id, out)] = scheduler.sent
    assert lora_id == "a" and out["success"]
    assert out["by"] == threading.current_thread().name  # SGLang's own bookkeeping on the scheduler thread
    adapter = manager.loras["a"]
    assert adapter.read_by.startswith("lorapub-prepare")  # the weights are the prepared ones
    assert manager.reads == []  # SGLang's own weight read never ran
    assert float(adapter.embedding_layers["w0"][0]) == 0  # a view of the buffer the helper shipped
    assert preparer.helper.released == [(1, True)]  # copied, then released to the helper
    assert adapter.config is manager.configs["a"]  # bound to the config SGLang's load validated
    assert manager.__dict__["_lorapub_prepared"] == {} and preparer.pending == []
    slept = scheduler.slept
    scheduler.maybe_sleep_on_idle()
    assert scheduler.slept == slept + 1  # nothing pending: the stock idle sleep again


def test_replies_keep_the_order_loads_arrived_in(classes):
    scheduler, manager, _ = preparing(classes)
    scheduler.process_input_requests([Req("a"), Req("b"), Req("c")])
    run_until(scheduler, 3)
    assert [lora_id for lora_id, _ in scheduler.sent] == ["a", "b", "c"]
    assert all(out["success"] for _, out in scheduler.sent)


def test_a_failed_preparation_fails_the_load_with_its_error_and_never_loads_on_the_scheduler_thread(classes):
    scheduler, manager, _ = preparing(classes)
    manager.fail_read.add("/p/bad")
    scheduler.process_input_requests([Req("bad", "/p/bad"), Req("ok")])
    run_until(scheduler, 2)
    (bad_id, bad), (ok_id, ok) = scheduler.sent
    assert (bad_id, ok_id) == ("bad", "ok")
    assert not bad["success"] and "cannot read /p/bad" in bad["error"]  # through SGLang's own failure reply
    assert "bad" not in manager.loras and "bad" not in manager.configs
    assert manager.reads == []  # no fallback: SGLang's weight read never ran on the scheduler thread
    assert ok["success"] and manager.loras["ok"].read_by.startswith("lorapub-prepare")


def test_a_changed_config_is_read_again_by_the_stock_path(classes):
    scheduler, manager, preparer = preparing(classes)
    stale = Config("/p/a")
    stale.hf_config = {"r": 16}
    preparer.read_config = lambda ref: stale
    scheduler.process_input_requests([Req("a")])
    run_until(scheduler, 1)
    assert scheduler.sent[0][1]["success"]
    assert manager.loras["a"].read_by == threading.current_thread().name  # not the prepared copy


def test_an_id_already_loaded_or_already_preparing_keeps_the_stock_path(classes):
    scheduler, manager, preparer = preparing(classes)
    manager.gate.clear()
    req = Req("a")
    assert preparer.submit(req, type(scheduler).load_lora_adapter.__wrapped__)
    assert not preparer.submit(Req("a"), type(scheduler).load_lora_adapter.__wrapped__)
    manager.gate.set()
    run_until(scheduler, 1)
    assert not preparer.submit(Req("a"), type(scheduler).load_lora_adapter.__wrapped__)


def test_only_single_gpu_cuda_schedulers_prepare(classes, monkeypatch):
    scheduler_cls, manager_cls = classes
    cpu = scheduler_cls(manager_cls())
    assert prepared_load.preparer_of(cpu) is None  # host device: SGLang's own load
    out = cpu.load_lora_adapter(Req("a"))
    assert out["success"] and out["by"] == threading.current_thread().name
    manager = manager_cls()
    manager.device = types.SimpleNamespace(type="cuda")
    assert prepared_load.preparer_of(scheduler_cls(manager, tp_size=2)) is None
    monkeypatch.setenv(prepared_load.ENV, "0")
    assert prepared_load.preparer_of(scheduler_cls(manager)) is None


def test_a_peft_folder_is_read_exactly_as_safetensors_reads_it(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(16, 8, generator=g),
        "odd": torch.randn(3, generator=g).to(torch.float16),  # leaves the next tensor unaligned
        "after_odd": torch.randn(5, generator=g, dtype=torch.float64),
        "ints": torch.arange(7, dtype=torch.int32),
    }
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text("{}")
    got = prepared_load.read_peft_folder(str(folder))
    want = load_file(str(folder / "adapter_model.safetensors"))
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    # the tensors map the file privately: writing one leaves the file as it was, and they stay readable
    # once the staging removed the folder (it releases an attempt's bytes after its end)
    got["ints"][0] = 99
    assert torch.equal(load_file(str(folder / "adapter_model.safetensors"))["ints"], tensors["ints"])
    import shutil

    again = prepared_load.read_peft_folder(str(folder))
    shutil.copytree(folder, tmp_path / "kept")
    shutil.rmtree(folder)
    for name, t in want.items():
        assert torch.equal(again[name], t), name
    folder = tmp_path / "kept"
    # any other layout is left to SGLang's own reader
    (folder / "extra.bin").write_bytes(b"x")
    assert prepared_load.read_peft_folder(str(folder)) is None
    assert prepared_load.read_peft_folder(str(tmp_path / "missing")) is None
    assert prepared_load.read_peft_folder("org/hub-adapter") is None


def test_install_is_idempotent(classes):
    scheduler_cls, manager_cls = classes
    pool_cls = type("Pool", (Pool,), {})
    prepared_load.install(scheduler_cls, manager_cls, pool_cls)
    before = (dict(vars(scheduler_cls)), dict(vars(manager_cls)), dict(vars(pool_cls)))
    prepared_load.install(scheduler_cls, manager_cls, pool_cls)
    assert (dict(vars(scheduler_cls)), dict(vars(manager_cls)), dict(vars(pool_cls))) == before


def slots(pool, slot):
    return [b[slot].clone() for b in prepared_load.slot_image.slot_buffers(pool)]


def test_a_slot_image_fills_a_slot_as_sglangs_own_fill_does_and_touches_nothing_else(monkeypatch):
    import torch

    monkeypatch.setenv(prepared_load.IMAGE_ENV, "1")
    pool_cls = type("Pool", (Pool,), {})
    prepared_load.install(type("S", (Scheduler,), {}), type("M", (Manager,), {}), pool_cls)
    pool, twin = pool_cls(), pool_cls()
    for p in (pool, twin):  # an earlier adapter's weights are still in every slot
        for b in prepared_load.slot_image.slot_buffers(p):
            b.fill_(7.0)
    adapter = lora(r=2, seed=1)
    manager = types.SimpleNamespace(memory_pool=pool, lora_modules=[{}, {}])
    image = prepared_load.build_slot_image(manager, adapter)
    assert image is not None
    assert pool.fills == [("u1", 0, False)]  # SGLang's own fill ran once, on a copy, never pinning
    assert all(torch.equal(b, torch.full_like(b, 7.0)) for b in prepared_load.slot_image.slot_buffers(pool))  # pool untouched
    adapter.__dict__[prepared_load.IMAGE_ATTR] = image
    others = slots(pool, 0), slots(pool, 2)

    pool.load_lora_weight_to_buffer("u1", 1, adapter, [{}, {}], None, None)  # the first batch's fill
    assert pool.fills == [("u1", 0, False)]  # served by the image, not by SGLang's per-weight fill
    type(twin).load_lora_weight_to_buffer.__wrapped__(twin, "u1", 1, adapter, [{}, {}], None, None)
    r = adapter.config.r
    for got, want in zip(slots(pool, 1), slots(twin, 1)):
        # every part SGLang's fill writes is equal; the part beyond the rank, which the kernels never read,
        # holds zeros instead of the previous adapter's weights
        if got.shape[-1] == 6:  # A buffers: rank rows
            assert torch.equal(got[:r], want[:r]) and not got[r:].any()
        else:  # B buffers: rank columns
            assert torch.equal(got[:, :r], want[:, :r]) and not got[:, r:].any()
    assert not pool.A_buffer["o_proj"][0][1].any() and not pool.B_buffer["o_proj"][1][1].any()  # zeroed as SGLang does
    assert [torch.equal(a, b) for a, b in zip(others[0] + others[1], slots(pool, 0) + slots(pool, 2))] == [True] * (
        2 * len(others[0]))  # the other slots are untouched


def test_a_slot_fill_without_a_fitting_image_is_sglangs_own(monkeypatch):
    monkeypatch.setenv(prepared_load.IMAGE_ENV, "1")
    pool_cls = type("Pool", (Pool,), {})
    prepared_load.install(type("S", (Scheduler,), {}), type("M", (Manager,), {}), pool_cls)
    pool, other = pool_cls(), pool_cls()
    plain = lora(seed=2)
    pool.load_lora_weight_to_buffer("u2", 0, plain, [{}, {}], None, None)
    assert pool.fills == [("u2", 0, True)]  # no image: SGLang's own fill
    imaged = lora(seed=3)
    imaged.__dict__[prepared_load.IMAGE_ATTR] = prepared_load.build_slot_image(
        types.SimpleNamespace(memory_pool=other, lora_modules=[{}, {}]), imaged)
    pool.load_lora_weight_to_buffer("u3", 1, imaged, [{}, {}], None, None)
    assert pool.fills[-1] == ("u3", 1, True)  # an image made for another pool is not used
    last = list(other.B_buffer)[-1]  # a buffer other than the first replaced in place in its dict
    other.B_buffer[last] = [b.clone() for b in other.B_buffer[last]] if isinstance(
        other.B_buffer[last], list) else other.B_buffer[last].clone()
    other.load_lora_weight_to_buffer("u3", 1, imaged, [{}, {}], None, None)
    assert other.fills[-1] == ("u3", 1, True)  # nor one whose pool buffers were replaced
    odd = pool_cls()
    odd.lm_head_A_buffer = {"lm_head": odd.lm_head_A_buffer["lm_head"][:2]}  # not one row per slot
    assert prepared_load.build_slot_image(types.SimpleNamespace(memory_pool=odd, lora_modules=[{}, {}]), lora()) is None
    broken = lora(seed=4)
    del broken.embedding_layers["lm_head.lora_A"]  # SGLang's fill refuses it: no image, the first batch reports it
    assert prepared_load.build_slot_image(types.SimpleNamespace(memory_pool=pool_cls(), lora_modules=[{}, {}]),
                                          broken) is None


def shipped_views(adapter, plans=None):
    """``adapter`` as the scheduler's process holds it after a hand-over: its weights packed by the helper's
    ``pack`` into one buffer (with the slot image after them, where ``plans`` fits), the adapter's weight
    dicts views of that buffer. Returns the buffer, the entries and the image's spans."""
    import torch

    buf, entries, spans = prepare_helper.pack(adapter, torch.float32, "cpu", plans=plans)
    places = dict(prepared_load.reading.weight_places(adapter))
    for e in entries:
        places[e.where][e.name] = buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
    return buf, tuple(entries), spans


def test_a_recorded_fill_makes_the_next_versions_image_without_running_sglangs_fill():
    """The first adapter of a layout gets its image from SGLang's own fill, recorded; the plan learned
    from it makes a later adapter of the same layout (other values: the next version) the very image
    SGLang's fill makes for it, through the helper's ``pack``, with no fill run."""
    import torch

    pool_cls = type("Pool", (Pool,), {})
    pool = pool_cls()
    manager = types.SimpleNamespace(memory_pool=pool, lora_modules=[{}, {}])
    first = lora(r=2, seed=1)
    buf, key, spans = shipped_views(first)
    assert spans == ()  # no plan yet: no image from the helper
    image = prepared_load.build_slot_image(manager, first, learn_from=(buf, key))
    assert image is not None and image.plan is not None and image.plan.key == key
    assert {op[0] for op in image.plan.ops} == {"copy", "zero"}  # o_proj, which the adapter lacks, is zeroed
    assert pool.fills == [("u1", 0, False)]  # SGLang's fill ran once, for the first version

    nxt = lora(r=2, seed=2)  # the next version: same names and shapes, other values
    buf2, key2, spans2 = shipped_views(nxt, plans={image.plan.key: image.plan})
    assert key2 == key and len(spans2) == 1 and spans2[0].offset >= max(e.offset + e.nbytes for e in key2)
    steps = []
    made = prepared_load.slot_image.image_from_flats(pool, [span.of(buf2) for span in spans2], image.plan,
                                                     step=lambda: steps.append(1))
    assert made is not None and pool.fills == [("u1", 0, False)]  # no fill ran for it
    assert steps  # its views are made in the preparing thread's gate steps
    want = prepared_load.build_slot_image(manager, nxt)  # what SGLang's own fill makes of it
    assert [torch.equal(a, b) for a, b in zip(made.sources, want.sources)] == [True] * len(want.sources)
    assert any(t.any() for t in made.sources) and not torch.equal(made.sources[0], image.sources[0])
    made.fill(2)
    assert [torch.equal(b[2], w) for b, w in zip(prepared_load.slot_image.slot_buffers(pool), want.sources)] == [
        True] * len(want.sources)

    other = lora(r=3, seed=3)  # another rank: another layout, which this plan does not fit
    assert shipped_views(other, plans={image.plan.key: image.plan})[2] == ()
    resized = pool_cls(max_r=5)  # a pool of another shape: the plan's image is not used for it
    assert prepared_load.slot_image.image_from_flats(resized, [span.of(buf2) for span in spans2], image.plan) is None


class ComputingPool(Pool):
    """A fill that copies a tensor it computed from a weight (as SGLang's MoE path scales some)."""

    def load_lora_weight_to_buffer(self, uid, buffer_id, lora_adapter, *args):
        super().load_lora_weight_to_buffer(uid, buffer_id, lora_adapter, *args)
        self.lm_head_A_buffer["lm_head"][buffer_id][:1].copy_(lora_adapter.embedding_layers["lm_head.lora_A"][:1] * 2)


class AddingPool(Pool):
    """A fill that writes into the slot with another in-place operation than a copy."""

    def load_lora_weight_to_buffer(self, uid, buffer_id, lora_adapter, *args):
        super().load_lora_weight_to_buffer(uid, buffer_id, lora_adapter, *args)
        self.lm_head_A_buffer["lm_head"][buffer_id].add_(1.0)


@pytest.mark.parametrize("pool_cls", [ComputingPool, AddingPool])
def test_a_fill_that_is_no_gather_from_the_shipped_weights_learns_no_plan_and_still_images(pool_cls):
    import torch

    pool = pool_cls()
    manager = types.SimpleNamespace(memory_pool=pool, lora_modules=[{}, {}])
    adapter = lora(r=2, seed=5)
    buf, key, _ = shipped_views(adapter)
    image = prepared_load.build_slot_image(manager, adapter, learn_from=(buf, key))
    assert image is not None and image.plan is None  # each load of this layout runs SGLang's fill, as before
    twin = pool_cls()
    pool_cls.load_lora_weight_to_buffer(twin, "u5", 0, adapter, [{}, {}], None, None)
    assert [torch.equal(a, b[0]) for a, b in zip(image.sources, prepared_load.slot_image.slot_buffers(twin))] == [
        True] * len(image.sources)


@pytest.mark.parametrize("broken", ["note", "check"])
def test_a_recording_that_fails_costs_the_plan_never_the_image(monkeypatch, broken):
    """Recording SGLang's fill, or checking what was recorded, raising (an unforeseen tensor, a device
    error) leaves the fill and its image as they would be unwatched; only the plan is lost."""
    import torch

    from lorapub.sglang_patch.prepared_load import image_plan

    def boom(*a, **k):
        raise RuntimeError("unforeseen")

    if broken == "note":
        monkeypatch.setattr(image_plan._recorder_class(), "_note", boom)
    else:
        monkeypatch.setattr(prepared_load.slot_image, "learn", boom)
    pool = Pool()
    manager = types.SimpleNamespace(memory_pool=pool, lora_modules=[{}, {}])
    adapter = lora(r=2, seed=6)
    buf, key, _ = shipped_views(adapter)
    image = prepared_load.build_slot_image(manager, adapter, learn_from=(buf, key))
    want = prepared_load.build_slot_image(manager, adapter)
    assert image is not None and image.plan is None
    assert [torch.equal(a, b) for a, b in zip(image.sources, want.sources)] == [True] * len(want.sources)


def test_schedulers_start_through_the_patched_entry_unless_the_caller_chose_one():
    def stock_entry(*a, **k):
        raise AssertionError("never called here")

    def own_entry(*a, **k):
        raise AssertionError("never called here")

    seen = []

    class Engine:
        @classmethod
        def _launch_subprocesses(cls, server_args=None, run_scheduler_process_func=None, **kw):
            seen.append(run_scheduler_process_func)

    prepared_load.route_schedulers(Engine, stock_entry)
    prepared_load.route_schedulers(Engine, stock_entry)  # idempotent
    Engine._launch_subprocesses(server_args=1, run_scheduler_process_func=stock_entry)
    Engine._launch_subprocesses(server_args=1, run_scheduler_process_func=own_entry)
    assert seen == [prepared_load.run_scheduler_process, own_entry]
    import pickle

    # spawn pickles the entry by reference: it must be importable in the child
    assert pickle.loads(pickle.dumps(prepared_load.run_scheduler_process)) is prepared_load.run_scheduler_process


def test_the_device_copy_holds_every_tensor_exactly_across_chunk_boundaries(monkeypatch):
    """The packing of the helper's ``pack`` (pinned chunks -> one device buffer), run on the host: tensors
    of several dtypes and sizes, some spanning several chunks, come back equal from the entries it
    ships, cast to the pool's dtype."""
    import contextlib

    import torch

    class Event:
        def record(self, stream):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    g = torch.Generator().manual_seed(0)
    layers = [types.SimpleNamespace(weights={
        "a": torch.randn(7, 13, generator=g, dtype=torch.float32),  # cast to the pool's bf16
        "b": torch.randn(300, 5, generator=g).to(torch.bfloat16),  # spans several 1000-byte chunks
        "c": torch.randn(1, generator=g).to(torch.bfloat16),
        "t": torch.randn(9, 4, generator=g).to(torch.bfloat16).t(),  # not contiguous
    }) for _ in range(3)]
    adapter = types.SimpleNamespace(layers=layers, embedding_layers={"e": torch.arange(10, dtype=torch.int64)})
    want = {(i, k): v.clone() for i, layer in enumerate(layers) for k, v in layer.weights.items()}
    want[("embedding_layers", "e")] = adapter.embedding_layers["e"].clone()
    chunks = [torch.zeros(1000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)]
    buf, entries, image = prepare_helper.pack(adapter, torch.bfloat16, "cpu",
                                              types.SimpleNamespace(synchronize=lambda: None), chunks)
    assert image == ()  # no plan for this layout: no image
    assert len(entries) == len(want) and buf.numel() >= sum(e.nbytes for e in entries)
    assert all(e.offset % prepare_helper.ALIGN == 0 for e in entries)
    for e in entries:
        got = buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        t = want[(e.where, e.name)]
        expect = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got.dtype == expect.dtype and got.shape == expect.shape and torch.equal(got, expect), e.name
    # without chunks (a host manager: tests), the same layout in shared memory
    shared, same, _ = prepare_helper.pack(adapter, torch.bfloat16, "cpu")
    assert same == entries and shared.is_shared()
    assert all(torch.equal(shared[e.offset:e.offset + e.nbytes], buf[e.offset:e.offset + e.nbytes]) for e in entries)
    # with a plan for this layout, the image follows the weights, made from the weights just copied: here
    # layer 1's "b" (spanning chunks) transposed into the image, and a zeroed stretch
    b = next(e for e in entries if e.where == 1 and e.name == "b")
    plan = prepared_load.image_plan.ImagePlan(tuple(entries), (), (("bfloat16", 2000),), (
        ("copy", 0, (5, 300), (300, 1), 10, "bfloat16", (5, 300), (1, 5), b.offset // 2),
        ("zero", 0, (10,), (1,), 0)))
    imaged, _, spans = prepare_helper.pack(adapter, torch.bfloat16, "cpu",
                                           types.SimpleNamespace(synchronize=lambda: None), chunks, {plan.key: plan})
    [span] = spans
    assert span.offset >= buf.numel() - prepare_helper.ALIGN and span.offset % prepare_helper.ALIGN == 0
    image = span.of(imaged)
    assert torch.equal(image[10:1510].view(5, 300), want[(1, "b")].t()) and not image[:10].any() and not image[1510:].any()
    assert all(torch.equal(imaged[e.offset:e.offset + e.nbytes], buf[e.offset:e.offset + e.nbytes]) for e in entries)


@pytest.mark.parametrize("raw, on", [(None, True), ("1", True), ("", True), ("0", False), ("off", False)])
def test_slot_images_are_made_unless_the_server_turns_them_off(classes, monkeypatch, raw, on):
    server_env(monkeypatch, prepared_load.IMAGE_ENV, raw)
    assert preparing(classes)[2].slot_images is on
    pool_cls = type("Pool", (Pool,), {})
    prepared_load.install(type("S", (Scheduler,), {}), type("M", (Manager,), {}), pool_cls)
    # off: SGLang's own fill, untouched; on: the fill an image serves
    assert (pool_cls.load_lora_weight_to_buffer is Pool.load_lora_weight_to_buffer) is not on


@pytest.mark.parametrize("raw, seconds", [("200", 0.0002), ("0", None), ("-5", None), ("fast", None), ("", None)])
def test_a_bad_switch_interval_is_ignored_not_fatal(monkeypatch, raw, seconds):
    monkeypatch.setenv(prepared_load.SWITCH_ENV, raw)
    assert prepared_load.settings.switch_interval() == seconds


def test_the_trace_reports_the_iterations_that_ended_while_a_load_was_prepared(classes, caplog, monkeypatch):
    _, _, preparer = preparing(classes)
    preparer.ticks.extend([0.0, 0.010, 0.020, 0.050, 0.060, 0.100])  # iterations of 10, 10, 30, 10, 40 ms
    caplog.set_level("INFO", logger=prepared_load.logger.name)
    with monkeypatch.context() as m:
        m.setattr(time, "perf_counter", lambda: 0.100)
        preparer._log_iterations("B", since=0.050)  # prepared from 50 to 100 ms; before: 0 to 50 ms
    [line] = [r.getMessage() for r in caplog.records if "scheduler iterations" in r.getMessage()]
    assert "while preparing B (50 ms): n=2 max 40.0 ms" in line
    assert "before: n=3 max 30.0 ms" in line


class Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend


def batch(extend):
    return types.SimpleNamespace(forward_mode=Mode(extend))


def test_a_closed_gate_holds_the_preparing_step_until_the_scheduler_opens_it():
    gate = prepared_load.PrefillGate(max_wait_s=5.0, budget_s=10.0)  # the budget is not what is tested here
    gate.close()
    passed = threading.Event()
    worker = threading.Thread(target=lambda: (gate.step(), passed.set()))
    worker.start()
    assert not passed.wait(0.2)  # the step waits while the scheduler prefills
    gate.open()
    assert passed.wait(5)
    worker.join()
    assert gate.waits == 1 and gate.timeouts == 0 and gate.waited_s >= 0.2
    assert gate.reset().startswith("1 waits for prefills") and gate.waits == 0


def test_back_to_back_prefills_delay_a_preparation_but_never_stop_it():
    gate = prepared_load.PrefillGate(max_wait_s=0.02, slice_s=0.05)
    gate.close()  # never opened again
    t0 = time.perf_counter()
    for _ in range(200):
        gate.step()
    took = time.perf_counter() - t0
    # one wait per slice: after a timed-out wait the steps run for slice_s without looking
    assert 1 <= gate.timeouts == gate.waits and took < 2.0
    assert gate.timeouts <= 1 + took / 0.05


def test_a_disabled_gate_never_waits():
    gate = prepared_load.PrefillGate(enabled=False, max_wait_s=5.0)
    gate.close()
    assert gate.is_open  # the scheduler's close does nothing
    gate._open.clear()  # noqa: SLF001 - white box: even a closed event does not hold a disabled gate's step
    t0 = time.perf_counter()
    gate.step()
    assert gate.waits == 0 and time.perf_counter() - t0 < 1.0


def test_a_preparation_waits_for_prefills_at_most_its_budget_in_all():
    gate = prepared_load.PrefillGate(max_wait_s=0.05, slice_s=0.0, budget_s=0.2)
    gate.close()  # back-to-back prefills
    t0 = time.perf_counter()
    for _ in range(100):
        gate.step()
    took = time.perf_counter() - t0
    # about the budget, then no more waiting (100 waits would be 5 s; the bounds leave room for a loaded machine)
    assert 0.18 <= gate.waited_s <= 1.0 and took < 2.5
    assert gate.reset().endswith("budget spent")
    assert gate.waited_s == 0.0  # the next preparation has its own budget


def server_env(monkeypatch, name: str, raw: str | None) -> None:
    """The server's environment variable ``name`` set to ``raw`` (None: unset)."""
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)


@pytest.mark.parametrize("raw, scope", [(None, "launch"), ("launch", "launch"), ("1", "launch"), ("batch", "batch"),
                                        ("0", "off"), ("off", "off"), ("sometimes", "launch")])
def test_the_gate_scope_is_read_from_the_servers_environment(classes, monkeypatch, raw, scope):
    server_env(monkeypatch, prepared_load.GATE_ENV, raw)  # an unknown value keeps the default, logged
    _, _, preparer = preparing(classes)
    assert preparer.gate_scope == scope and preparer.gate.enabled == (scope != "off")


@pytest.mark.parametrize("raw, budget", [(None, 0.15), ("1000", 1.0), ("0", 0.0), ("-5", 0.15), ("soon", 0.15)])
def test_the_gate_budget_is_read_from_the_servers_environment(classes, monkeypatch, raw, budget):
    server_env(monkeypatch, prepared_load.GATE_BUDGET_ENV, raw)  # a bad value keeps the default, logged
    _, _, preparer = preparing(classes)
    assert preparer.gate.budget_s == budget


@pytest.mark.parametrize("raw, threads", [(None, 1), ("4", 4), ("0", 1), ("many", 1)])
def test_the_helpers_thread_count_is_read_from_the_servers_environment(monkeypatch, raw, threads):
    """One torch thread by default, as SGLang's scheduler process runs; a bad value keeps it, logged."""
    from lorapub.sglang_patch.prepared_load import settings

    server_env(monkeypatch, settings.HELPER_THREADS_ENV, raw)
    manager = types.SimpleNamespace(device="cpu", dtype=None, base_hf_config=None, lora_backend=None)
    assert prepare_helper.kit_for(manager).threads == threads


def test_a_prefill_closes_the_gate_while_it_is_launched_and_the_launch_reopens_it(classes, monkeypatch):
    monkeypatch.delenv(prepared_load.GATE_ENV, raising=False)  # the default scope: the launch
    scheduler, manager, preparer = preparing(classes)
    seen = []
    launching = scheduler.ran.append

    class Ran(list):
        def append(self, b):  # SGLang's run_batch, launching: what the preparing thread sees now
            seen.append(preparer.gate.is_open)
            launching(b)

    scheduler.ran = Ran()
    manager.gate.clear()  # the read blocks: a preparation is pending
    scheduler.process_input_requests([Req("a")])
    scheduler.run_batch(batch(True))
    assert seen == [False] and preparer.gate.is_open  # closed during the launch, open once it returned
    scheduler.run_batch(batch(False))  # a decode batch never closes it
    assert seen == [False, True] and preparer.gate.is_open
    manager.gate.set()
    run_until(scheduler, 1)


def test_a_launch_that_raises_reopens_the_gate_and_its_error_goes_on(classes, monkeypatch):
    monkeypatch.delenv(prepared_load.GATE_ENV, raising=False)
    scheduler, manager, preparer = preparing(classes)

    class Boom(list):
        def append(self, b):
            raise RuntimeError("CUDA error: out of memory")

    scheduler.ran = Boom()
    manager.gate.clear()
    scheduler.process_input_requests([Req("a")])
    with pytest.raises(RuntimeError, match="out of memory"):
        scheduler.run_batch(batch(True))
    assert preparer.gate.is_open  # the preparation is never left waiting on a launch that ended
    manager.gate.set()
    run_until(scheduler, 1)


def test_only_a_prefill_launched_while_a_load_prepares_closes_the_gate(classes, monkeypatch):
    monkeypatch.setenv(prepared_load.GATE_ENV, "batch")  # closed until the next loop iteration
    scheduler, manager, preparer = preparing(classes)
    assert scheduler.run_batch(batch(True)) == "result"  # nothing pending: stays open
    assert preparer.gate.is_open
    manager.gate.clear()  # the read blocks
    scheduler.process_input_requests([Req("a")])
    scheduler.run_batch(batch(False))  # a decode batch leaves it open
    assert preparer.gate.is_open
    scheduler.run_batch(batch(True))
    assert not preparer.gate.is_open
    scheduler.run_batch(types.SimpleNamespace())  # a batch without a mode this patch knows: unchanged
    assert not preparer.gate.is_open
    scheduler.process_input_requests([])  # the next loop iteration
    assert preparer.gate.is_open
    assert [type(b.forward_mode).__name__ if hasattr(b, "forward_mode") else None for b in scheduler.ran] == [
        "Mode", "Mode", "Mode", None]  # every batch still ran, through SGLang's own run_batch
    manager.gate.set()
    run_until(scheduler, 1)


def peft_folder(tmp_path, n=6):
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({f"w{i}": torch.full((4,), float(i)) for i in range(n)}, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_the_hand_over_builds_the_adapter_a_weight_a_step_only_through_an_open_gate(classes, monkeypatch):
    """The preparing thread's Python in the scheduler's process (the helper process does the rest): each
    weight view it puts into the adapter is one gate step, and a closed gate holds it."""
    monkeypatch.setenv(prepared_load.GATE_ENV, "batch")  # the gate stays closed after the prefill's run_batch
    scheduler, manager, preparer = preparing(classes)
    preparer.helper.weights = 6
    prefilling = threading.Event()
    preparer.read_config = lambda ref: (prefilling.wait(5), Config(ref.lora_path))[1]
    preparer.gate.max_wait_s = preparer.gate.budget_s = 10.0  # the budget is not what is tested here
    steps, gate_step = [], preparer.gate.step
    preparer.gate.step = lambda: (steps.append(threading.current_thread().name), gate_step())[1]
    scheduler.process_input_requests([Req("a")])
    scheduler.run_batch(batch(True))  # the scheduler prefills: the gate is closed
    prefilling.set()
    future = preparer.pending[0][1]
    assert not concurrent_wait(future, 0.3)  # the hand-over waits at its first step
    scheduler.process_input_requests([])  # opens it
    run_until(scheduler, 1)
    [(_, out)] = scheduler.sent
    assert out["success"]
    assert sorted(manager.loras["a"].embedding_layers) == [f"w{i}" for i in range(6)]
    assert len(steps) == 6 and all(name.startswith("lorapub-prepare") for name in steps)


def concurrent_wait(future, timeout):
    import concurrent.futures

    done, _ = concurrent.futures.wait([future], timeout=timeout)
    return bool(done)


def test_the_gate_can_be_turned_off(classes, monkeypatch):
    monkeypatch.setenv(prepared_load.GATE_ENV, "0")
    scheduler, manager, preparer = preparing(classes)
    manager.gate.clear()
    scheduler.process_input_requests([Req("a")])
    scheduler.run_batch(batch(True))
    assert preparer.gate.is_open
    manager.gate.set()
    run_until(scheduler, 1)


def test_a_slot_image_built_in_gate_steps_is_the_same_image(monkeypatch):
    """Built on the preparing thread, SGLang's fill takes the adapter's layers one gate step at a time;
    the image it leaves is the one built without steps."""
    import torch

    monkeypatch.setenv(prepared_load.IMAGE_ENV, "1")
    pool_cls = type("Pool", (Pool,), {})
    prepared_load.install(type("S", (Scheduler,), {}), type("M", (Manager,), {}), pool_cls)
    pool = pool_cls()
    adapter = lora(r=2, seed=3, layers=2)
    manager = types.SimpleNamespace(memory_pool=pool, lora_modules=[{}, {}])
    plain = prepared_load.build_slot_image(manager, adapter)
    steps = []
    stepped = prepared_load.build_slot_image(manager, adapter, step=lambda: steps.append(1))
    assert len(steps) == len(adapter.layers)  # one per layer the fill took
    assert [torch.equal(a, b) for a, b in zip(plain.sources, stepped.sources)] == [True] * len(plain.sources)
    assert stepped.fits(pool, 1)


def test_a_preparation_logs_where_its_time_went(classes, caplog):
    """The log line of a load: the helper's processing and copy, the hand-over, the adapter's build."""
    import logging

    scheduler, manager, preparer = preparing(classes)
    preparer.helper.timings = {"process_s": 0.050, "pack_s": 0.030, "cpu_s": 0.075, "threads": 1}
    with caplog.at_level(logging.INFO):
        scheduler.process_input_requests([Req("a")])
        run_until(scheduler, 1)
    [line] = [r.getMessage() for r in caplog.records if "in the helper process" in r.getMessage()]
    assert "SGLang's processing 50 ms, cast and copy to the device 30 ms; the helper's CPU 75 ms on 1 threads" in line
    assert "handed over in" in line and "0 waits for prefills" in line


def test_the_trace_records_each_iteration_of_a_publication_window_with_what_it_spent(classes, monkeypatch):
    """Every scheduler iteration from a load's submission until AFTER_INSTALL_S after its install is one
    ``lorapub iteration`` record: its launches by kind, the install, and the two threads' CPU times."""
    from lorapub.sglang_patch.prepared_load import iterations

    monkeypatch.setenv(prepared_load.TRACE_ENV, "1")
    scheduler, manager, preparer = preparing(classes)
    lines = []
    recorder = preparer.iterations
    recorder.emit = lines.append
    clock = [100.0]
    recorder.now = lambda: clock[0]
    scheduler.process_input_requests([])  # outside any window: nothing recorded
    assert lines == []
    manager.gate.clear()  # the read blocks: a preparation is pending
    scheduler.process_input_requests([Req("a")])
    clock[0] += 0.020
    scheduler.run_batch(batch(True))
    scheduler.run_batch(batch(False))
    scheduler.process_input_requests([])
    manager.gate.set()
    run_until(scheduler, 1)
    scheduler.process_input_requests([])  # ends the iteration that installed it
    records = [iterations.parse_line("x " + line) for line in lines]
    assert all(r is not None for r in records) and len(records) >= 3
    assert records[0]["preparing"]  # the iteration that submitted the load, then the one that launched two batches
    assert records[1]["preparing"] and records[1]["wall"] == pytest.approx(20.0)
    assert "prefill" in records[1] and "decode" in records[1]
    assert any("install" in r for r in records)
    clock[0] += iterations.AFTER_INSTALL_S / 2  # the install's first batches are still recorded
    n = len(lines)
    scheduler.process_input_requests([])
    scheduler.process_input_requests([])
    assert len(lines) == n + 2
    clock[0] += iterations.AFTER_INSTALL_S  # the window has closed
    scheduler.process_input_requests([])
    scheduler.process_input_requests([])
    assert len(lines) == n + 3  # the iteration that began inside it, and no later one
    assert iterations.parse_line("lorapub trace: something else") is None


def test_the_trace_counts_an_install_time_residency_fill_as_a_fill_not_as_the_install(classes, monkeypatch):
    """With a slot image the adapter is made resident at install: that copy is a fill (as a first batch's
    would be), and the install's own span ends before it, so no millisecond is counted twice."""
    from lorapub.sglang_patch.prepared_load import iterations, preparer as preparer_module

    monkeypatch.setenv(prepared_load.TRACE_ENV, "1")
    scheduler, manager, preparer = preparing(classes)
    lines = []
    preparer.iterations.emit = lines.append

    def resident(manager, uid):  # a 60 ms fill, as make_resident notes it
        time.sleep(0.060)
        iterations.note("fill", 0.060)
        return 0

    monkeypatch.setattr(preparer_module, "make_resident", resident)
    scheduler.process_input_requests([Req("a")])
    run_until(scheduler, 1)
    scheduler.process_input_requests([])
    records = [iterations.parse_line("x " + line) for line in lines]
    [installed] = [r for r in records if r is not None and "install" in r]
    assert installed["fill"] == pytest.approx(60.0)
    assert installed["install"] < 40.0, installed  # SGLang's load of a prepared adapter only


def test_a_gc_noted_while_an_iteration_is_recorded_does_not_deadlock_the_scheduler_thread():
    """The trace's gc callback notes each collection in the current iteration; a collection that an
    allocation inside the recorder's own locked section sets off runs that callback on the same thread
    (seen as a hung test: the scheduler thread would hang so on a traced server)."""
    from lorapub.sglang_patch.prepared_load import iterations

    lines = []
    recorder = iterations.IterationRecorder(emit=lines.append, every=True)
    start = recorder._start

    def start_with_a_gc(at):  # a gc inside boundary()'s locked section, noted by the trace's callback
        recorder.add("gc", 0.004)
        start(at)

    recorder._start = start_with_a_gc
    done = threading.Event()

    def iteration():
        recorder.boundary()
        done.set()

    threading.Thread(target=iteration, daemon=True).start()
    assert done.wait(30), "boundary() deadlocked on its own lock"
    assert [iterations.parse_line(line)["gc"] for line in lines] == [4.0]  # noted in the iteration that ended


def test_the_trace_reads_the_preparing_threads_cpu_clock_from_the_scheduler_thread():
    """The recorder reads another thread's CPU time (what it could take of the interpreter), not its own."""
    from lorapub.sglang_patch.prepared_load import iterations

    got, spun, done = [], threading.Event(), threading.Event()

    def preparing():
        got.append(iterations.thread_cpu_clock())
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # 50 ms of this thread's CPU
            pass
        spun.set()
        done.wait(5)

    worker = threading.Thread(target=preparing)
    worker.start()
    try:
        assert spun.wait(5)
        if got[0] is None:
            pytest.skip("no per-thread CPU clock on this platform")
        mine = time.thread_time()
        assert got[0]() >= 0.05
        assert time.thread_time() - mine < 0.05  # the reading costs this thread next to nothing
    finally:
        done.set()
        worker.join()


EMPTY_SLOT = object()  # SGLang's mem_pool.EMPTY_SLOT, looked up in the module of the pool's class


class Policy:
    def __init__(self):
        self.used = []

    def mark_used(self, uid):
        self.used.append(uid)


def resident_pool(owners):
    import torch

    pool_cls = type("Pool", (Pool,), {})
    pool = pool_cls()
    pool.buffer_id_to_uid = list(owners)
    pool.uid_to_buffer_id = {uid: i for i, uid in enumerate(owners) if uid is not EMPTY_SLOT}
    pool.eviction_policy = Policy()
    for b in prepared_load.slot_image.slot_buffers(pool):
        b.fill_(7.0)
    adapter = lora(r=2, seed=5)
    notified = []
    manager = types.SimpleNamespace(memory_pool=pool, lora_modules=[{}, {}], loras={"u5": adapter},
                                    _notify_lora_slots_updated=notified.append)
    adapter.__dict__[prepared_load.IMAGE_ATTR] = prepared_load.build_slot_image(manager, adapter)
    twin = pool_cls()
    type(twin).load_lora_weight_to_buffer(twin, "u5", 0, adapter, [{}, {}], None, None)  # SGLang's own fill
    return manager, pool, notified, [b[0].clone() for b in prepared_load.slot_image.slot_buffers(twin)], torch


def test_an_adapter_with_a_slot_image_is_resident_in_an_empty_slot_at_its_install():
    """Its first batch then finds it in a slot (SGLang skips a uid it maps) and copies nothing."""
    manager, pool, notified, want, torch = resident_pool([None, EMPTY_SLOT, EMPTY_SLOT])
    before = [b[0].clone() for b in prepared_load.slot_image.slot_buffers(pool)]
    assert prepared_load.slot_image.make_resident(manager, "u5") == 1  # the first empty slot, as SGLang picks
    assert pool.uid_to_buffer_id["u5"] == 1 and pool.buffer_id_to_uid[1] == "u5"
    assert pool.eviction_policy.used == ["u5"] and notified == [{1}]
    r = 2
    for got, w in zip((b[1] for b in prepared_load.slot_image.slot_buffers(pool)), want):
        if got.shape[-1] == 6:
            assert torch.equal(got[:r], w[:r])
        else:
            assert torch.equal(got[:, :r], w[:, :r])
    assert all(torch.equal(a, b[0]) for a, b in zip(before, prepared_load.slot_image.slot_buffers(pool)))  # slot 0 untouched
    assert prepared_load.slot_image.make_resident(manager, "u5") is None  # already resident: nothing again


@pytest.mark.parametrize("owners", [[None, "u1", "u2"], []])
def test_no_empty_slot_or_no_image_leaves_the_first_batch_to_sglang(owners):
    manager, pool, notified, _, _ = resident_pool(owners or [EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT])
    if not owners:  # an empty slot, but no image: SGLang's own fill at the first batch
        del manager.loras["u5"].__dict__[prepared_load.IMAGE_ATTR]
    mapped = dict(pool.uid_to_buffer_id)
    assert prepared_load.slot_image.make_resident(manager, "u5") is None
    assert pool.uid_to_buffer_id == mapped and notified == [] and pool.eviction_policy.used == []


def test_the_install_makes_a_successful_load_resident_and_never_a_failed_one(classes, monkeypatch):
    from lorapub.sglang_patch.prepared_load import preparer as preparer_module

    made = []
    monkeypatch.setattr(preparer_module, "make_resident", lambda manager, uid: made.append(uid))
    scheduler, manager, _ = preparing(classes)
    manager.fail_read.add("/p/bad")
    scheduler.process_input_requests([Req("a"), Req("bad")])
    run_until(scheduler, 2)
    assert made == ["a"]


@pytest.mark.parametrize("raw, every", [("1", False), ("all", True), ("ALL", True), ("0", None), ("", None)])
def test_the_trace_records_around_loads_or_every_iteration_as_the_server_asks(classes, monkeypatch, raw, every):
    from lorapub.sglang_patch.prepared_load import iterations

    server_env(monkeypatch, prepared_load.TRACE_ENV, raw)
    scheduler, _, preparer = preparing(classes)
    if every is None:
        assert preparer.iterations is None and not preparer.trace
        return
    lines = []
    preparer.iterations.emit = lines.append
    scheduler.process_input_requests([])  # no load anywhere near: recorded only with "all"
    scheduler.process_input_requests([])
    assert len(lines) == (2 if every else 0)  # one record an iteration
    assert preparer.iterations is iterations.active
