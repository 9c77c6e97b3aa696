"""FP8 checkpoints (model/quantized_checkpoint.py), dequantized as they load: a checkpoint whose
linear weights are float8 with their scales (in blocks, as Qwen3-*-FP8's, partial blocks
included; or per output channel, as compressed-tensors' FP8-dynamic ones, with activation scales
to skip) loads exactly the weights of an unquantized checkpoint holding the dequantized values,
and generates the same tokens at tensor-parallel size 2; other quantizations are refused by name
before any worker starts."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, make_llm, token_ids
from tests.model.checkpoints import make_checkpoint
from v1engine.model.hf_config import load_hf_config
from v1engine.model.loader import load_model

_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FP8_MAX = 448.0  # float8_e4m3fn's largest value
_BLOCK = (24, 40)  # 64 rows: blocks of 24, 24, 16; 64 columns: 40, 24
_LAYOUTS = {
    "fp8_blocks": {"quant_method": "fp8", "weight_block_size": list(_BLOCK)},
    "compressed_tensors_channels": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
                "targets": ["Linear"],
            }
        },
        "ignore": ["lm_head"],
    },
}


def _quantize(weight: torch.Tensor, block: tuple[int, int] | None):
    """(float8 weight, scales, the dequantized float32 weight), computed here block by block."""
    if block is None:
        scale = weight.abs().amax(dim=1, keepdim=True) / _FP8_MAX  # [out, 1]
        fp8 = (weight / scale).to(torch.float8_e4m3fn)
        return fp8, scale, fp8.float() * scale
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    fp8 = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    dequantized = torch.empty(weight.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows_ij = slice(i * block[0], (i + 1) * block[0])
            part = (rows_ij, slice(j * block[1], (j + 1) * block[1]))
            scale[i, j] = weight[part].abs().max() / _FP8_MAX
            fp8[part] = (weight[part] / scale[i, j]).to(torch.float8_e4m3fn)
            dequantized[part] = fp8[part].float() * scale[i, j]
    return fp8, scale, dequantized


def _variants(source: str, root: str, layout: str) -> tuple[str, str]:
    """(the FP8 checkpoint, the unquantized one holding its dequantized weights)."""
    config = _LAYOUTS[layout]
    blocks = layout == "fp8_blocks"
    scale_name = "weight_scale_inv" if blocks else "weight_scale"
    quantized, expected = {}, {}
    for name, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if name.endswith(".weight") and name.split(".")[-2] in _QUANTIZED:
            fp8, scale, dequantized = _quantize(tensor, _BLOCK if blocks else None)
            layer = name.removesuffix(".weight")
            quantized |= {name: fp8, f"{layer}.{scale_name}": scale}
            if not blocks:
                quantized[f"{layer}.input_scale"] = torch.tensor([1.0])
            expected[name] = dequantized
        else:
            quantized[name] = expected[name] = tensor
    paths = []
    for kind, tensors in (("fp8", quantized), ("expected", expected)):
        path = os.path.join(root, f"{layout}_{kind}")
        shutil.copytree(source, path)
        save_file(tensors, os.path.join(path, "model.safetensors"))
        if kind == "fp8":
            _set_config(path, quantization_config=config)
        paths.append(path)
    return paths[0], paths[1]


def _set_config(path: str, **values) -> None:
    with open(os.path.join(path, "config.json")) as f:
        content = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(content | values, f)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("fp8"), "llama")


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_fp8_weights_load_as_their_dequantized_values(llama, tmp_path, layout):
    fp8, expected = _variants(llama, str(tmp_path), layout)
    models = [load_model(p, load_hf_config(p), torch.float32, "cpu") for p in (fp8, expected)]
    params = [dict(model.named_parameters()) for model in models]
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][name], params[1][name]) for name in params[0])
    q_proj = params[0]["model.layers.0.self_attn.qkv_proj.weight"]
    assert q_proj.dtype == torch.float32 and q_proj.abs().sum() > 0


def test_an_fp8_checkpoint_generates_as_its_dequantized_twin_at_tp2(llama, tmp_path):
    fp8, expected = _variants(llama, str(tmp_path), "fp8_blocks")
    outputs = []
    for path in (fp8, expected):
        with make_llm(path, tensor_parallel_size=2) as llm:
            outputs.append(token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        ({"quant_method": "awq", "bits": 4}, "quantization 'awq' \\(4\\) is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "quantization 'gptq'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "quantization 'compressed-tensors' \\(pack-quantized\\)",
        ),
    ],
)
def test_other_quantizations_are_refused_before_any_worker_starts(
    llama, tmp_path, quantization, match
):
    path = str(tmp_path / "quantized")
    shutil.copytree(llama, path)
    _set_config(path, quantization_config=quantization)
    with pytest.raises(ValueError, match=match):
        make_llm(path)
