"""OLMo 2 and OLMo 3 (AI2's fully open models, `Olmo2ForCausalLM`, `Olmo3ForCausalLM`), as HF's
Olmo2Model computes them. Llama's layout with these differences:

- the query and key projections are each normalized as a whole (one RMSNorm over all heads,
  before RoPE), not per head as Qwen3's: under tensor parallelism a rank holds some heads, so
  the mean of squares is summed over the ranks (one all-reduce for both) and each rank scales by
  its slice of the weight;
- a layer normalizes the outputs of its attention and its MLP before their residual adds, and
  its inputs not at all (no `input_layernorm`);
- OLMo 3 makes three layers in four "sliding_attention" (`layer_types`), with one RoPE for all.
The decoder norms are Llama's RMSNorm, which casts to the model's dtype before the scale where
HF's OLMo norm scales first: the same in float32, within rounding in bfloat16.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from v1engine.model.layers.layernorm import RMSNorm
from v1engine.model.layers.linear import VocabParallelEmbedding
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding, RotaryEmbeddingsByKind
from v1engine.model.models.llama import (
    DecoderModel,
    LlamaAttention,
    LlamaForCausalLM,
    MakeMLP,
    get_head_size,
)
from v1engine.model.parallel_state import get_tp_world_size, tensor_model_parallel_all_reduce
from v1engine.model.weight_utils import WeightSource, copy_weight, narrow_weight


class ProjectionNorm(nn.Module):
    """The scale of an RMSNorm over a whole projection of `total_heads` heads, of which this
    rank holds `num_heads` from `head_start` on: this rank's slice of the checkpoint's weight."""

    def __init__(self, head_size: int, total_heads: int, num_heads: int, head_start: int) -> None:
        super().__init__()
        self.start, self.size = head_start * head_size, num_heads * head_size
        self.total_size = total_heads * head_size
        # How many ranks hold each head (K/V heads are replicated when fewer than the ranks).
        self.replicas = get_tp_world_size() * num_heads // total_heads
        self.weight = nn.Parameter(torch.ones(self.size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, _shard_id: Any = None
    ) -> None:
        copy_weight(param, narrow_weight(loaded, 0, self.start, self.size))


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__(config, layer_idx, rotary_emb, prefix)
        qkv, head_size = self.qkv_proj, self.head_size
        self.q_norm = ProjectionNorm(
            head_size, config.num_attention_heads, self.num_heads, qkv.tp_rank * self.num_heads
        )
        self.k_norm = ProjectionNorm(
            head_size, config.num_key_value_heads, self.num_kv_heads, qkv.kv_head_start
        )
        self.eps = config.rms_norm_eps

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_size], k likewise: each normalized over all its heads."""
        scales = (self.q_norm, self.k_norm)
        flat = [x.reshape(x.shape[0], -1).float() for x in (q, k)]
        # Sums of squares per token, over this rank's heads: [tokens, 2].
        sums = torch.stack([x.pow(2).sum(-1) for x in flat], dim=-1)
        if get_tp_world_size() > 1:
            sums = tensor_model_parallel_all_reduce(sums)
        normed = []
        for i, (x, scale) in enumerate(zip(flat, scales)):
            mean = sums[:, i : i + 1] / (scale.replicas * scale.total_size)
            x = x * torch.rsqrt(mean + self.eps)
            normed.append((scale.weight * x).to(q.dtype).view(q.shape[0], -1, self.head_size))
        return normed[0], normed[1]


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        kind: str,
        rotary_emb: RotaryEmbedding,
        prefix: str,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.kind = kind  # which of the step's RoPE rows it reads
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, layer_idx, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(
        self,
        cos_sin: dict[str, CosSin],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out as LlamaDecoderLayer's, their sum the layer's input and
        output; here nothing normalizes that sum (the next layer adds it plainly, the final
        norm with its fused add); `cos_sin` by layer kind."""
        if residual is not None:
            hidden_states = hidden_states + residual
        residual = hidden_states if output_rows is None else hidden_states[output_rows]
        hidden_states = self.self_attn(cos_sin[self.kind], hidden_states, output_rows)
        residual = residual + self.post_attention_layernorm(hidden_states)
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2Model(DecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        kinds = layer_kinds(config)
        self.rotary_embs = RotaryEmbeddingsByKind(config, get_head_size(config), kinds)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(
                config, i, kind, self.rotary_embs[kind], f"model.layers.{i}", make_mlp(config, i)
            )
            for i, kind in enumerate(kinds)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, CosSin]:
        return self.rotary_embs.cos_sin(positions, dtype)


def layer_kinds(config: Any) -> list[str]:
    """Each layer's kind: OLMo 3's `layer_types`; every OLMo 2 layer attends to all tokens."""
    return list(
        getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    )


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_cls = Olmo2Model


Olmo3ForCausalLM = Olmo2ForCausalLM  # the same modules; its sliding layers come from its config
