"""The workers' side of speculative decoding: n-gram drafts, and their verification in one step
(the scheduler's side: `core/spec_decode.py`).

Drafting (on the driver, after a step's tokens are appended): a request's drafts are the up to
`num_speculative_tokens` tokens that followed the earliest earlier occurrence of its last n
tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that occurs (vLLM's n-gram
prompt lookup; prompt and output alike are searched). They go to the scheduler with the step's
tokens and come back in the request's next step, written after its known tokens
(`RequestStates.update`), so that step computes its last known token and every draft at once.

Verification: the LM head reads the last known token and each draft, and each of those rows
samples as plain decoding would (the sampler, the request's parameters and generator). Draft i
is accepted iff the row before it sampled exactly it; the step emits the accepted drafts and the
token sampled at the first row whose draft was not (or at the last row, when all were). For a
drafter that proposes one token with certainty this is the rejection sampling of speculative
decoding (Leviathan et al., Chen et al., 2023): draft x is kept with probability p(x), and else
the token is distributed as p without x, renormalized. So every emitted token is distributed
exactly as without drafts, and greedy outputs are identical.

A row samples with what its prefix implies: penalties, min_tokens and bad words read the
request's output followed by the drafts before that row (`expand_rows`), and each emitted
token's logprobs are those of the row that sampled it (`emitted_rows`), and a request with a
grammar samples each row within the bitmask row the engine core sent for it (the core keeps
only drafts its grammar accepts: `core/spec_decode.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from v1engine.config import SpeculativeConfig
from v1engine.worker.model_inputs import has_masks, has_penalties
from v1engine.worker.request_states import CachedRequestState, InputBatch


def ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier occurrence of the last n of `tokens`,
    n the largest in [min_n, max_n] that occurs; [] when none does."""
    last = len(tokens) - 1
    if last < 1:
        return []
    # The positions j < last where a match of the sequence's last `length` tokens ends.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    length, best = 1, None
    while ends.size:
        if length >= min_n:
            best = int(ends[0])
        if length == max_n:
            break
        ends = ends[ends >= length]  # room for the match to grow by one token
        ends = ends[tokens[ends - length] == tokens[last - length]]
        length += 1
    if best is None:
        return []
    return tokens[best + 1 : best + 1 + k].tolist()


def propose_drafts(
    config: SpeculativeConfig,
    batch: InputBatch,
    num_rows: int,
    rows: list[int],
) -> list[list[int]]:
    """Per batch row (of `num_rows`), the drafts for its next step: [] for rows not in `rows`
    (those that sampled this step)."""
    drafts: list[list[int]] = [[] for _ in range(num_rows)]
    for row in rows:
        drafts[row] = ngram_drafts(
            batch.token_ids[row, : batch.num_tokens[row]],
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.num_speculative_tokens,
        )
    return drafts


def expand_rows(
    states: list[CachedRequestState],
    drafts: list[list[int]],
    grammar_bitmask: tuple[list[int], torch.Tensor] | None,
) -> tuple[list[CachedRequestState], tuple[list[int], torch.Tensor] | None]:
    """Per logits row, the request state it samples for (one row per sampling request and one
    more per draft, with the drafts before it: `after_drafts`), and the grammar bitmask's
    rows' logits rows (its rows are each structured request's, in order)."""
    counts = [len(request_drafts) + 1 for request_drafts in drafts]
    row_states = [
        after_drafts(state, request_drafts[:i])
        for state, request_drafts in zip(states, drafts)
        for i in range(len(request_drafts) + 1)
    ]
    if grammar_bitmask is not None:  # each structured request's rows, all of them
        rows, bitmask = grammar_bitmask
        first_rows = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
        logits_rows = [first_rows[row] + i for row in rows for i in range(counts[row])]
        grammar_bitmask = (logits_rows, bitmask)
    return row_states, grammar_bitmask


def after_drafts(state: CachedRequestState, drafts: list[int]) -> CachedRequestState:
    """The state a row after `drafts` samples from: its output followed by them, where the
    sampler reads the output (penalties, min_tokens, bad words); else the state itself."""
    params = state.sampling_params
    if not drafts or not (has_penalties(params) or has_masks(params)):
        return state
    return dataclasses.replace(state, output_token_ids=state.output_token_ids + drafts)


def emitted_tokens(drafts: list[list[int]], sampled: list[int]) -> list[list[int]]:
    """Per sampling request (its drafts; `sampled`: a token per logits row, the request's rows
    in order): the drafts accepted, each sampled by the row before it, up to the first that was
    not, then the token sampled at the row where that happened."""
    out, base = [], 0
    for request_drafts in drafts:
        num_accepted = 0
        while (
            num_accepted < len(request_drafts)
            and sampled[base + num_accepted] == request_drafts[num_accepted]
        ):
            num_accepted += 1
        out.append(request_drafts[:num_accepted] + [sampled[base + num_accepted]])
        base += len(request_drafts) + 1
    return out


def emitted_rows(drafts: list[list[int]], emitted: list[list[int]]) -> list[int]:
    """The logits rows that sampled the emitted tokens (`emitted_tokens`' result): a request's
    i-th emitted token is its i-th row's sample, the accepted drafts included."""
    rows, base = [], 0
    for request_drafts, tokens in zip(drafts, emitted, strict=True):
        rows.extend(range(base, base + len(tokens)))
        base += len(request_drafts) + 1
    return rows
