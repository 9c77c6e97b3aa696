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
from v1engine.model.weight_utils import (
    WeightSource,
    default_weight_loader,
    materialize,
    narrow_weight,
)

# Conv1D weights in a GPT-2 checkpoint, stored [in, out], by the model's names.
_CONV1D = (
    ".attn.fused_qkv.weight",
    ".attn.out_proj.weight",
    ".mlp.fc1.weight",
    ".mlp.fc2.weight",
)
# Checkpoint names (all made `transformer.*` first) -> the model's.
_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.wpe.", "model.embed_positions."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".attn.c_attn.", ".attn.fused_qkv."),
    (".attn.c_proj.", ".attn.out_proj."),
    (".mlp.c_fc.", ".mlp.fc1."),
    (".mlp.c_proj.", ".mlp.fc2."),
)


class FusedMultiHeadAttention(nn.Module):
    """Multi-head attention from one fused q/k/v projection and an output projection, both
    biased (or not: `bias`), with RoPE where the model has it (GPT-NeoX) or none (GPT-2)."""

    def __init__(
        self, config: Any, prefix: str, rotary_emb: RotaryEmbedding | None, bias: bool = True
    ) -> None:
        super().__init__()
        size, num_heads = config.hidden_size, config.num_attention_heads
        self.head_size = size // num_heads
        self.fused_qkv = QKVParallelLinear(size, self.head_size, num_heads, num_heads, bias)
        self.out_proj = RowParallelLinear(size, size, bias)
        self.q_size = self.fused_qkv.q_size
        self.rotary_emb = rotary_emb
        num_local_heads = self.fused_qkv.num_heads
        self.attn = Attention(
            num_local_heads,
            self.head_size,
            self.head_size**-0.5,
            num_local_heads,
            layer_name=f"{prefix}.attn",
        )

    def forward(
        self, cos_sin: CosSin | None, hidden: torch.Tensor, output_rows: torch.Tensor | None
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.fused_qkv(hidden).split([self.q_size] * 3, dim=-1)
        if self.rotary_emb is not None:
            q, k = (x.view(num_tokens, -1, self.head_size) for x in (q, k))
            q, k = self.rotary_emb(cos_sin, q, k)
            q, k = q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)
        out = self.attn(q, k, v)
        return self.out_proj(out if output_rows is None else out[output_rows])


# hidden_act -> torch's gelu approximation, for the plain MLPs of this family.
GELUS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))), both biased (unless `bias` is False): GPT-2's, GPT-NeoX's, Phi's and
    StarCoder 2's MLP (their checkpoints' names for fc1 and fc2 are mapped to these as they
    load)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = True
    ) -> None:
        super().__init__()
        if hidden_act not in GELUS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; only {tuple(GELUS)}")
        self.fc1 = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.fc2 = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.approximate = GELUS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(size, eps)
        self.attn = FusedMultiHeadAttention(config, f"{prefix}.attn", rotary_emb=None)
        self.ln_2 = nn.LayerNorm(size, eps)
        inner = config.n_inner or 4 * config.hidden_size
        self.mlp = GeluMLP(config.hidden_size, inner, config.activation_function)

    def forward(
        self, cos_sin: None, hidden: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Past the attention, only `output_rows` of the tokens (all when None); no RoPE."""
        residual = hidden if output_rows is None else hidden[output_rows]
        hidden = residual + self.attn(None, self.ln_1(hidden), output_rows)
        return hidden + self.mlp(self.ln_2(hidden))


class PlainDecoderModel(nn.Module):
    """The forward of decoders whose layers add their own residuals (GPT-2, GPT-NeoX, Phi): the
    embeddings, each `layer(cos_sin, hidden[, output_rows]) -> hidden`, the final norm.
    Subclasses build `embed_tokens`, `layers` and `norm`, and `rotary_emb` where the model has
    RoPE (a step gathers its rows once; None without), and may say how a step embeds (learned
    positions too)."""

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def step_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin | None:
        # Not a class attribute None: nn.Module finds submodules only where lookup fails.
        rope = getattr(self, "rotary_emb", None)
        return None if rope is None else rope.cos_sin(positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states of `output_rows` of the tokens (all when None)."""
        hidden_states = self.embed(input_ids, positions)
        cos_sin = self.step_cos_sin(positions, hidden_states.dtype)
        for layer in self.layers[:-1]:
            hidden_states = layer(cos_sin, hidden_states)
        # As DecoderModel's: the last layer's rows the LM head will not read stop at their K/V.
        return self.norm(self.layers[-1](cos_sin, hidden_states, output_rows))


class GPT2Model(PlainDecoderModel):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention], make_mlp: MakeMLP) -> None:
        super().__init__()
        for name in (
            "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn",
            "add_cross_attention",
        ):
            if getattr(config, name, False):
                raise ValueError(f"GPT-2's {name} is not supported")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            GPT2Block(config, f"transformer.h.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)


class GPT2LMHeadModel(LlamaForCausalLM):
    model_cls = GPT2Model

    checkpoint_skips = (".attn.bias", ".attn.masked_bias")  # causal masks
    checkpoint_renames = _RENAMES

    def checkpoint_name(self, name: str) -> str | None:
        """The original `gpt2` upload names its tensors without `transformer.`."""
        if name != "lm_head.weight" and not name.startswith("transformer."):
            name = "transformer." + name
        return super().checkpoint_name(name)

    def load_special_weight(self, name: str, loaded: WeightSource) -> bool:
        """The Conv1D weights, transposed; `c_attn`'s weight and bias hold q, k and v one after
        another."""
        if not name.endswith((*_CONV1D, ".attn.fused_qkv.bias")):
            return False
        param = self.get_parameter(name)
        if name.endswith(_CONV1D):
            loaded = materialize(loaded).t()
        if ".attn.fused_qkv." not in name:
            getattr(param, "weight_loader", default_weight_loader)(param, loaded)
            return True
        size = self.config.hidden_size
        for i, shard_id in enumerate("qkv"):
            param.weight_loader(param, narrow_weight(loaded, 0, i * size, size), shard_id)
        return True
