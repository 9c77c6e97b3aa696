"""Our models against transformers on the same random weights, float32, tensor-parallel size 1.

Requests run through a paged KV cache with chunked prefill and decodes mixed in each step; every
processed position's logits must match transformers' full-sequence forward (atol 1e-4), and the
greedy tokens must be the ones transformers would pick.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import CHECKPOINT_PRESETS, load_hf_model, make_checkpoint
from tests.model.paged_runner import generate_paged, hf_reference
from v1engine.model.hf_config import load_hf_config
from v1engine.model.layers.attention import get_attention_layers
from v1engine.model.layers.attention_backend import set_forward_context
from v1engine.model.loader import load_model

ATOL = 1e-4
MAX_NEW_TOKENS = 5
PROMPT_LENS = [11, 5, 17, 3]


def make_prompts(vocab_size: int, lens: list[int] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def check_against_hf(hf_model, prompts, outputs, logits) -> None:
    for prompt, generated, ours in zip(prompts, outputs, logits):
        expected = hf_reference(hf_model, prompt, generated)
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
        hf_greedy = expected[len(prompt) - 1 :].argmax(-1).tolist()
        assert generated == hf_greedy


@pytest.mark.parametrize("arch", sorted(CHECKPOINT_PRESETS))
def test_paged_generation_matches_transformers(tmp_path, arch):
    path = make_checkpoint(tmp_path, arch)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    prompts = make_prompts(model.config.vocab_size)
    outputs, logits = generate_paged(model, prompts, MAX_NEW_TOKENS)
    check_against_hf(load_hf_model(path), prompts, outputs, logits)


def test_yarn_positions_past_the_original_context_match_transformers(tmp_path):
    """Qwen's recipe for long prompts: YaRN 4x over the trained context (here 256 positions), so
    a 300-token prompt runs past it; the RoPE tables cover the stretched 1024 positions."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    yarn["original_max_position_embeddings"] = 256
    path = make_checkpoint(tmp_path, "qwen3", rope_parameters=yarn)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    assert model.model.rotary_emb.cos_cache.shape[0] == 1024
    prompts = make_prompts(model.config.vocab_size, [300, 7])
    outputs, logits = generate_paged(model, prompts, 3, token_budget=64, num_blocks=160)
    check_against_hf(load_hf_model(path), prompts, outputs, logits)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_forward_without_kv_cache_matches_transformers(tmp_path, arch):
    """The profiling path: no cache bound, one or several requests, attends over new tokens."""
    path = make_checkpoint(tmp_path, arch)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    hf_model = load_hf_model(path)
    prompt = make_prompts(model.config.vocab_size, [13])[0]
    expected = hf_reference(hf_model, prompt, [0])
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    torch.testing.assert_close(
        model.compute_logits(model(ids, positions)), expected, atol=ATOL, rtol=0
    )

    # Two requests in one batch, each a fresh sequence, without a cache, as in profiling.
    n = len(prompt)
    query_start_loc = torch.tensor([0, n, 2 * n], dtype=torch.int32)
    assert all(layer.kv_cache is None for layer in get_attention_layers(model).values())
    with set_forward_context(query_start_loc):
        hidden = model(ids.repeat(2), positions.repeat(2))
    logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits[: len(prompt)], expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[len(prompt) :], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_output_rows_stop_after_the_last_layers_attention(tmp_path, arch):
    """The rows the LM head reads (the runner passes the sampling rows) leave the model alone,
    with the hidden states the full forward gives them; the other rows still reach the last
    layer's attention (their K/V are written) but not its o_proj or MLP."""
    path = make_checkpoint(tmp_path, arch)
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    prompt = make_prompts(model.config.vocab_size, [13])[0]
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    full = model(ids, positions)  # [13, hidden]

    rows_seen: dict[str, list[int]] = {}

    def record(name):
        return lambda module, args: rows_seen.setdefault(name, []).append(args[0].shape[0])

    last = model.model.layers[-1]
    hooks = [
        last.self_attn.attn.register_forward_pre_hook(record("last attention")),
        last.self_attn.o_proj.register_forward_pre_hook(record("last o_proj")),
        last.mlp.register_forward_pre_hook(record("last mlp")),
        model.model.layers[0].mlp.register_forward_pre_hook(record("first mlp")),
    ]
    output_rows = torch.tensor([4, 12])
    part = model(ids, positions, output_rows)
    for hook in hooks:
        hook.remove()
    assert rows_seen == {
        "first mlp": [13],
        "last attention": [13],
        "last o_proj": [2],
        "last mlp": [2],
    }
    torch.testing.assert_close(part, full[output_rows], atol=1e-5, rtol=0)


def test_bfloat16_model_tracks_float32(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2")
    hf_config = load_hf_config(path)
    prompts = make_prompts(hf_config.vocab_size, [9, 4])
    model32 = load_model(path, hf_config, torch.float32, "cpu")
    model16 = load_model(path, hf_config, torch.bfloat16, "cpu")
    assert next(model16.parameters()).dtype == torch.bfloat16
    # One new token: both runs process exactly the prompts, so the rows line up.
    _, logits32 = generate_paged(model32, prompts, 1)
    _, logits16 = generate_paged(model16, prompts, 1)
    for a, b in zip(logits32, logits16):
        assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2_hybrid", "mistral"])
def test_cuda_paged_generation_matches_transformers(tmp_path, arch):
    """The CUDA path (Triton kernels when importable); looser bound for GPU float32 matmuls."""
    path = make_checkpoint(tmp_path, arch)
    model = load_model(path, load_hf_config(path), torch.float32, "cuda")
    prompts = make_prompts(model.config.vocab_size)
    outputs, logits = generate_paged(model, prompts, MAX_NEW_TOKENS)
    hf_model = load_hf_model(path)
    for prompt, generated, ours in zip(prompts, outputs, logits):
        expected = hf_reference(hf_model, prompt, generated)
        torch.testing.assert_close(ours, expected, atol=2e-3, rtol=0)
        assert generated == expected[len(prompt) - 1 :].argmax(-1).tolist()
