"""Reading a PEFT LoRA adapter folder and checking it fits the model. The same code runs at the
edge, where a bad adapter is its request's error before anything is sent, and in the workers,
which then load it knowing it fits.

Served: LoRA on the decoder layers' projections (q/k/v/o_proj, gate/up/down_proj), rank at most
`max_lora_rank`, scaled by `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA). Refused, naming the
field: DoRA, trained biases, `modules_to_save`, per-module rank or alpha patterns, `fan_in_fan_out`
weights, and adapters on the embedding or the LM head.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
# (layer index, projection) of one PEFT weight name, e.g.
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_WEIGHT_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class LoRAAdapter:
    rank: int
    # (layer index, projection) -> (A [rank, in_features], B [out_features, rank] * scaling):
    # the delta of y = x W^T is x A^T B^T, the scaling folded into B.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Projection -> (in_features, out_features) of a Llama-style decoder layer, unsharded."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    head = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * head, hf_config.num_key_value_heads * head
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_adapter(path: str, hf_config: Any, max_lora_rank: int) -> LoRAAdapter:
    """The adapter in folder `path`, checked against the model.

    Raises:
        ValueError: the folder is not a PEFT LoRA adapter this model can serve; says why.
    """
    config = _read_config(path)
    rank, scaling = _rank_and_scaling(path, config, max_lora_rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        match = _WEIGHT_NAME.match(name)
        if match is None:
            raise ValueError(
                f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA weight of a decoder "
                f"layer's projection ({', '.join(projection_shapes(hf_config))}); v1engine "
                "serves adapters on those only"
            )
        layer, projection, side = int(match[1]), match[2], match[3]
        pairs.setdefault((layer, projection), {})[side] = tensor.float()
    weights = {}
    for (layer, projection), sides in sorted(pairs.items()):
        a, b = _check_pair(path, hf_config, layer, projection, sides, rank)
        weights[(layer, projection)] = (a, b * scaling)
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return LoRAAdapter(rank, weights)


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise ValueError(
            f"LoRA adapter {path!r}: no {ADAPTER_CONFIG} there; lora_path must be a PEFT "
            "adapter folder (adapter_config.json and adapter_model.safetensors)"
        )
    with open(file) as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ValueError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} is not a JSON object")
    return config


def _rank_and_scaling(path: str, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    peft_type = config.get("peft_type", "LORA")
    refused = {
        "peft_type": peft_type != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    for key, bad in refused.items():
        if bad:
            raise ValueError(
                f"LoRA adapter {path!r}: {ADAPTER_CONFIG} sets {key}={config.get(key)!r}, which "
                "v1engine does not serve (plain LoRA only: no DoRA, biases, modules_to_save, "
                "rank or alpha patterns, fan_in_fan_out)"
            )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(
            f"LoRA adapter {path!r}: {ADAPTER_CONFIG} needs an int r >= 1 and a number "
            f"lora_alpha, got r={rank!r}, lora_alpha={alpha!r}"
        )
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {path!r} has rank {rank} but max_lora_rank is {max_lora_rank}; "
            f"start the engine with max_lora_rank >= {rank} (--max-lora-rank)"
        )
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scaling


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors_file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors_file):
        from safetensors.torch import load_file

        return load_file(safetensors_file)
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_file):
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise ValueError(
        f"LoRA adapter {path!r}: no adapter_model.safetensors (or adapter_model.bin) there"
    )


def _check_pair(
    path: str, hf_config: Any, layer: int, projection: str, sides: dict, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter {path!r}, layer {layer} {projection}"
    if layer >= hf_config.num_hidden_layers:
        raise ValueError(f"{where}: the model has {hf_config.num_hidden_layers} layers")
    shapes = projection_shapes(hf_config)
    if projection not in shapes:
        raise ValueError(f"{where}: not a projection v1engine serves ({', '.join(shapes)})")
    if set(sides) != {"A", "B"}:
        raise ValueError(f"{where}: has lora_{''.join(sides)} without its other half")
    a, b = sides["A"], sides["B"]
    in_features, out_features = shapes[projection]
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise ValueError(
            f"{where}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but this model "
            f"needs [{rank}, {in_features}] and [{out_features}, {rank}] (r={rank}); was the "
            "adapter trained on another base model?"
        )
    return a, b


class CheckedAdapters:
    """The front end's record of the adapters requests named: each read and checked the first
    time (so a bad one fails its request, not a worker), and each id bound to one folder (the
    workers keep an id's weights, so another folder under the same id would not be served)."""

    def __init__(self, hf_config: Any, max_lora_rank: int) -> None:
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self.paths: dict[int, str] = {}  # lora_int_id -> its folder

    def check(self, lora: Any) -> None:
        """Raises ValueError naming what is wrong with LoRARequest `lora`."""
        path = self.paths.get(lora.lora_int_id)
        if path is None:
            load_adapter(lora.lora_path, self.hf_config, self.max_lora_rank)
            self.paths[lora.lora_int_id] = lora.lora_path
        elif path != lora.lora_path:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} already names "
                f"the adapter at {path!r}; give each adapter its own lora_int_id"
            )
