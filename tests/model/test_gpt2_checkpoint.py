"""GPT-2 checkpoints as they come: tensors named `transformer.*` or without the prefix (the
original `gpt2` upload), with or without the causal-mask buffers, load into the same model."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from tests.model.checkpoints import make_checkpoint
from v1engine.model.hf_config import load_hf_config
from v1engine.model.loader import load_model


def _load(path: str) -> dict[str, torch.Tensor]:
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"), False)
    return {name: param.clone() for name, param in model.named_parameters()}


def test_unprefixed_names_and_mask_buffers_load_the_same_model(tmp_path):
    path = make_checkpoint(tmp_path, "gpt2")
    expected = _load(path)
    weights_file = os.path.join(path, "model.safetensors")
    tensors = load_file(weights_file)
    assert any(name.startswith("transformer.") for name in tensors)
    renamed = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))  # old checkpoints' mask
    renamed["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(renamed, weights_file, metadata={"format": "pt"})
    got = _load(path)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # The Conv1D weights were transposed: q of layer 0 is c_attn's first columns.
    q = got["model.layers.0.attn.fused_qkv.weight"][:64]
    assert torch.equal(q, tensors["transformer.h.0.attn.c_attn.weight"][:, :64].t())
