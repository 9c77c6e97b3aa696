"""The greedy screen of a float32 LM head (greedy_screen.py): the argmax of the float32 logits,
exactly, on hidden states and weights made to put near-ties inside bfloat16's error; None where it
cannot decide cheaply; and which models and steps get it."""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from v1engine.model.hf_config import load_hf_config
from v1engine.model.layers import cpu_kernels, greedy_screen
from v1engine.model.layers.greedy_screen import MAX_CANDIDATES, GreedyScreen
from v1engine.model.layers.sampling_metadata import SamplingMetadata
from v1engine.model.loader import load_model

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the CPU decode kernel"
)


def _full_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the sampler takes without the screen: the argmax of every float32 logit."""
    return cpu_kernels.gemv(hidden, weight).argmax(dim=1)


def _near_tie_weights(vocab: int, hidden_size: int, generator: torch.Generator) -> torch.Tensor:
    """Rows in groups of 8 that differ from their group's first by about bfloat16's resolution
    (2^-8): rounding to bfloat16 often reorders a group's logits, so the screen's bound, not its
    approximate argmax, has to find the winner."""
    base = torch.randn(vocab // 8, hidden_size, generator=generator)
    weight = base.repeat_interleave(8, dim=0)
    nudges = (torch.rand(weight.shape, generator=generator) * 2 - 1) * 2.0**-7
    return (weight * (1 + nudges)).contiguous()


@pytest.mark.parametrize("rows", [1, 2, 3, 5])  # the gemv, then (AVX512-BF16) the gemm
def test_screen_picks_the_float32_argmax_among_near_ties(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = _near_tie_weights(512, 96, generator)
    screen = GreedyScreen(weight)
    for _ in range(200):
        hidden = torch.randn(rows, 96, generator=generator) * 3
        tokens = screen.argmax(hidden)
        assert tokens is not None and tokens.dtype == torch.int64
        assert torch.equal(tokens, _full_argmax(hidden, weight))


def test_ties_go_to_the_first_row_as_argmax_does():
    weight = torch.randn(1, 64).repeat(40, 1).contiguous()  # 40 equal logits
    weight[:10] *= 0.5  # smaller logits first, so the tie starts at row 10
    hidden = weight[-1:].clone()
    assert GreedyScreen(weight).argmax(hidden).tolist() == [10]
    assert _full_argmax(hidden, weight).tolist() == [10]


def test_too_many_candidates_and_nan_leave_the_choice_to_the_full_logits():
    weight = torch.ones(MAX_CANDIDATES + 1, 16)  # every logit the same
    assert GreedyScreen(weight).argmax(torch.randn(1, 16)) is None
    screen = GreedyScreen(torch.randn(64, 16))
    hidden = torch.randn(2, 16)
    hidden[1, 3] = float("nan")
    assert screen.argmax(hidden) is None


def test_float32_cpu_models_get_the_screen_and_bfloat16_ones_do_not(tmp_path):
    path = make_checkpoint(tmp_path, "llama_tied")
    model = load_model(path, load_hf_config(path), torch.float32, "cpu")
    screen = GreedyScreen.for_model(model)
    assert screen is not None  # and it reads the head's own float32 rows, not a copy:
    assert screen.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert screen.nbytes >= model.lm_head.weight.numel() * 2
    model = load_model(path, load_hf_config(path), torch.bfloat16, "cpu")
    assert GreedyScreen.for_model(model) is None
    most = greedy_screen.MAX_ROWS  # decode steps of a few requests
    assert GreedyScreen.applies(most) and not GreedyScreen.applies(most + 1)
    assert not GreedyScreen.applies(0)


def test_only_plain_greedy_steps_take_the_argmax_alone():
    assert SamplingMetadata.from_lists([0.0, 0.0], 32).argmax_only
    assert not SamplingMetadata.from_lists([0.0, 0.7], 32).argmax_only
    assert not SamplingMetadata.from_lists([0.0], 32, max_num_logprobs=0).argmax_only
    assert not SamplingMetadata.from_lists([0.0], 32, logit_bias=[{3: 1.0}]).argmax_only
    assert not SamplingMetadata.from_lists([0.0], 32, banned_token_ids=[[2]]).argmax_only
    penalized = SamplingMetadata.from_lists(
        [0.0], 32, presence_penalty=[0.5], output_token_ids=[[1]], prompt_token_ids=[[2]]
    )
    assert not penalized.argmax_only
    bitmask = ([0], torch.full((1, 1), -1, dtype=torch.int32))
    assert not SamplingMetadata.from_lists([0.0], 32, grammar_bitmask=bitmask).argmax_only
