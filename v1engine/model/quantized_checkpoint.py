"""Checkpoints whose linear weights are stored in FP8, dequantized as they load (the loader's
`load_checkpoint`): Qwen3-*-FP8 and DeepSeek-style block-quantized ones (`quant_method: "fp8"`),
and compressed-tensors float8 ones (RedHatAI's *-FP8-dynamic). They then run as the unquantized
model would, in the engine's dtype: no FP8 matmuls and no memory saved, but served at all, with
the checkpoint's rounding. Any other quantization method (AWQ, GPTQ, bitsandbytes, int4
compressed-tensors, ...) is refused by name when the config is read, before any worker starts.

- "fp8": each quantized `<layer>.weight` (float8_e4m3fn) comes with `<layer>.weight_scale_inv`,
  one float32 per `weight_block_size` block (the name notwithstanding, a multiplier), or without
  a block size with `<layer>.weight_scale`, one per tensor;
- compressed-tensors, 8-bit float weights: `<layer>.weight_scale`, one per output channel
  [out, 1] or one per tensor.
Activation and KV scales (`input_scale`, `k_scale`, ...) serve FP8 arithmetic only: skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from v1engine.model.weight_utils import WeightSource

_AUXILIARY = (".input_scale", ".output_scale", ".q_scale", ".k_scale", ".v_scale")


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's FP8 weights are scaled: the scale tensor's name after the layer's,
    and the block each scale covers (None: the scale broadcasts, per tensor or per channel)."""

    scale_name: str
    block: tuple[int, int] | None = None


def fp8_weights(hf_config: Any) -> Fp8Weights | None:
    """The checkpoint's FP8 layout, None for an unquantized checkpoint.

    Raises:
        ValueError: a quantization method v1engine does not load, named.
    """
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    method = config.get("quant_method")
    if method == "fp8":
        block = config.get("weight_block_size")
        if block is None:
            return Fp8Weights("weight_scale")
        return Fp8Weights("weight_scale_inv", (int(block[0]), int(block[1])))
    if method == "compressed-tensors" and _float8_weights_only(config):
        return Fp8Weights("weight_scale")
    raise ValueError(
        f"quantization {method!r} ({config.get('format') or config.get('bits') or 'its scheme'}) "
        "is not supported: v1engine loads unquantized checkpoints, GGUF files and FP8 ones "
        "(quant_method fp8, or compressed-tensors with 8-bit float weights), which it "
        "dequantizes; use one of those"
    )


def _float8_weights_only(config: dict[str, Any]) -> bool:
    weights = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
    return bool(weights) and all(
        w.get("num_bits") == 8
        and w.get("type") == "float"
        and w.get("strategy") in ("tensor", "channel")
        for w in weights
    )


def dequantized(
    weights: Iterator[tuple[str, WeightSource]], scales: dict[str, torch.Tensor], layout: Fp8Weights
) -> Iterator[tuple[str, WeightSource]]:
    """The checkpoint's tensors with each FP8 weight dequantized to float32 (`scales`: every
    `<layer>.<layout.scale_name>` tensor of the checkpoint), and the scales themselves and the
    activation scales left out."""
    from v1engine.model.weight_utils import materialize

    for name, source in weights:
        if name.endswith((f".{layout.scale_name}", *_AUXILIARY)):
            continue
        scale = scales.get(f"{name.removesuffix('.weight')}.{layout.scale_name}")
        if name.endswith(".weight") and scale is not None:
            yield name, dequantize(materialize(source), scale, layout.block)
        else:
            yield name, source


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """weight [out, in] (FP8) times its scales, in float32: one per [block_out, block_in] block
    (the last blocks may be partial), or `scale` broadcast ([out, 1], [1] or [])."""
    values = weight.float()
    if block is None:
        return values * scale.float()
    rows, cols = values.shape
    per_element = scale.float().repeat_interleave(block[0], 0)[:rows]
    return values * per_element.repeat_interleave(block[1], 1)[:, :cols]
