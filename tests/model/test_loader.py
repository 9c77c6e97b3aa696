"""Weight loading: single and sharded safetensors, lazy slices, and bad-checkpoint errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.model.checkpoints import make_checkpoint
from v1engine.model.hf_config import load_hf_config
from v1engine.model.loader import get_weight_files, load_model
from v1engine.model.weight_utils import materialize, narrow_weight, weight_shape


def _load(path: str) -> torch.nn.Module:
    return load_model(path, load_hf_config(path), torch.float32, "cpu")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_checkpoint(tmp_path, "qwen2", name="single")
    sharded = make_checkpoint(tmp_path, "qwen2", name="sharded", max_shard_size="40KB")
    assert len(get_weight_files(sharded)) > 1
    a, b = _state(_load(single)), _state(_load(sharded))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_merged_projections_hold_checkpoint_tensors(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    layer = _load(path).model.layers[0]
    prefix = "model.layers.0."
    qkv = torch.cat([tensors[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
    gate_up = torch.cat([tensors[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, atol=0, rtol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, atol=0, rtol=0)


def test_narrowed_slices_read_the_right_shard(tmp_path):
    tensor = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    file = str(tmp_path / "t.safetensors")
    save_file({"w": tensor}, file)
    with safe_open(file, framework="pt") as f:
        rows = narrow_weight(f.get_slice("w"), 0, 2, 3)
        assert weight_shape(rows) == (3, 8)
        torch.testing.assert_close(materialize(rows), tensor[2:5])
        cols = narrow_weight(f.get_slice("w"), 1, 4, 4)
        torch.testing.assert_close(materialize(cols), tensor[:, 4:8])
        twice = narrow_weight(rows, 0, 1, 2)  # composes with the first narrow
        torch.testing.assert_close(materialize(twice), tensor[3:5])


def _rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(path)


def test_unexpected_tensor_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    _rewrite(path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"'model\.extra\.weight' has no parameter"):
        _load(path)


def test_wrong_shape_is_explained(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    _rewrite(path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"shape \[3\] but the model expects \[64\]"):
        _load(path)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    path = make_checkpoint(tmp_path, "llama_tied")
    _rewrite(path, lambda t: t.update({"lm_head.weight": torch.zeros(131, 64)}))
    model = _load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0  # the embedding, not the zeros


def test_missing_weight_files_are_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(RuntimeError, match=shard):
        _load(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="no model.safetensors"):
        get_weight_files(str(empty))
