"""GPT-2 (`GPT2LMHeadModel`: gpt2, distilgpt2, and the many small models trained in its shape), as
HF's GPT2Model computes it: learned position embeddings added to the token embeddings (no
RoPE); pre-norm blocks with LayerNorm (weight and bias); multi-head attention from one fused
projection, with biases; a plain MLP (4x wide, gelu with the tanh approximation, "gelu_new");
a final LayerNorm; the LM head tied to the token embeddings.

Its checkpoints store the projections as Conv1D weights, [in, out], the transpose of a linear's:
they are transposed as they load, and `c_attn` is split into the q, k and v shards of each rank.
Tensors are named `transformer.*` (or without the prefix, as in the original `gpt2` upload);
the causal-mask buffers some checkpoints carry (`attn.bias`, `attn.masked_bias`) are skipped.
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
from v1engine.model.models.llama import LlamaAttention, LlamaForCausalLM, MakeMLP
from v1engine.model.weight_utils import WeightSource, materialize, narrow_weight

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Conv1D weights in a GPT-2 checkpoint: stored [in, out].
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        size, num_heads = config.hidden_size, config.num_attention_heads
        self.head_size = size // num_heads
        self.c_attn = QKVParallelLinear(size, self.head_size, num_heads, num_heads, bias=True)
        self.c_proj = RowParallelLinear(size, size, bias=True)
        self.num_heads = self.c_attn.num_heads
        self.q_size = self.c_attn.q_size
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.num_heads,
            layer_name=f"{prefix}.attn",
        )

    def forward(self, hidden: torch.Tensor, output_rows: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).split([self.q_size] * 3, dim=-1)
        out = self.attn(q, k, v)
        return self.c_proj(out if output_rows is None else out[output_rows])


class GPT2MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(size, eps)
        self.attn = GPT2Attention(config, f"{prefix}.attn")
        self.ln_2 = nn.LayerNorm(size, eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self, hidden: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Past the attention, only `output_rows` of the tokens (all when None)."""
        residual = hidden if output_rows is None else hidden[output_rows]
        hidden = residual + self.attn(self.ln_1(hidden), output_rows)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(
                f"activation_function {config.activation_function!r} is not supported for "
                f"GPT-2; only {_ACTIVATIONS} are"
            )
        for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(config, name, False):
                raise ValueError(f"GPT-2's {name} is not supported")
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, f"transformer.h.{i}") for i in range(config.num_hidden_layers)
        )
        self.ln_f = nn.LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    @property
    def embed_tokens(self) -> VocabParallelEmbedding:
        """The token embeddings, which the LM head is tied to."""
        return self.wte

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of `output_rows` of the tokens (all when None); the last
        block's rows that the LM head will not read stop after their K/V are written."""
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h[:-1]:
            hidden = block(hidden)
        return self.ln_f(self.h[-1](hidden, output_rows))


class GPT2LMHeadModel(LlamaForCausalLM):
    model_cls = GPT2Model

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """As LlamaForCausalLM's, for HF's GPT-2 names (see the module docstring); returns
        the names as the model holds them (`model.*`)."""
        return super().load_weights(self._renamed(weights))

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, Any]]:
        for name, loaded in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # a causal-mask buffer, not a weight
            if name != "lm_head.weight":
                name = "model." + name.removeprefix("transformer.")
            if name.endswith(_CONV1D):
                loaded = materialize(loaded).t()
            yield name, loaded

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        """`c_attn`'s weight and bias hold q, k and v one after another."""
        if not name.endswith((".attn.c_attn.weight", ".attn.c_attn.bias")):
            return False
        param = self.get_parameter(name)
        size = self.config.hidden_size
        for i, shard_id in enumerate("qkv"):
            param.weight_loader(param, narrow_weight(loaded, 0, i * size, size), shard_id)
        return True

    def expected_checkpoint_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]  # as the model holds them
