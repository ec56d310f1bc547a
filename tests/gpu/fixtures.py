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


def adapter_snapshot(adapter_dir: str):
    """The adapter as lorapub publishes it: frozen tensors + serving config, with its digest."""
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
    return Snapshot(tensors, config)


def build_all(root: str) -> dict[str, str]:
    base = build_base(os.path.join(root, "base"))
    return {
        "base": base,
        "A": build_lora(base, os.path.join(root, "lora_A"), seed=1),
        "B": build_lora(base, os.path.join(root, "lora_B"), seed=2),
        "C": build_lora(base, os.path.join(root, "lora_C"), seed=3),
    }
