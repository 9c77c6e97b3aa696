"""The decoder stack in one native call (`llama_decode_stack.py`) against the layer-by-layer
forward: the same requests through the real scheduler and paged caches (prefill chunks and
decodes) must give bit-identical logits and tokens, in float32 and bfloat16, for every
architecture (biases, per-head q/k norms, sliding windows). transformers parity with the stack
on is test_model_parity.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.model.paged_runner import generate_paged
from tests.model.test_model_parity import make_prompts
from v1engine.model.hf_config import load_hf_config
from v1engine.model.layers import cpu_kernels
from v1engine.model.layers import linear as linear_module
from v1engine.model.layers.linear import LinearBase, max_kernel_tokens
from v1engine.model.loader import load_model
from v1engine.model.models.llama_decode_stack import LlamaDecodeStack

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the CPU kernels"
)

# (preset, config overrides): Qwen2 has q/k/v biases and a sliding window on some layers, Qwen3
# q/k norms, Mistral a window everywhere; Llama with biases on every projection.
CASES = [
    ("llama", {}),
    ("llama", dict(attention_bias=True, mlp_bias=True)),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {}),
]


class StackCalls(list):
    """The number of tokens of each step the stack ran; `enabled = False` turns it off."""

    enabled = True


@pytest.fixture
def stack_calls(monkeypatch) -> StackCalls:
    calls = StackCalls()
    applies, run = LlamaDecodeStack.applies, LlamaDecodeStack.__call__

    def counting_applies(self, hidden):
        return calls.enabled and applies(self, hidden)

    def counting_call(self, hidden, cos_sin):
        calls.append(hidden.shape[0])
        return run(self, hidden, cos_sin)

    monkeypatch.setattr(LlamaDecodeStack, "applies", counting_applies)
    monkeypatch.setattr(LlamaDecodeStack, "__call__", counting_call)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch,overrides", CASES, ids=[f"{a}{'-bias' * bool(o)}" for a, o in CASES])
def test_stack_matches_the_layers_bit_for_bit(tmp_path, stack_calls, arch, overrides, dtype):
    path = make_checkpoint(tmp_path, arch, **overrides)
    model = load_model(path, load_hf_config(path), dtype, "cpu")
    prompts = make_prompts(model.config.vocab_size, [11, 5, 17])

    outputs, logits = generate_paged(model, prompts, max_new_tokens=6)
    # Every step the matmul kernels take: in float32 the prefill chunks of the 10-token budget
    # too, then the decodes of 3, 2, 1 requests.
    most = max_kernel_tokens(dtype)
    assert 1 in stack_calls and max(stack_calls) <= most, stack_calls
    assert (10 in stack_calls) == (most >= 10), stack_calls
    stack_calls.enabled = False
    expected_outputs, expected_logits = generate_paged(model, prompts, max_new_tokens=6)
    assert outputs == expected_outputs
    for ours, expected in zip(logits, expected_logits):
        assert torch.equal(ours, expected)

    # Caches bound anew (as generate_paged does each run): the stack follows them.
    stack_calls.enabled = True
    calls_before = len(stack_calls)
    again, again_logits = generate_paged(model, prompts, max_new_tokens=6)
    assert len(stack_calls) > calls_before
    assert again == outputs and all(map(torch.equal, again_logits, logits))


def _decode_sizes(dtype: torch.dtype) -> list[int]:
    """One decode; the most the gemv takes and, for float32, the first the packed gemm takes, the
    most it takes and the first the tiled one takes; the most the kernels take."""
    most_gemv, most = cpu_kernels.max_gemv_tokens(dtype), max_kernel_tokens(dtype)
    most_packed = cpu_kernels.max_gemm_packed_tokens(dtype)
    sizes = (1, most_gemv, most_gemv + 1, most_packed, most_packed + 1, most)
    return sorted({n for n in sizes if 0 < n <= most})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_steps_of_as_many_decodes_as_the_matmul_kernels_take(tmp_path, stack_calls, dtype):
    path = make_checkpoint(tmp_path, "qwen2")
    model = load_model(path, load_hf_config(path), dtype, "cpu")
    for n in _decode_sizes(dtype):
        prompts = make_prompts(model.config.vocab_size, [3] * n)
        stack_calls.enabled = True
        outputs, logits = generate_paged(model, prompts, 4, token_budget=256, num_blocks=512)
        assert n in stack_calls
        stack_calls.enabled = False
        expected_outputs, expected_logits = generate_paged(
            model, prompts, 4, token_budget=256, num_blocks=512
        )
        assert outputs == expected_outputs
        assert all(map(torch.equal, logits, expected_logits)), n


def test_steps_of_more_decodes_than_the_kernels_take_run_the_layers(tmp_path, stack_calls):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    n = max_kernel_tokens(torch.float32) + 1
    generate_paged(
        model, make_prompts(model.config.vocab_size, [3] * n), 4, token_budget=3 * n, num_blocks=512
    )
    # All n requests prefill in the first step and decode together after: never through the stack.
    assert stack_calls == []


def test_stack_needs_the_kv_cache_in_the_model_dtype(tmp_path, stack_calls):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    prompts = make_prompts(model.config.vocab_size, [7, 4])
    generate_paged(model, prompts, 3)
    assert stack_calls
    # A float32 model over bfloat16 caches (cache_dtype) takes the layers.
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        attn.kv_cache = tuple(c.to(torch.bfloat16) for c in attn.kv_cache)
    assert model.model.decode_stack._layer_table() is None


def test_float32_weights_are_packed_at_load_unless_memory_is_short(
    tmp_path, stack_calls, monkeypatch
):
    path = make_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    projections = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(m.packed_weight is not None for m in [*projections, model.lm_head])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    prompts = make_prompts(model.config.vocab_size, [7, 4, 9])
    packed_outputs, packed_logits = generate_paged(model, prompts, 5)
    assert 3 in stack_calls

    # Too little memory for the copies: the tiled gemm takes 2-64 rows, with the same bits.
    monkeypatch.setattr(
        linear_module.psutil, "virtual_memory", lambda: SimpleNamespace(available=1)
    )
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    assert all(getattr(m, "packed_weight", None) is None for m in model.modules())
    outputs, logits = generate_paged(model, prompts, 5)
    assert outputs == packed_outputs and all(map(torch.equal, logits, packed_logits))
