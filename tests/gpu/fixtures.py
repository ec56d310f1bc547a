"""Local fixtures, no downloads: a tiny Qwen3 with seeded random weights and two PEFT LoRA
adapters A/B with distinct, non-zero A and B matrices, all saved with safetensors."""

from __future__ import annotations

import json
import os

import torch

TINY_QWEN3 = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
    tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
)
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)


def build_base(out_dir: str, seed: int = 0) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3))
    with torch.no_grad():  # spread the weights so adapters move logits visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_lora(base_dir: str, out_dir: str, seed: int, scale: float = 0.15) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    if os.path.exists(os.path.join(out_dir, "adapter_model.safetensors")):
        return out_dir
    base = Qwen3ForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(base, LoraConfig(**LORA, init_lora_weights=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # both A and B non-zero and seed-specific
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def adapter_snapshot(adapter_dir: str, *, probe=None, **config_changes):
    """The adapter as lorapub publishes it: frozen tensors + serving config, with its digest.
    ``probe``: the numeric READY gate's reference; ``config_changes``: a served config that differs
    from the one the adapter was trained (and its reference computed) with."""
    from safetensors.torch import load_file

    from lorapub import Snapshot

    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    if isinstance(config.get("target_modules"), list):  # PEFT writes a set: fix its order
        config["target_modules"] = sorted(config["target_modules"])
    # What the digest must not depend on: where the base was saved, which peft wrote it.
    config["base_model_name_or_path"] = "lorapub-tiny-qwen3"
    config.pop("peft_version", None)
    config.update(config_changes)
    return Snapshot(tensors, config, probe=probe)


#: The provenance section's adapters P0..P9 and its probe: one short sequence per version.
PROBE_VERSIONS = 10
PROBE_LEN = 64
PROBE_SEED = 77


def probe_sequences(n: int = 1, length: int = PROBE_LEN, seed: int = PROBE_SEED) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY_QWEN3["vocab_size"], (length,), generator=g).tolist() for _ in range(n)]


def reference_logprobs(base_dir: str, adapter_dir: str, sequences: list[list[int]]) -> list[list[float]]:
    """The trainer's side of the numeric gate: log p(token j+1 | tokens 0..j) under the base with the
    adapter, computed by transformers + PEFT in float32 from the same saved weights."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    model = PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32),
                                      adapter_dir).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            out.append([float(logp[j, seq[j + 1]]) for j in range(len(seq) - 1)])
    return out


def build_probes(root: str, base: str) -> str:
    """P0..P9 (distinct seeded adapters) and, in probes.json, each one's reference logprobs."""
    path = os.path.join(root, "probes.json")
    if os.path.exists(path):
        return path
    sequences = probe_sequences()
    refs = {}
    for i in range(PROBE_VERSIONS):
        adapter = build_lora(base, os.path.join(root, f"lora_P{i}"), seed=100 + i)
        refs[f"P{i}"] = reference_logprobs(base, adapter, sequences)
    with open(path, "w") as f:
        json.dump({"sequences": sequences, "expected": refs, "dtype": "float32",
                   "computed_with": "transformers + peft, CPU"}, f)
    return path


def fixture_paths(root: str) -> dict[str, str]:
    """Where build_all put each fixture."""
    return {"base": os.path.join(root, "base"), "probes": os.path.join(root, "probes.json"),
            **{k: os.path.join(root, f"lora_{k}") for k in ("A", "B", "C", *(f"P{i}" for i in range(PROBE_VERSIONS)))}}


def build_all(root: str) -> dict[str, str]:
    base = build_base(os.path.join(root, "base"))
    return {
        "base": base,
        "A": build_lora(base, os.path.join(root, "lora_A"), seed=1),
        "B": build_lora(base, os.path.join(root, "lora_B"), seed=2),
        "C": build_lora(base, os.path.join(root, "lora_C"), seed=3),
        "probes": build_probes(root, base),
    }
