"""From request states to the sampler's `SamplingMetadata`, and from its output to lists.

Only the driver (rank 0) samples. Penalties need every request's prompt and output tokens, so
those lists are passed only when some request in the batch turns a penalty on.
"""

from __future__ import annotations

import torch

from v1engine.model.layers.sampler import LogprobsTensors, SamplingMetadata
from v1engine.outputs import LogprobsLists
from v1engine.sampling_params import SamplingParams
from v1engine.worker.input_batch import CachedRequestState

# The profiling run samples with every stage on, so its memory peak covers the costliest step.
_PROFILE_NUM_LOGPROBS = 20


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """One row per state, in order; seeded requests bring their own generators."""
    params = [state.sampling_params for state in states]
    penalties = any(_has_penalties(p) for p in params)
    num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata.from_lists(
        temperature=[p.temperature for p in params],
        vocab_size=vocab_size,
        device=device,
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        prompt_token_ids=[s.prompt_token_ids for s in states] if penalties else None,
        output_token_ids=[s.output_token_ids for s in states] if penalties else None,
        generators={
            row: state.generator for row, state in enumerate(states) if state.generator is not None
        },
        max_num_logprobs=max(num_logprobs) if num_logprobs else None,
    )


def dummy_sampling_metadata(
    num_reqs: int, vocab_size: int, prompt_len: int, device: torch.device
) -> SamplingMetadata:
    """Random sampling with top-k, top-p, min-p, all penalties and logprobs, for profiling."""
    prompt = list(range(min(prompt_len, vocab_size)))
    return SamplingMetadata.from_lists(
        temperature=[1.0] * num_reqs,
        vocab_size=vocab_size,
        device=device,
        top_k=[max(1, vocab_size // 2)] * num_reqs,
        top_p=[0.9] * num_reqs,
        min_p=[0.01] * num_reqs,
        presence_penalty=[0.1] * num_reqs,
        frequency_penalty=[0.1] * num_reqs,
        repetition_penalty=[1.1] * num_reqs,
        prompt_token_ids=[prompt] * num_reqs,
        output_token_ids=[prompt[:1]] * num_reqs,
        max_num_logprobs=_PROFILE_NUM_LOGPROBS,
    )


def to_logprobs_lists(logprobs: LogprobsTensors | None) -> LogprobsLists | None:
    if logprobs is None:
        return None
    return LogprobsLists(
        token_ids=logprobs.token_ids.tolist(),
        logprobs=logprobs.logprobs.tolist(),
        sampled_token_ranks=logprobs.sampled_token_ranks.tolist(),
    )
