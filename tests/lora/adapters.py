"""Random PEFT LoRA adapters for tests (the folder PEFT's `save_pretrained` writes), and the
transformers model with an adapter merged into its weights, to compare with.

    path = make_adapter(tmp_path / "a", hf_config, rank=4, seed=1)
    merged = merged_hf_model(base_dir, path)     # W + scaling * B @ A, for greedy references
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = {
    p: ("self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp")
    for p in PROJECTIONS
}


def make_adapter(
    path: str | os.PathLike,
    hf_config: Any,
    *,
    rank: int = 4,
    alpha: float = 8,
    targets: tuple[str, ...] = PROJECTIONS,
    seed: int = 1,
    use_rslora: bool = False,
    **config: Any,
) -> str:
    """Writes an adapter on `targets` of every layer, A and B drawn large enough that its
    greedy tokens differ from the base model's; `config` adds or overrides adapter_config.json
    keys. Returns the folder."""
    from v1engine.lora.adapter import projection_shapes

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    shapes = projection_shapes(hf_config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for projection in targets:
            in_features, out_features = shapes[projection]
            name = f"base_model.model.model.layers.{layer}.{_MODULE[projection]}.{projection}"
            tensors[f"{name}.lora_A.weight"] = 0.3 * torch.randn(
                rank, in_features, generator=generator
            )
            tensors[f"{name}.lora_B.weight"] = 0.3 * torch.randn(
                out_features, rank, generator=generator
            )
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "use_rslora": use_rslora,
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
        **config,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f)
    return path


def merged_hf_model(base_dir: str, adapter_dir: str) -> torch.nn.Module:
    """transformers' model of `base_dir` (float32, eval) with the adapter merged into it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            weight = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[weight] += scaling * (b @ a)
    return model
