"""Sampler semantics: greedy, truncation supports, penalties, logit bias and token masks, seeded
determinism, logprobs."""

from __future__ import annotations

import pytest
import torch

from v1engine.model.layers.sampler import Sampler, SamplingMetadata, apply_penalties

_VOCAB = 32


def _logits(num_reqs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, _VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _sample_support(logits: torch.Tensor, num_draws: int = 400, **per_row) -> set[int]:
    """Tokens drawn from row 0's distribution: the row repeated num_draws times in one batch."""
    torch.manual_seed(0)
    lists = {name: [value] * num_draws for name, value in per_row.items()}
    metadata = SamplingMetadata.from_lists([1.0] * num_draws, _VOCAB, **lists)
    batch = logits[:1].expand(num_draws, -1)
    return set(Sampler()(batch, metadata).sampled_token_ids.tolist())


def test_greedy_is_argmax_and_mixes_with_random_rows() -> None:
    logits = _logits(6)
    metadata = SamplingMetadata.from_lists([0.0, 1.0, 0.0, 0.7, 0.0, 2.0], _VOCAB)
    assert not metadata.all_greedy and not metadata.all_random
    out = Sampler()(logits, metadata).sampled_token_ids
    assert out.dtype == torch.int64 and out.shape == (6,)
    greedy_rows = [0, 2, 4]
    assert torch.equal(out[greedy_rows], logits[greedy_rows].argmax(-1))
    all_greedy = SamplingMetadata.from_lists([0.0] * 6, _VOCAB)
    assert torch.equal(Sampler()(logits, all_greedy).sampled_token_ids, logits.argmax(-1))


def test_unrestricted_sampling_reaches_beyond_argmax() -> None:
    logits = torch.zeros(1, _VOCAB)  # uniform: 400 draws cover nearly every token
    assert len(_sample_support(logits)) > _VOCAB // 2


def test_exponential_race_matches_probabilities() -> None:
    # 8000 draws of a 4-token distribution at temperature 0.5: each frequency within 0.03
    # (over 5 standard deviations of a binomial estimate at n = 8000).
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    torch.manual_seed(0)
    metadata = SamplingMetadata.from_lists([0.5] * 8000, 4)
    tokens = Sampler()(logits.expand(8000, -1), metadata).sampled_token_ids
    expected = torch.softmax(logits[0] / 0.5, dim=-1)
    frequencies = torch.bincount(tokens, minlength=4) / 8000
    torch.testing.assert_close(frequencies, expected, atol=0.03, rtol=0)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_restricts_support(k: int) -> None:
    logits = _logits(1)
    allowed = set(logits[0].topk(k).indices.tolist())
    support = _sample_support(logits, top_k=k)
    assert support <= allowed and (k == 1 or len(support) > 1)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_restricts_support_to_smallest_covering_set(top_p: float) -> None:
    logits = _logits(1, seed=3) / 3
    probs, order = logits[0].softmax(-1).sort(descending=True)
    # Token i is kept iff the mass of the tokens before it is < top_p.
    num_kept = int(((probs.cumsum(0) - probs) < top_p).sum())
    support = _sample_support(logits, top_p=top_p)
    assert support <= set(order[:num_kept].tolist()) and len(support) > 1


def test_min_p_restricts_support() -> None:
    logits = _logits(1, seed=5) / 3
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    support = _sample_support(logits, min_p=0.2)
    assert support <= allowed and len(support) > 1


def test_top_k_and_top_p_combine() -> None:
    logits = _logits(1, seed=7)
    support = _sample_support(logits, top_k=5, top_p=0.999)
    assert support <= set(logits[0].topk(5).indices.tolist())


def test_off_values_leave_rows_unrestricted() -> None:
    # Row 0 restricts; row 1 carries every "off" value and must still see the whole vocabulary.
    metadata = SamplingMetadata.from_lists(
        [1.0, 1.0], _VOCAB, top_k=[1, -1], top_p=[0.5, 1.0], min_p=[0.5, 0.0]
    )
    logits = torch.zeros(2, _VOCAB)
    logits[0, 3] = 5.0
    seen = [set(), set()]
    for _ in range(100):
        out = Sampler()(logits, metadata).sampled_token_ids.tolist()
        seen[0].add(out[0])
        seen[1].add(out[1])
    assert seen[0] == {3} and len(seen[1]) > _VOCAB // 2


def test_penalties_follow_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    metadata = SamplingMetadata.from_lists(
        [1.0, 1.0], 5,
        presence_penalty=[0.5, 0.0], frequency_penalty=[0.25, 0.0], repetition_penalty=[2.0, 1.0],
        prompt_token_ids=[[2, 3], [0]], output_token_ids=[[0, 0, 1, 0], []],
    )  # fmt: skip
    out = apply_penalties(logits, metadata)
    # Row 0: token 0 in output 3x (2/2 - 0.25*3 - 0.5), token 1 once (-2*2 - 0.25 - 0.5),
    # tokens 2 and 3 only in the prompt (repetition only), token 4 untouched.
    expected0 = [1.0 - 0.75 - 0.5, -4.0 - 0.25 - 0.5, 0.5, -2.0, 0.5]
    torch.testing.assert_close(out[0], torch.tensor(expected0))
    torch.testing.assert_close(out[1], logits[1])  # all penalties off
    assert torch.equal(logits[0], torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5]))  # input untouched


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    metadata = SamplingMetadata.from_lists(
        [0.0], 3, repetition_penalty=[1.5], output_token_ids=[[0]]
    )
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [1]


def test_logit_bias_forces_a_token_in_its_row_only() -> None:
    logits = _logits(3)
    forced = int(logits[1].argmin())
    metadata = SamplingMetadata.from_lists(
        [0.0, 0.7, 0.0], _VOCAB, logit_bias=[None, {forced: 100.0}, {}], max_num_logprobs=1
    )
    assert metadata.logit_bias_rows.tolist() == [1]  # an empty dict is no bias
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids[1] == forced
    assert out.sampled_token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    # Logprobs stay raw: the bias changes what is sampled, not the model's logprob of it.
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    )
    assert out.logprobs.sampled_token_ranks[1] > 1


def test_negative_logit_bias_moves_greedy_to_the_runner_up() -> None:
    logits = _logits(1, seed=2)
    top2 = logits[0].topk(2).indices.tolist()
    metadata = SamplingMetadata.from_lists([0.0], _VOCAB, logit_bias=[{top2[0]: -100.0}])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [top2[1]]


def test_allowed_token_ids_restrict_support_in_a_mixed_batch() -> None:
    allowed = [3, 7, 11, 30]
    support = _sample_support(torch.zeros(1, _VOCAB), allowed_token_ids=allowed)
    assert support == set(allowed)  # every allowed token is drawn from a uniform row
    # Greedy: the best allowed token; a row without the list is untouched.
    logits = _logits(2, seed=4)
    metadata = SamplingMetadata.from_lists([0.0, 0.0], _VOCAB, allowed_token_ids=[allowed, None])
    out = Sampler()(logits, metadata).sampled_token_ids.tolist()
    assert out == [allowed[int(logits[0, allowed].argmax())], int(logits[1].argmax())]


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(1, _VOCAB)
    logits[0, :4] = 5.0  # four favourites, two of them banned
    support = _sample_support(logits, banned_token_ids=[0, 2])
    assert support & {0, 2} == set() and {1, 3} <= support
    greedy = SamplingMetadata.from_lists([0.0, 0.0], _VOCAB, banned_token_ids=[[0, 1, 2], []])
    assert Sampler()(logits.expand(2, -1), greedy).sampled_token_ids.tolist() == [3, 0]


def test_masks_win_over_bias_and_combine_with_penalties() -> None:
    logits = _logits(1, seed=6)
    metadata = SamplingMetadata.from_lists(
        [0.0], _VOCAB, logit_bias=[{5: 100.0, 9: 50.0}], allowed_token_ids=[[1, 5, 9]],
        banned_token_ids=[[5]], repetition_penalty=[2.0], output_token_ids=[[9]],
    )  # fmt: skip
    # 5 is banned despite its bias; 9 keeps its bias (penalized, still far above token 1).
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [9]
    only_outside = SamplingMetadata.from_lists(
        [0.0], _VOCAB, logit_bias=[{5: 100.0}], allowed_token_ids=[[1, 2]]
    )
    assert Sampler()(logits, only_outside).sampled_token_ids.item() in (1, 2)


def test_no_masks_no_bias_tensor() -> None:
    metadata = SamplingMetadata.from_lists(
        [1.0, 0.0], _VOCAB, logit_bias=[None, None], allowed_token_ids=[None, None],
        banned_token_ids=[[], []],
    )  # fmt: skip
    assert metadata.logit_bias is None and metadata.logit_bias_rows is None
    metadata = SamplingMetadata.from_lists(
        [1.0, 0.0, 1.0], _VOCAB, banned_token_ids=[[], [4], []], allowed_token_ids=[None, None, [2]]
    )
    assert metadata.logit_bias_rows.tolist() == [1, 2]
    assert metadata.logit_bias.shape == (2, _VOCAB)


def _seeded_tokens(logits_row: torch.Tensor, position: int, batch_size: int, steps: int) -> list:
    """Tokens of one seeded request placed at `position` in a batch of random neighbours."""
    generator = torch.Generator().manual_seed(42)
    tokens = []
    for step in range(steps):
        logits = _logits(batch_size, seed=100 + step + batch_size)
        logits[position] = logits_row
        temperature = [0.8] * batch_size
        temperature[0] = 0.0  # a greedy neighbour in the mix
        metadata = SamplingMetadata.from_lists(
            temperature, _VOCAB, top_k=[20] * batch_size, top_p=[0.95] * batch_size,
            generators={position: generator},
        )  # fmt: skip
        tokens.append(Sampler()(logits, metadata).sampled_token_ids[position].item())
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    row = _logits(1, seed=9)[0] / 3
    reference = _seeded_tokens(row, position=1, batch_size=2, steps=8)
    assert len(set(reference)) > 1  # really sampling, not collapsing to the argmax
    for position, batch_size in [(1, 5), (4, 5), (7, 16)]:
        torch.manual_seed(position)  # different unseeded draws for the neighbours
        assert _seeded_tokens(row, position, batch_size, steps=8) == reference


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(3)
    metadata = SamplingMetadata.from_lists(
        [0.0, 1.0, 0.5], _VOCAB, max_num_logprobs=4, repetition_penalty=[1.3] * 3,
        output_token_ids=[[1, 2], [3], []],
    )  # fmt: skip
    out = Sampler()(logits, metadata)
    logprobs = out.logprobs
    assert logprobs.token_ids.shape == (3, 5) and logprobs.logprobs.shape == (3, 5)
    expected = torch.log_softmax(logits, dim=-1)  # before penalties and temperature
    assert torch.equal(logprobs.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(logprobs.logprobs, expected.gather(1, logprobs.token_ids))
    assert torch.equal(logprobs.token_ids[:, 1:], expected.topk(4, dim=-1).indices)
    sampled_lp = expected.gather(1, out.sampled_token_ids[:, None])
    assert torch.equal(logprobs.sampled_token_ranks, (expected > sampled_lp).sum(-1) + 1)


def _processed(logits: torch.Tensor) -> torch.Tensor:
    """What rows 0-2 of test_logprobs_modes draw from: row 0 greedy (penalized logits, here
    none), row 1 at temperature 0.5 with top_k 3, row 2 at 1.0 with the token 5 banned."""
    rows = logits.clone()
    rows[1] = rows[1] / 0.5
    rows[1][rows[1] < rows[1].topk(3).values[-1]] = float("-inf")
    rows[2][5] = float("-inf")
    return rows


@pytest.mark.parametrize(
    "mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
)
def test_logprobs_modes_hold_vllms_values(mode) -> None:
    logits = _logits(3)
    metadata = SamplingMetadata.from_lists(
        [0.0, 0.5, 1.0], _VOCAB, top_k=[0, 3, 0], banned_token_ids=[[], [], [5]],
        max_num_logprobs=4,
    )  # fmt: skip
    out = Sampler(mode)(logits, metadata)
    values = logits if mode.startswith("raw") else _processed(logits)
    if mode.endswith("logprobs"):
        values = torch.log_softmax(values, dim=-1)
    logprobs = out.logprobs
    torch.testing.assert_close(logprobs.logprobs, values.gather(1, logprobs.token_ids))
    assert torch.equal(logprobs.token_ids[:, 1:], values.topk(4, dim=-1).indices)
    sampled = values.gather(1, out.sampled_token_ids[:, None])
    assert torch.equal(logprobs.sampled_token_ranks, (values > sampled).sum(-1) + 1)
    if mode.startswith("processed"):  # the draw's support: the rest ruled out
        assert logprobs.logprobs[1, -1] == float("-inf")  # 4th of row 1's top 3


def test_logprobs_off_and_zero() -> None:
    logits = _logits(2)
    off = SamplingMetadata.from_lists([0.0, 0.0], _VOCAB)
    assert Sampler()(logits, off).logprobs is None
    zero = SamplingMetadata.from_lists([0.0, 0.0], _VOCAB, max_num_logprobs=0)
    logprobs = Sampler()(logits, zero).logprobs
    assert logprobs.token_ids.shape == (2, 1)
    assert torch.equal(logprobs.sampled_token_ranks, torch.ones(2, dtype=torch.int64))


def test_from_lists_flags_and_validation() -> None:
    metadata = SamplingMetadata.from_lists([0.5], _VOCAB, top_k=[0], top_p=[1.0], min_p=[0.0])
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties and metadata.all_random
    with pytest.raises(ValueError, match="top_p has 1 entries for 2 requests"):
        SamplingMetadata.from_lists([0.5, 0.5], _VOCAB, top_p=[0.9])


@pytest.mark.gpu
def test_seeded_and_greedy_on_gpu() -> None:
    logits = _logits(8).cuda()
    tokens = []
    for position in (2, 5):
        generator = torch.Generator(device="cuda").manual_seed(7)
        temperature = [0.0] * 8
        temperature[position] = 1.0
        metadata = SamplingMetadata.from_lists(
            temperature, _VOCAB, "cuda", top_p=[0.9] * 8, generators={position: generator}
        )
        batch = logits.clone()
        batch[position] = logits[0]
        out = Sampler()(batch, metadata).sampled_token_ids
        greedy_rows = [r for r in range(8) if r != position]
        assert torch.equal(out[greedy_rows], batch[greedy_rows].argmax(-1))
        tokens.append(out[position].item())
    assert tokens[0] == tokens[1]


@pytest.mark.gpu
def test_logit_bias_and_masks_on_gpu_match_cpu() -> None:
    logits = _logits(4)
    lists = dict(
        logit_bias=[{3: 100.0}, None, None, {1: -5.0}],
        allowed_token_ids=[None, [4, 8, 9], None, None],
        banned_token_ids=[[], [8], [int(logits[2].argmax())], []],
    )
    cpu = SamplingMetadata.from_lists([0.0] * 4, _VOCAB, **lists)
    gpu = SamplingMetadata.from_lists([0.0] * 4, _VOCAB, "cuda", **lists)
    expected = Sampler()(logits, cpu).sampled_token_ids
    assert torch.equal(Sampler()(logits.cuda(), gpu).sampled_token_ids.cpu(), expected)
    assert expected[0] == 3 and expected[1] in (4, 9)
