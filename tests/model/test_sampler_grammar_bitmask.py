"""The grammar bitmask in the sampler: unpacked as xgrammar packs it, applied to its rows only,
after the raw logprobs and before logit bias, penalties and temperature, so a token the grammar
forbids is never sampled."""

from __future__ import annotations

import torch
import xgrammar as xgr

from v1engine.model.layers.sampler import Sampler, apply_grammar_bitmask
from v1engine.model.layers.sampling_metadata import SamplingMetadata

VOCAB_SIZE = 100  # not a multiple of 32: the last word has padding bits


def _packed(allowed: list[list[int]]) -> torch.Tensor:
    """xgrammar's layout, built by hand: token t is bit t % 32 of word t // 32."""
    bitmask = torch.zeros(len(allowed), (VOCAB_SIZE + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)
    # Bit 31 set makes a negative int32: the sign bit must unpack like any other.
    return torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)


def test_unpacks_like_xgrammar_including_the_sign_bit_and_padding() -> None:
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=generator)
    bitmask[1, 0] = -1  # every bit
    logits = torch.randn(5, VOCAB_SIZE, generator=generator)
    rows = torch.tensor([0, 2, 4])
    ours = apply_grammar_bitmask(logits, rows, bitmask)
    # xgrammar's indices address logits and bitmask rows alike: spread our rows out.
    full = torch.zeros(5, 4, dtype=torch.int32)
    full[rows] = bitmask
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, full, indices=rows.tolist())
    assert torch.equal(ours, reference)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # untouched rows
    assert not torch.equal(ours, logits)  # the caller's tensor stays as it was


def test_hand_packed_rows_allow_exactly_their_tokens() -> None:
    allowed = [[0, 31, 32, 63, 99], [5]]
    masked = apply_grammar_bitmask(
        torch.zeros(2, VOCAB_SIZE), torch.tensor([0, 1]), _packed(allowed)
    )
    for row, tokens in enumerate(allowed):
        assert torch.isfinite(masked[row]).nonzero().flatten().tolist() == tokens


def _metadata(temperature: list[float], **kwargs) -> SamplingMetadata:
    return SamplingMetadata.from_lists(temperature, VOCAB_SIZE, "cpu", **kwargs)


def test_forbidden_tokens_are_never_sampled_even_when_biased_or_hot() -> None:
    allowed = [[3, 40, 97], [64]]
    logits = torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(1))
    metadata = _metadata(
        [2.0, 0.0, 1.0],
        # A bias of +100 on a forbidden token cannot bring it back.
        logit_bias=[{5: 100.0}, {7: 100.0}, None],
        repetition_penalty=[1.5, 1.0, 1.0],
        prompt_token_ids=[[3, 5], [], []],
        output_token_ids=[[], [], []],
        grammar_bitmask=([0, 1], _packed(allowed)),
        max_num_logprobs=0,
    )
    sampler = Sampler()
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        output = sampler(logits, metadata)
        for row, token_id in enumerate(output.sampled_token_ids.tolist()):
            seen[row].add(token_id)
    assert seen[0] <= set(allowed[0]) and len(seen[0]) > 1
    assert seen[1] == {64}  # greedy within the grammar, not the unconstrained argmax
    assert len(seen[2]) > 3  # the unconstrained row samples freely
    # Raw logprobs describe the model: taken before the mask.
    raw = torch.log_softmax(logits, dim=-1)
    sampled = output.sampled_token_ids
    assert torch.allclose(output.logprobs.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])


def test_no_bitmask_rows_means_no_bitmask_stage() -> None:
    metadata = _metadata([0.0, 0.0], grammar_bitmask=([], torch.zeros(0, 4, dtype=torch.int32)))
    assert metadata.grammar_bitmask is None and metadata.grammar_bitmask_rows is None
