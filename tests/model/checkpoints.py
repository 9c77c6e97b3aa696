"""Tiny random-weight HF checkpoints for tests, saved as safetensors directories. Nothing downloads.

    path = make_checkpoint(tmp_path, "llama")                  # untied, GQA
    path = make_checkpoint(tmp_path, "mistral", num_hidden_layers=3)  # config overrides

Presets (`CHECKPOINT_PRESETS`): llama (untied, GQA 4/2, odd vocab so TP pads it), llama_tied (tied
embeddings, MHA), llama3_rope (llama3 rope scaling), qwen2 (q/k/v bias), qwen2_hybrid (sliding
window on layers >= 1 only), qwen3 (per-head q/k norm, head_dim != hidden/heads), qwen3_yarn (qwen3
with YaRN rope scaling), mistral (sliding window 8, shorter than the test prompts), gemma2 (Gemma
2's soft-capped attention and final logits), gemma3 (Gemma 3's layout: local and global layers,
offset norms, gelu), starcoder2 (LayerNorms, biases, a window on every layer), smollm3 (a NoPE layer
in four), granite (its multipliers), qwen3_moe, qwen2_moe (with a shared expert) and mixtral
(experts in every layer), phi3 (Phi-4-mini's fused projections, partial longrope), gpt2 (learned
positions, LayerNorm, Conv1D weights), gpt_neox and gpt_neox_chained (Pythia's partial RoPE,
parallel or chained residual), phi (Phi-2's parallel blocks, biased LM head), olmo2 (q/k norms over
whole projections, post-norms) and olmo3 (with sliding layers). Weights are drawn with a larger
spread than HF's init so logits are far from ties and greedy decoding is a meaningful check.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_COMMON = dict(
    vocab_size=131,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CHECKPOINT_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen2_hybrid": (
        "Qwen2Config",
        dict(
            tie_word_embeddings=True, use_sliding_window=True, sliding_window=6, max_window_layers=1
        ),
    ),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
    # As Qwen3's docs extend its context: YaRN over an original 64 positions, 4x (the 256).
    "qwen3_yarn": (
        "Qwen3Config",
        dict(
            tie_word_embeddings=True,
            head_dim=32,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=8)),
    # Experts in layer 0, a dense MLP in layer 1 (`mlp_only_layers`), top 2 of 4 renormalized.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            tie_word_embeddings=False,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # Qwen2-MoE: routed experts and a shared one in layer 1, a dense MLP in layer 0.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            tie_word_embeddings=False,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
        ),
    ),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4)),
    # Phi-4-mini's layout: fused q/k/v and gate/up, RoPE over 3/4 of each head with longrope's
    # short factors (4x its original 64 positions).
    "phi3": (
        "Phi3Config",
        dict(
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=2,
            original_max_position_embeddings=64,
            partial_rotary_factor=0.75,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0],
                "long_factor": [2.0] * 6,
            },
        ),
    ),
    # Granite 3.x's scalars (granite-3.3-2b's values, but a larger logits divisor).
    "granite": (
        "GraniteConfig",
        dict(
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=2.0,
        ),
    ),
    # GPT-2's learned positions, LayerNorms, biases and Conv1D weights (multi-head: as many
    # KV heads as heads).
    "gpt2": (
        "GPT2Config",
        dict(num_key_value_heads=4, n_inner=128, activation_function="gelu_new"),
    ),
    # Pythia's shape: a quarter of each head rotated, parallel residual, per-head fused qkv;
    # and the chained variant.
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(num_key_value_heads=4, tie_word_embeddings=False, layer_norm_eps=1e-5),
    ),
    "gpt_neox_chained": (
        "GPTNeoXConfig",
        dict(num_key_value_heads=4, tie_word_embeddings=False, use_parallel_residual=False),
    ),
    # Phi-2's parallel blocks, partial RoPE and biased LM head; GQA and per-head q/k LayerNorms
    # (which Phi-2 has not) to cover them.
    "phi": (
        "PhiConfig",
        dict(tie_word_embeddings=False, qk_layernorm=True, hidden_act="gelu_new"),
    ),
    # OLMo 2's norms: each projection and each block's output; OLMo 3's sliding layers.
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
    "olmo3": (
        "Olmo3Config",
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8,
        ),
    ),
    # Every fourth layer without RoPE (NoPE), as SmolLM3-3B's.
    "smollm3": ("SmolLM3Config", dict(tie_word_embeddings=True, num_hidden_layers=4)),
    # Local layers around a global one, each kind with its RoPE (the global one scaled, as in
    # gemma-3-4b and up).
    # Gemma 2's alternating layers (sliding, full, sliding) with caps small enough that these
    # weights' attention and final logits bend under them.
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
        ),
    ),
    # StarCoder 2: LayerNorms, biased projections, a plain gelu MLP, a window over every layer.
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8, norm_epsilon=1e-5)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8,
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            },
        ),
    ),
}


def make_config(arch: str, **overrides: Any) -> Any:
    """The transformers config of preset `arch`, with `overrides` applied."""
    import transformers

    if arch not in CHECKPOINT_PRESETS:
        raise ValueError(f"unknown preset {arch!r}; presets: {sorted(CHECKPOINT_PRESETS)}")
    config_cls_name, preset = CHECKPOINT_PRESETS[arch]
    kwargs = {**_COMMON, **preset, **overrides}
    return getattr(transformers, config_cls_name)(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # Norm scales near 1 (GPT-2's LayerNorms are ln_*), their biases as any.
            if ("norm" in name or ".ln_" in name) and not name.endswith(".bias"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def make_hf_model(
    arch: str, seed: int = 0, base_model: bool = False, classifier: bool = False, **overrides: Any
) -> torch.nn.Module:
    """A float32 transformers model of preset `arch` with random weights, in eval mode
    (`base_model`: transformers' AutoModel, e.g. LlamaModel, without the LM head; `classifier`:
    AutoModelForSequenceClassification, e.g. LlamaForSequenceClassification, whose classes
    `overrides` may set with `id2label`)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = make_config(arch, **overrides)
    auto_cls = AutoModel if base_model else AutoModelForCausalLM
    if classifier:
        auto_cls = AutoModelForSequenceClassification
    model = auto_cls.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def make_checkpoint(
    tmp_path: str | os.PathLike,
    arch: str,
    *,
    seed: int = 0,
    name: str | None = None,
    max_shard_size: str | None = None,
    base_model: bool = False,
    classifier: bool = False,
    **overrides: Any,
) -> str:
    """Saves a random preset-`arch` model under `tmp_path/<name or arch>`; returns that directory.

    `max_shard_size` (e.g. "40KB") splits the weights into several safetensors files with a
    `model.safetensors.index.json`, as large real checkpoints are; `base_model` saves
    transformers' AutoModel (LlamaModel, ...: no LM head), as embedding checkpoints are;
    `classifier` a sequence classifier (see `make_hf_model`).
    """
    model = make_hf_model(arch, seed, base_model, classifier, **overrides)
    path = os.path.join(os.fspath(tmp_path), name or arch)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


_OWN_CONFIG_CLASS = """from transformers import LlamaConfig


class FancyLlamaConfig(LlamaConfig):
    model_type = "fancy_llama"
"""


_OWN_TOKENIZER_CLASS = """from transformers import PreTrainedTokenizerFast


class FancyTokenizer(PreTrainedTokenizerFast):
    pass
"""


def give_own_config_class(path: str) -> str:
    """Turns the llama checkpoint at `path` into one whose config class is its own code (a
    `configuration_fancy.py` named by config.json's `auto_map`, model type "fancy_llama"), which
    only `trust_remote_code` may load; returns `path`."""
    _add_own_class(path, "config.json", "configuration_fancy.py", _OWN_CONFIG_CLASS)
    _update_json(
        os.path.join(path, "config.json"),
        model_type="fancy_llama",
        auto_map={"AutoConfig": "configuration_fancy.FancyLlamaConfig"},
    )
    return path


def give_own_tokenizer_class(path: str) -> str:
    """Likewise for the tokenizer of the checkpoint at `path` (a fast one): `FancyTokenizer`
    from its `tokenization_fancy.py`, named by tokenizer_config.json's `auto_map`."""
    _add_own_class(path, "tokenizer_config.json", "tokenization_fancy.py", _OWN_TOKENIZER_CLASS)
    _update_json(
        os.path.join(path, "tokenizer_config.json"),
        tokenizer_class="FancyTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_fancy.FancyTokenizer"]},
    )
    return path


def _add_own_class(path: str, json_name: str, module_name: str, source: str) -> None:
    assert os.path.isfile(os.path.join(path, json_name)), f"{path} has no {json_name}"
    with open(os.path.join(path, module_name), "w") as f:
        f.write(source)


def _update_json(json_file: str, **values: Any) -> None:
    import json

    with open(json_file) as f:
        content = json.load(f)
    content.update(values)
    with open(json_file, "w") as f:
        json.dump(content, f, indent=2)


def load_hf_model(path: str) -> torch.nn.Module:
    """The transformers model saved at `path`, float32, eval mode: the reference for parity."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
