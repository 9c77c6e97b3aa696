"""Rotary position embedding, neox style (rotate halves) as in HF Llama, with llama3, linear,
YaRN and (short) longrope scaling, over all of each head or its first part (partial RoPE).

cos/sin are precomputed for every position up to `max_position`: the angles in float32 with the
arithmetic HF uses per step, their cos/sin in float64 rounded to float32 (see `_float32_of`), so
they agree with transformers' to an ulp. On CPU the rotation runs as one compiled kernel
(`cpu_elementwise.c`) where it is available.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from v1engine.model.hf_config import get_rope_parameters, max_positions
from v1engine.model.layers import cpu_kernels

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): the frequencies that turn fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those that turn more than
    `beta_fast` times kept, with a linear ramp over the dimensions between; and the attention
    logits are scaled through cos/sin by `attention_factor` (default 0.1 ln(factor) + 1)."""
    factor, base = params["factor"], params["rope_theta"]
    dim = 2 * len(inv_freq)
    original = params["original_max_position_embeddings"]

    def dimension_of(num_rotations: float) -> float:  # where the frequency turns that often
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = (
        dimension_of(params.get("beta_fast") or 32),
        dimension_of(params.get("beta_slow") or 1),
    )
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float) - low) / ((high - low) or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    return inv_freq, _yarn_attention_factor(params)


def _longrope_short_inv_freq(
    exponents: torch.Tensor, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """Phi-3's longrope over its original context: each frequency divided by its short factor,
    cos/sin scaled by sqrt(1 + ln(factor) / ln(original context)). Its long factors, which
    transformers switches to once a sequence passes the original context (all positions at
    once), are not served: `hf_config.max_positions` stops there."""
    short = torch.tensor(params["short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (short * params["rope_theta"] ** exponents)
    factor, original = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return inv_freq, attention_factor


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    if params.get("attention_factor") is not None:
        return params["attention_factor"]

    def scale(mscale: float = 1.0) -> float:
        factor = params["factor"]
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek's form
        return scale(mscale) / scale(mscale_all_dim)
    return scale()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The neox rotation in torch ops: x * cos + rotate_half(x) * sin for query and key."""
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {_SUPPORTED_ROPE_TYPES}"
            )
        self.head_size = head_size
        # Partial RoPE (Phi-4-mini): only the first `rotary_dim` of each head rotate.
        self.rotary_dim = dim = int(head_size * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        # The tables are computed on the host (numpy below) whatever device the model is built
        # under (`with torch.device("cuda")` in the loader), and only the result goes there.
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        inv_freq = 1.0 / (base**exponents)
        scale = 1.0  # of cos and sin: YaRN's and longrope's attention factor
        if rope_type == "longrope":
            inv_freq, scale = _longrope_short_inv_freq(exponents, params)
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(inv_freq, params)
        positions = torch.arange(max_position, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_size // 2]
        emb = torch.cat((freqs, freqs), dim=-1).numpy()
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", _float32_of(np.cos, emb, scale), persistent=False)
        self.register_buffer("sin_cache", _float32_of(np.sin, emb, scale), persistent=False)

    @classmethod
    def from_config(cls, hf_config: Any, head_size: int) -> RotaryEmbedding:
        # The tables cover every position the config allows, RoPE scaling's stretch included.
        return cls(head_size, max_positions(hf_config), get_rope_parameters(hf_config))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        """The step's rows of the tables, gathered once and shared by every layer:
        positions [num_tokens] -> cos, sin [num_tokens, 1, head_size]."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def forward(
        self, cos_sin: CosSin, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query/key [num_tokens, num_heads, head_size] -> rotated, with `cos_sin(positions)`."""
        cos, sin = cos_sin
        if self.rotary_dim < self.head_size:  # the rest of each head passes through
            dim = self.rotary_dim
            q_rot, k_rot = rotate(query[..., :dim], key[..., :dim], cos, sin)
            return torch.cat((q_rot, query[..., dim:]), -1), torch.cat((k_rot, key[..., dim:]), -1)
        if cpu_kernels.applies(query, key, cos, sin):
            return cpu_kernels.rotary(query, key, cos, sin)
        return rotate(query, key, cos, sin)


CosSin = tuple[torch.Tensor, torch.Tensor]


def _float32_of(
    function: Callable[[np.ndarray], np.ndarray], x: np.ndarray, scale: float = 1.0
) -> torch.Tensor:
    """function(x) * scale for float32 x, computed in float64 by numpy and rounded to float32:
    torch's float32 cos/sin (MKL's vector math) came out up to 1.5e-4 off in one of its threads'
    halves of the table, in about one worker process in eight, so greedy tokens could change
    between two runs of the same engine. Rounded float64 values are the float32 values to within
    an ulp."""
    # as_tensor, unlike from_numpy, honours the default device the model is being built under.
    values = function(x.astype(np.float64))
    return torch.as_tensor((values if scale == 1.0 else values * scale).astype(np.float32))


class RotaryEmbeddingsByKind(nn.Module):
    """One RoPE table per kind of layer (Gemma 3's and OLMo 3's "sliding_attention" and
    "full_attention" layers, each kind with its `rope_parameters`), shared by the layers of that
    kind, and by kinds whose parameters are the same (Gemma 2's); a step gathers each table's
    rows once."""

    def __init__(self, hf_config: Any, head_size: int, layer_kinds: list[str]) -> None:
        super().__init__()
        positions = max_positions(hf_config)
        by_parameters: dict[str, RotaryEmbedding] = {}
        tables = {}
        for kind in sorted(set(layer_kinds)):
            parameters = get_rope_parameters(hf_config, kind)
            key = repr(sorted(parameters.items()))
            if key not in by_parameters:
                by_parameters[key] = RotaryEmbedding(head_size, positions, parameters)
            tables[kind] = by_parameters[key]
        self.tables = nn.ModuleDict(tables)

    def __getitem__(self, kind: str) -> RotaryEmbedding:
        return self.tables[kind]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, CosSin]:
        rows: dict[int, CosSin] = {}
        for rope in self.tables.values():
            if id(rope) not in rows:
                rows[id(rope)] = rope.cos_sin(positions, dtype)
        return {kind: rows[id(rope)] for kind, rope in self.tables.items()}
