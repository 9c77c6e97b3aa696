"""Llama (and SmolLM2): the decoder every other architecture here reuses with small overrides.

Interface the model runner relies on, shared by all models in this package:
`model(input_ids [num_tokens], positions [num_tokens]) -> hidden [num_tokens, hidden_size]`, or
`model(input_ids, positions, output_rows [n]) -> hidden [n, hidden_size]` for those rows only,
`model.compute_logits(hidden [n, hidden_size]) -> [n, vocab_size]` float32, and
`model.load_weights(iterable of (checkpoint name, tensor or safetensors slice)) -> names loaded`
(all of a checkpoint, or any part of it later), which bumps `model.weights_version`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from v1engine.model.layers.activation import SiluAndMul
from v1engine.model.layers.attention import Attention
from v1engine.model.layers.layernorm import RMSNorm
from v1engine.model.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding
from v1engine.model.models.llama_decode_stack import LlamaDecodeStack
from v1engine.model.weight_utils import WeightSource, default_weight_loader

# (merged parameter, checkpoint projection, shard id) for projections fused into one matmul.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def get_head_size(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's attention window in tokens, or None for full attention.

    transformers 5 lists per-layer kinds in `layer_types`; configs without it (Mistral, older
    Qwen2) apply `sliding_window` to every layer, or from `max_window_layers` on.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and layer_idx < max_window_layers:
        return None
    return window


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class LlamaMLP(nn.Module):
    def __init__(
        self, config: Any, intermediate_size: int | None = None, act_fn: nn.Module | None = None
    ) -> None:
        """`intermediate_size`: other than the config's (an MoE's shared expert); `act_fn`: a
        gated activation other than silu (Gemma's gelu), checked by its model."""
        super().__init__()
        if act_fn is None and config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu' is")
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias)
        self.act_fn = act_fn or SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__()
        self.head_size = get_head_size(config)
        qkv_bias, o_bias = self.projection_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            qkv_bias,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_size, config.hidden_size, o_bias
        )
        # None in a layer without RoPE (SmolLM3's NoPE layers).
        self.rotary_emb = rotary_emb if self.uses_rope(config, layer_idx) else None
        # Set by architectures that normalize each query and key head (Qwen3).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            self.softmax_scale(config, self.head_size),
            self.num_kv_heads,
            layer_name=f"{prefix}.attn",
            sliding_window=get_sliding_window(config, layer_idx),
            logits_soft_cap=self.logits_soft_cap(config),
        )

    @staticmethod
    def uses_rope(config: Any, layer_idx: int) -> bool:
        """Whether the layer rotates its queries and keys (every Llama layer does)."""
        return True

    @staticmethod
    def softmax_scale(config: Any, head_size: int) -> float:
        """What the attention logits are multiplied by (Gemma's differs)."""
        return head_size**-0.5

    @staticmethod
    def logits_soft_cap(config: Any) -> float | None:
        """The cap of the attention logits, None for none (Gemma 2 caps them)."""
        return None

    @staticmethod
    def projection_biases(config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-head RMSNorm before RoPE where the model has one (Qwen3); Llama has none."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def forward(
        self, cos_sin: CosSin, hidden_states: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every token's K/V is written and attends; only `output_rows` (all when None) go on
        through o_proj."""
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        q, k = self.qk_norm(q, k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(cos_sin, q, k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        if output_rows is not None:
            out = out[output_rows]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        attention_cls: type[LlamaAttention],
        rotary_emb: RotaryEmbedding,
        prefix: str,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = attention_cls(config, layer_idx, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = mlp
        # Granite's: each block's output is scaled before its residual add (granite.py).
        self.residual_multiplier: float | None = None

    def forward(
        self,
        cos_sin: CosSin,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Past the attention, only `output_rows` of the tokens (all when None)."""
        # The residual add is fused into the next norm: (hidden, residual) -> norm(sum), sum.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(cos_sin, hidden_states, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        multiplier = self.residual_multiplier
        if multiplier is not None:
            hidden_states = hidden_states * multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states if multiplier is None else hidden_states * multiplier, residual


# Builds a layer's MLP: (config, layer index) -> module (MoE models mix dense and sparse ones).
MakeMLP = Callable[[Any, int], nn.Module]


class DecoderModel(nn.Module):
    """The forward every decoder here shares: embeddings, the step's RoPE rows, the layers (each
    `layer(cos_sin, hidden, residual[, output_rows])`, the residual add fused into the next norm)
    and the final norm. Subclasses build `embed_tokens`, `layers` and `norm`, say how a step
    embeds and gathers its RoPE rows, and may offer a native decode path (`decode_stack`)."""

    decode_stack: LlamaDecodeStack | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of `output_rows` of the tokens (all when None)."""
        hidden_states = self.embed(input_ids)  # [num_tokens, hidden_size]
        cos_sin = self.step_cos_sin(positions, hidden_states.dtype)
        stack = self.decode_stack
        if stack is not None and stack.applies(hidden_states):  # a CPU decode step: all in C
            hidden_states = stack(hidden_states, cos_sin)
            return hidden_states if output_rows is None else hidden_states[output_rows]
        residual = None
        for layer in self.layers[:-1]:
            hidden_states, residual = layer(cos_sin, hidden_states, residual)
        # The last layer's outputs feed only the LM head: rows it will not read (a prompt's
        # tokens before its last) stop after their K/V are written, as llama.cpp's do: a
        # prefill skips most of one layer's matmuls (SmolLM2: 2.8% of them).
        hidden_states, residual = self.layers[-1](cos_sin, hidden_states, residual, output_rows)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaModel(DecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin table shared by all layers; each step gathers its rows once.
        self.rotary_emb = RotaryEmbedding.from_config(config, get_head_size(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config, i, attention_cls, self.rotary_emb, f"model.layers.{i}", make_mlp(config, i)
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier: float | None = None  # Granite's (granite.py)
        self.decode_stack = LlamaDecodeStack(self)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self.embedding_multiplier is None:
            return hidden_states
        return hidden_states * self.embedding_multiplier

    def step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        return self.rotary_emb.cos_sin(positions, dtype)


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    supports_cuda_graphs = True  # its decode steps can be captured (not an MoE's)
    # Built as model_cls(hf_config, attention_cls, make_mlp).
    model_cls: type[nn.Module] = LlamaModel

    @staticmethod
    def make_mlp(config: Any, layer_idx: int) -> nn.Module:
        return LlamaMLP(config)

    def __init__(
        self, hf_config: Any, dtype: torch.dtype = torch.float32, has_lm_head: bool = True
    ) -> None:
        """`has_lm_head=False`: a base model or a sequence classifier (it pools), whose LM head
        is the embedding, tied, so that profiling can run it and it holds no memory of its own."""
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.weights_version = 0  # bumped by every load_weights
        with _default_dtype(dtype):
            self.model = self.model_cls(hf_config, self.attention_cls, self.make_mlp)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        if hf_config.tie_word_embeddings or not has_lm_head:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_scaling: float | None = None  # Granite's: logits divided by it (granite.py)

    @torch.no_grad()
    def forward(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        """`LlamaModel.forward`: (input_ids, positions[, output_rows]) -> hidden states."""
        return self.model(*inputs)

    @torch.no_grad()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        return logits if self.logits_scaling is None else logits / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Loads checkpoint tensors (HF names) into this rank's shards, in place: the whole
        checkpoint at start-up, or any part of it later (an RL trainer's new weights, as in
        vLLM's recipe). Returns the names it loaded (as `checkpoint_name` spells them);
        `weights_version` counts the calls, so the runner refreshes what it derives from them.

        Raises:
            ValueError: a checkpoint tensor has no parameter here, or the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded_names = set()
        for name, loaded in weights:
            name = self.checkpoint_name(name)
            if name is None:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding already holds it
            if self.load_special_weight(name, loaded):
                loaded_names.add(name)
                continue
            param_name, shard_id = _param_name(name)
            if param_name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}; "
                    "the checkpoint does not match its config.json architecture"
                )
            param = params[param_name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, loaded, shard_id)
            loaded_names.add(name)
        self.weights_version += 1
        return loaded_names

    # Stored buffers that are not weights, by suffix (RoPE tables; old checkpoints' masks), and
    # checkpoint name parts -> this model's, replaced in order (GPT-2's and others' differ).
    checkpoint_skips: tuple[str, ...] = ("rotary_emb.inv_freq",)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model's parameters spell it; None: not a weight."""
        if name.endswith(self.checkpoint_skips):
            return None
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        return name

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        """Loads a checkpoint tensor that has no parameter of its own name (an MoE expert's
        projection goes into its layer's stacked experts); False: none of those."""
        return False

    def expected_checkpoint_names(self) -> list[str]:
        """The HF tensor names a complete checkpoint provides (fused params expanded)."""
        names = []
        for name, _ in self.named_parameters():
            parts = [(part, merged) for merged, part, _ in STACKED_PARAMS if f".{merged}." in name]
            names += [name.replace(f".{merged}.", f".{part}.") for part, merged in parts] or [name]
        return names


def _param_name(checkpoint_name: str) -> tuple[str, object]:
    for merged, part, shard_id in STACKED_PARAMS:
        if f".{part}." in checkpoint_name:
            return checkpoint_name.replace(f".{part}.", f".{merged}."), shard_id
    return checkpoint_name, None
