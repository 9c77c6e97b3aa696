"""GPT-NeoX (`GPTNeoXForCausalLM`: EleutherAI's Pythia suite, GPT-NeoX-20B, and models trained in
its shape), as HF's GPTNeoXModel computes it: LayerNorm (weight and bias) before the attention
and the MLP, which by default read the same input and are added to it together ("parallel
residual"; `use_parallel_residual: false` chains them as Llama does); RoPE on the first
`partial_rotary_factor` of each head (a quarter in Pythia); biased projections; a plain MLP with
exact gelu; a final LayerNorm; an LM head of its own (`embed_out`).

The checkpoint's fused `query_key_value` holds each head's q, k and v together ([heads, 3,
head_size] rows); they are regrouped into the q, k and v shards of each rank as they load.
Tensors are named `gpt_neox.*` and `embed_out`; old checkpoints' mask buffers are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from v1engine.model.layers.attention import Attention
from v1engine.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from v1engine.model.layers.rotary_embedding import CosSin, RotaryEmbedding
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM, MakeMLP
from v1engine.model.weight_utils import WeightSource, materialize

# hidden_act -> torch's gelu approximation.
_GELUS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        size, num_heads = config.hidden_size, config.num_attention_heads
        self.head_size = size // num_heads
        bias = config.attention_bias
        self.query_key_value = QKVParallelLinear(size, self.head_size, num_heads, num_heads, bias)
        self.dense = RowParallelLinear(size, size, bias)
        self.q_size = self.query_key_value.q_size
        self.rotary_emb = rotary_emb
        num_local_heads = self.query_key_value.num_heads
        self.attn = Attention(
            num_local_heads,
            self.head_size,
            self.head_size**-0.5,
            num_local_heads,
            layer_name=f"{prefix}.attn",
        )

    def forward(
        self, cos_sin: CosSin, hidden: torch.Tensor, output_rows: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.query_key_value(hidden).split([self.q_size] * 3, dim=-1)
        q, k = (x.view(num_tokens, -1, self.head_size) for x in (q, k))
        q, k = self.rotary_emb(cos_sin, q, k)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        return self.dense(out if output_rows is None else out[output_rows])


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, True
        )
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size, True)
        self.approximate = _GELUS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_eps
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(size, eps)
        self.post_attention_layernorm = nn.LayerNorm(size, eps)
        self.attention = GPTNeoXAttention(config, rotary_emb, f"{prefix}.attention")
        self.mlp = GPTNeoXMLP(config)

    def forward(
        self, cos_sin: CosSin, hidden: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Past the attention, only `output_rows` of the tokens (all when None)."""
        residual = hidden if output_rows is None else hidden[output_rows]
        attn = self.attention(cos_sin, self.input_layernorm(hidden), output_rows)
        if self.use_parallel_residual:  # HF's order of the sum
            return self.mlp(self.post_attention_layernorm(residual)) + attn + residual
        hidden = attn + residual
        return self.mlp(self.post_attention_layernorm(hidden)) + hidden


class GPTNeoXModel(nn.Module):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        if config.hidden_act not in _GELUS:
            raise ValueError(
                f"hidden_act {config.hidden_act!r} is not supported for GPT-NeoX; only "
                f"{tuple(_GELUS)} are"
            )
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_size = config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding.from_config(config, head_size)
        self.layers = nn.ModuleList(
            GPTNeoXLayer(config, self.rotary_emb, f"gpt_neox.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The token embeddings (a pooling engine ties its unused LM head to them)."""
        return self.embed_in

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of `output_rows` of the tokens (all when None)."""
        hidden = self.embed_in(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.layers[:-1]:
            hidden = layer(cos_sin, hidden)
        return self.final_layer_norm(self.layers[-1](cos_sin, hidden, output_rows))


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_cls = GPTNeoXModel

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """As LlamaForCausalLM's, for HF's GPT-NeoX names (see the module docstring); returns
        the names as the model holds them (`model.*`, `lm_head.weight`)."""
        return super().load_weights(self._renamed(weights))

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, Any]]:
        for name, loaded in weights:
            if name.endswith((".attention.bias", ".attention.masked_bias")):
                continue  # a causal-mask buffer, not a weight
            if name == "embed_out.weight":
                yield "lm_head.weight", loaded
            else:
                yield "model." + name.removeprefix("gpt_neox."), loaded

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        """`query_key_value`'s weight and bias: per head, its q, k and v rows."""
        if not name.endswith((".query_key_value.weight", ".query_key_value.bias")):
            return False
        param = self.get_parameter(name)
        tensor = materialize(loaded)  # [3 * hidden, hidden] or [3 * hidden]
        num_heads = self.config.num_attention_heads
        head_size = self.config.hidden_size // num_heads
        grouped = tensor.reshape(num_heads, 3, head_size, *tensor.shape[1:])
        for i, shard_id in enumerate("qkv"):
            rows = grouped[:, i].reshape(num_heads * head_size, *tensor.shape[1:])
            param.weight_loader(param, rows, shard_id)
        return True

    def expected_checkpoint_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]  # as the model holds them
