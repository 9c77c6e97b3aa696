"""LoRA in the CPU decoder stack (`llama_decode_stack.py`): a step whose tokens all run one
adapter stays in the native call, which adds each matmul's delta as the layers do; its logits
are the layer-by-layer forward's up to float rounding (another kernel sums the delta), and its
tokens the same. A step that mixes adapters runs the layers."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from tests.lora.adapters import make_adapter
from tests.model import paged_runner, test_decode_stack
from tests.model.checkpoints import make_checkpoint
from tests.model.paged_runner import generate_paged
from tests.model.test_model_parity import make_prompts
from v1engine.config import LoRAConfig
from v1engine.lora.layers import LoRAMapping
from v1engine.lora.manager import LoRAModelManager
from v1engine.lora.request import LoRARequest
from v1engine.model.hf_config import load_hf_config
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers.attention_backend import set_forward_context
from v1engine.model.loader import load_model

stack_calls = test_decode_stack.stack_calls  # the fixture counting the stack's steps

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the CPU kernels"
)


def _lora_model(tmp_path, arch: str, dtype: torch.dtype):
    """A model with two LoRA slots, an adapter in slot 1 (0 holds another), and prompts."""
    path = make_checkpoint(tmp_path, arch)
    hf_config = load_hf_config(path)
    model = load_model(path, hf_config, dtype, "cpu")
    manager = LoRAModelManager(
        model, hf_config, LoRAConfig(max_loras=2), dtype, torch.device("cpu")
    )
    other = LoRARequest("other", 1, make_adapter(tmp_path / "other", hf_config, seed=3))
    adapter = LoRARequest("a", 2, make_adapter(tmp_path / "a", hf_config, rank=8))
    manager.step_mapping([other, adapter], np.array([1, 1]))  # other in slot 0, "a" in slot 1
    assert manager.slot_ids == [1, 2]
    return model, make_prompts(hf_config.vocab_size, [11, 5, 17])


def _generate(model, prompts, monkeypatch, mapping: LoRAMapping | None):
    context = functools.partial(set_forward_context, lora=mapping)
    monkeypatch.setattr(paged_runner, "set_forward_context", context)
    return generate_paged(model, prompts, max_new_tokens=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_adapter_stays_in_the_stack_and_matches_the_layers(
    tmp_path,
    stack_calls,
    monkeypatch,
    arch,
    dtype,
):
    model, prompts = _lora_model(tmp_path, arch, dtype)
    outputs, logits = _generate(model, prompts, monkeypatch, LoRAMapping(slot=1))
    assert 1 in stack_calls  # the decodes ran in the stack
    stack_calls.enabled = False
    expected_outputs, expected_logits = _generate(model, prompts, monkeypatch, LoRAMapping(slot=1))
    base_outputs, _ = _generate(model, prompts, monkeypatch, None)
    assert outputs == expected_outputs != base_outputs  # the adapter changed the tokens
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for ours, expected in zip(logits, expected_logits):
        torch.testing.assert_close(ours, expected, atol=tolerance, rtol=0)


def test_a_mix_of_adapters_runs_the_layers(tmp_path, stack_calls, monkeypatch):
    model, prompts = _lora_model(tmp_path, "llama", torch.float32)

    @contextlib.contextmanager
    def every_token_on_slot_1_as_a_mix(query_start_loc, backend, metadata):
        one_hot = torch.zeros(int(query_start_loc[-1]), 2)
        one_hot[:, 1] = 1.0
        with set_forward_context(query_start_loc, backend, metadata, LoRAMapping(None, one_hot)):
            yield

    monkeypatch.setattr(paged_runner, "set_forward_context", every_token_on_slot_1_as_a_mix)
    mixed_outputs, _ = generate_paged(model, prompts, max_new_tokens=6)
    assert not stack_calls
    stack_calls.enabled = False
    assert mixed_outputs == _generate(model, prompts, monkeypatch, LoRAMapping(slot=1))[0]
