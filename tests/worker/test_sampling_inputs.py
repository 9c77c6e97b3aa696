"""From request states to the sampler's SamplingMetadata: which tokens bad words and min_tokens ban
at each step, and that only the rows that use a mask or a bias pay for one."""

from __future__ import annotations

import dataclasses

import torch

from v1engine.sampling_params import SamplingParams
from v1engine.worker.model_inputs import (
    banned_token_ids,
    build_sampling_metadata,
    dummy_sampling_metadata,
)
from v1engine.worker.request_states import CachedRequestState

_VOCAB = 50
_EOS = 2


def _state(output: list[int], **params) -> CachedRequestState:
    sampling_params = dataclasses.replace(SamplingParams(**params), _eos_token_id=_EOS)
    return CachedRequestState("r", [1, 3], sampling_params, None, [[]], 2, list(output))


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    assert banned_token_ids(_state([5], min_tokens=3, stop_token_ids=[7]), _VOCAB) == [7, _EOS]
    assert banned_token_ids(_state([5, 6, 8], min_tokens=3, stop_token_ids=[7]), _VOCAB) == []
    # ignore_eos: EOS is no stop, so nothing holds it off; an id outside the vocab cannot be drawn.
    ignored = _state([], min_tokens=2, stop_token_ids=[7, 999], ignore_eos=True)
    assert banned_token_ids(ignored, _VOCAB) == [7]


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    words = [[9], [4, 5, 6], [11, 12]]
    for output, expected in [
        ([], [9]),  # a one-token word is always banned
        ([1, 4], [9]),  # [4, 5] has not been produced yet
        ([1, 4, 5], [9, 6]),
        ([4, 5, 11], [9, 12]),
        ([11], [9, 12]),
    ]:
        state = _state(output)
        state.sampling_params._bad_words_token_ids = words
        assert banned_token_ids(state, _VOCAB) == expected, output


def test_only_rows_with_masks_or_bias_get_a_bias_row() -> None:
    plain = _state([], temperature=0.0)
    biased = _state([], logit_bias={3: 2.5, 4: -100.0})
    allowed = _state([], allowed_token_ids=[3, 4])
    held = _state([5], min_tokens=4)
    device = torch.device("cpu")
    assert build_sampling_metadata([plain, plain], _VOCAB, device).logit_bias is None
    metadata = build_sampling_metadata([plain, biased, allowed, plain, held], _VOCAB, device)
    assert metadata.logit_bias_rows.tolist() == [1, 2, 4]
    bias = metadata.logit_bias
    assert bias[0, 3] == 2.5 and bias[0, 4] == -100.0 and bias[0].count_nonzero() == 2
    assert torch.isinf(bias[1]).sum() == _VOCAB - 2 and bias[1, [3, 4]].tolist() == [0.0, 0.0]
    assert bias[2, _EOS] == float("-inf") and bias[2].isinf().sum() == 1
    # Once min_tokens are out the row needs nothing.
    assert (
        build_sampling_metadata([_state([5] * 4, min_tokens=4)], _VOCAB, device).logit_bias is None
    )


def test_profiling_metadata_turns_every_stage_on() -> None:
    metadata = dummy_sampling_metadata(3, _VOCAB, 8, 20, torch.device("cpu"))
    assert metadata.logit_bias.shape == (3, _VOCAB) and metadata.logit_bias_rows.tolist() == [
        0,
        1,
        2,
    ]
    assert not metadata.no_penalties and metadata.max_num_logprobs == min(20, _VOCAB)
    # The engine's max_logprobs: -1 (no limit) profiles every token's logprob.
    every = dummy_sampling_metadata(3, _VOCAB, 8, -1, torch.device("cpu"))
    assert every.max_num_logprobs == _VOCAB
    assert None not in (metadata.top_k, metadata.top_p, metadata.min_p)
