"""Prompt logprobs (`SamplingParams.prompt_logprobs`): how likely the model found each prompt token.

The hidden state at prompt position p gives the logits that predict token p + 1, so a prompt of P
tokens has P - 1 scored positions, 0 .. P - 2; the last position's logits predict the first
output token (the sampled row, not a prompt logprob). A step scores the positions it runs: with
chunked prefill a chunk's last position scores the first token of the next chunk, which the
worker already holds (the whole prompt arrives with the request).

The worker's request states remember, per request that asks, how many positions are scored
(`RequestStates.prompt_logprobs`), so a request preempted and recomputed never scores a
position twice; `plan_prompt_logprobs` finds the rows of this step. `compute_prompt_logprobs`
then runs the LM head and log_softmax over those rows only, `slice_rows` at a time, so a long
prompt never holds a [num_prompt_tokens, vocab] tensor.

Tensor parallelism: the LM head all-gathers the vocabulary shards, so every rank must call it for
the same rows in the same order; every rank applies the same SchedulerOutputs, so their plans
agree. Only the driver computes and returns the logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from v1engine.model.layers.sampler import LogprobsTensors, gather_logprobs
from v1engine.outputs import LogprobsLists
from v1engine.worker.request_states import InputBatch, PromptProgress

# Rows of logits per LM-head call: 256 x vocab fp32 plus its log_softmax stays well under what
# the profiling run's sampler holds for max_num_seqs rows (sort, penalties, probabilities).
PROMPT_LOGPROBS_SLICE_ROWS = 256


@dataclass
class PromptLogprobsPlan:
    """This step's prompt rows: per request, consecutive rows in prompt order."""

    req_ids: list[str]
    num_rows: list[int]
    num_logprobs: list[int]
    token_indices: torch.Tensor  # [num_rows] int64: each row's index among the step's tokens
    next_token_ids: torch.Tensor  # [num_rows] int64: the prompt token each row scores


def plan_prompt_logprobs(
    progress: dict[str, PromptProgress],
    batch: InputBatch,
    query_lens: np.ndarray,
    device: torch.device,
) -> PromptLogprobsPlan | None:
    """The rows to score this step (None: none), marked scored in `progress`, which drops the
    requests now fully scored. Call once per step, after the batch holds the step's requests.

    Raises:
        RuntimeError: a request that asks starts past a position it has not scored yet (the
            scheduler served it from the prefix cache).
    """
    query_starts = np.cumsum(query_lens) - query_lens
    steps = [
        _step_rows(req_id, request, batch, query_lens, query_starts)
        for req_id, request in progress.items()
    ]
    steps = [step for step in steps if step is not None]
    for req_id in [r for r, p in progress.items() if p.num_scored >= p.num_prompt_tokens - 1]:
        del progress[req_id]
    if not steps:
        return None
    req_ids, num_logprobs, indices, next_tokens = zip(*steps)
    return PromptLogprobsPlan(
        req_ids=list(req_ids),
        num_rows=[len(i) for i in indices],
        num_logprobs=list(num_logprobs),
        token_indices=torch.from_numpy(np.concatenate(indices)).to(device),
        next_token_ids=torch.from_numpy(np.concatenate(next_tokens)).to(device, torch.int64),
    )


def _step_rows(
    req_id: str,
    progress: PromptProgress,
    batch: InputBatch,
    query_lens: np.ndarray,
    query_starts: np.ndarray,
) -> tuple[str, int, np.ndarray, np.ndarray] | None:
    """`(req_id, k, token indices, next prompt tokens)` of the positions the request scores this
    step, marked scored; None when it scores none (not scheduled, or past its prompt)."""
    row = batch.req_id_to_index.get(req_id)
    if row is None:
        return None
    start = int(batch.num_computed_tokens[row])
    _check_not_skipped(req_id, start, progress.num_scored)
    first = max(start, progress.num_scored)
    end = min(start + int(query_lens[row]), progress.num_prompt_tokens - 1)
    if first >= end:
        return None
    progress.num_scored = end
    indices = np.arange(first, end) - start + query_starts[row]
    return req_id, progress.num_logprobs, indices, batch.token_ids[row, first + 1 : end + 1]


def _check_not_skipped(req_id: str, start: int, num_scored: int) -> None:
    if start > num_scored:
        raise RuntimeError(
            f"request {req_id!r} asks for prompt logprobs but starts at token {start} with only "
            f"{num_scored} prompt positions scored; the scheduler must not serve such a request "
            "from the prefix cache"
        )


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    plan: PromptLogprobsPlan,
    is_driver: bool,
    slice_rows: int = PROMPT_LOGPROBS_SLICE_ROWS,
    as_logits: bool = False,
) -> dict[str, LogprobsLists]:
    """Per request of `plan`, its rows' logprobs: column 0 the prompt token scored (with its
    rank), then its top k. `hidden_states`: [num_tokens, hidden_size], the step's. Every rank
    calls `compute_logits` alike; only the driver gets results ({} elsewhere). `as_logits`:
    the logits themselves (a "*_logits" logprobs_mode; a prompt token is never sampled, so
    "processed" is "raw" here, as in vLLM)."""
    max_k = max(plan.num_logprobs)
    slices: list[LogprobsTensors] = []
    for start in range(0, plan.token_indices.shape[0], slice_rows):
        token_indices = plan.token_indices[start : start + slice_rows]
        logits = compute_logits(hidden_states[token_indices])  # [<= slice_rows, vocab] fp32
        if is_driver:
            logprobs = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
            next_token_ids = plan.next_token_ids[start : start + slice_rows]
            slices.append(gather_logprobs(logprobs, max_k, next_token_ids))
    if not is_driver:
        return {}
    return _split_by_request(plan, slices)


def _split_by_request(
    plan: PromptLogprobsPlan, slices: list[LogprobsTensors]
) -> dict[str, LogprobsLists]:
    token_ids = torch.cat([s.token_ids for s in slices]).tolist()
    logprobs = torch.cat([s.logprobs for s in slices]).tolist()
    ranks = torch.cat([s.sampled_token_ranks for s in slices]).tolist()
    out, start = {}, 0
    for req_id, num_rows, k in zip(plan.req_ids, plan.num_rows, plan.num_logprobs):
        rows = slice(start, start + num_rows)
        out[req_id] = LogprobsLists(
            token_ids=[row[: 1 + k] for row in token_ids[rows]],
            logprobs=[row[: 1 + k] for row in logprobs[rows]],
            sampled_token_ranks=ranks[rows],
        )
        start += num_rows
    return out
