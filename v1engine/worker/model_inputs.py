"""What one step's forward and sampler read: flat model inputs, built from the input batch with
numpy and copied to the device, and the sampler's `SamplingMetadata` from the request states.

Request r (batch row r) computes tokens `num_computed_tokens[r] .. + query_lens[r] - 1` of its
token row. Flattened in row order, token i belongs to row `req_indices[i]` at `positions[i]`; a
KV cache group g maps it to slot `block_tables[g][row, pos // block_size] * block_size +
pos % block_size`. Only the slot mapping and block table differ between groups; query_start_loc
and seq_lens are shared. Each group's `CommonAttentionMetadata` goes to the attention backend,
which builds the metadata its layers read. A request samples iff this step reaches the end of its
token row; otherwise it is a partial prefill chunk and its logits are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.model.layers.attention_backend import AttentionBackend, CommonAttentionMetadata
from v1engine.model.layers.sampler import LogprobsTensors
from v1engine.model.layers.sampling_metadata import SamplingMetadata
from v1engine.outputs import LogprobsLists, SchedulerOutput
from v1engine.sampling_params import SamplingParams
from v1engine.utils import cdiv
from v1engine.worker.request_states import BlockTable, CachedRequestState, InputBatch


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    # Per KV cache group, built by the attention backend; None: no KV cache (profiling).
    attn_metadata: list[Any] | None
    # Per KV cache group, what the backend built attn_metadata from (the CUDA graphs copy it
    # into their static buffers); None with attn_metadata.
    common_metadata: list[CommonAttentionMetadata] | None
    # [num_logits] int64: the flat index of each sampling request's last token (with drafts to
    # verify, of its last known token and each draft, in order).
    logits_indices: torch.Tensor
    # Batch rows that sample this step, in row order (each has a row of logits_indices, and
    # one more per draft it verifies).
    sampling_rows: list[int]


@dataclass(frozen=True)
class StepLayout:
    """Where a step's flat tokens come from, on the host."""

    query_start_loc: np.ndarray  # [num_reqs + 1] prefix sums of the query lengths
    seq_lens: np.ndarray  # [num_reqs] tokens in the KV cache after the step
    req_indices: np.ndarray  # [num_tokens] each token's batch row
    positions: np.ndarray  # [num_tokens] each token's position in its request
    max_query_len: int


def step_layout(num_computed_tokens: np.ndarray, query_lens: np.ndarray) -> StepLayout:
    """The layout of rows computing `query_lens[r]` tokens after `num_computed_tokens[r]`."""
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    req_indices = np.repeat(np.arange(len(query_lens)), query_lens)
    offsets = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1], query_lens)
    num_computed = num_computed_tokens.astype(np.int64)
    positions = num_computed[req_indices] + offsets
    seq_lens = num_computed + query_lens
    return StepLayout(query_start_loc, seq_lens, req_indices, positions, int(query_lens.max()))


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # One host -> device copy per tensor; on CPU no copy at all beyond the dtype cast.
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def build_common_attn_metadata(
    block_tables: list[BlockTable],
    layout: StepLayout,
    query_start_loc: torch.Tensor,
    device: torch.device,
) -> list[CommonAttentionMetadata]:
    """Per KV cache group: its slot mapping and block table, with the step's shared layout
    (`query_start_loc` is the layout's, already on the device)."""
    num_reqs = layout.seq_lens.shape[0]
    seq_lens = _to_device(layout.seq_lens, torch.int32, device)
    max_seq_len = int(layout.seq_lens.max())
    per_group = []
    for table in block_tables:
        # Only the blocks the longest request reaches; the rest of the row is never read.
        width = max(1, cdiv(max_seq_len, table.block_size))
        slot_mapping = table.slot_mapping(layout.req_indices, layout.positions)
        per_group.append(
            CommonAttentionMetadata(
                slot_mapping=_to_device(slot_mapping, torch.int64, device),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_table=_to_device(table.table[:num_reqs, :width], torch.int32, device),
                max_query_len=layout.max_query_len,
                max_seq_len=max_seq_len,
            )
        )
    return per_group


def build_attn_metadata(
    attn_backend: AttentionBackend,
    kv_cache_group_specs: list[AttentionSpec],
    per_group: list[CommonAttentionMetadata],
) -> list[Any] | None:
    """The backend's metadata for each group (None without groups: an attention-free model)."""
    if not per_group:
        return None
    return [
        attn_backend.build_metadata(common, spec)
        for common, spec in zip(per_group, kv_cache_group_specs, strict=True)
    ]


def _check_known_tokens(batch: InputBatch, seq_lens: np.ndarray, num_tokens: np.ndarray) -> None:
    if np.any(seq_lens > num_tokens):
        row = int(np.argmax(seq_lens > num_tokens))
        raise RuntimeError(
            f"request {batch.req_ids[row]!r} is scheduled up to token {int(seq_lens[row])} but "
            f"the workers know only {int(num_tokens[row])} of its tokens; a request is scheduled "
            "past its prompt only by the tokens the workers sampled for it"
        )


def build_model_inputs(
    batch: InputBatch,
    query_lens: np.ndarray,
    attn_backend: AttentionBackend,
    kv_cache_group_specs: list[AttentionSpec],
    device: torch.device,
    num_drafts: np.ndarray | None = None,
) -> ModelInputs:
    """Inputs for the batch's rows (at least one), each computing `query_lens[row]` new tokens.

    `kv_cache_group_specs[g]` is the spec of KV cache group g (`batch.block_tables[g]`);
    `num_drafts[row]`: the drafted tokens written after the row's known tokens, which the step
    computes and verifies (worker/spec_decode.py).

    Raises:
        RuntimeError: a request is scheduled past the end of its known tokens.
    """
    num_reqs = batch.num_reqs
    layout = step_layout(batch.num_computed_tokens[:num_reqs], query_lens)
    num_tokens = batch.num_tokens[:num_reqs]
    if num_drafts is not None:
        num_tokens = num_tokens + num_drafts
    _check_known_tokens(batch, layout.seq_lens, num_tokens)
    input_ids = batch.token_ids[layout.req_indices, layout.positions]  # [num_tokens]
    sampling_rows = np.flatnonzero(layout.seq_lens == num_tokens)
    logits_indices = layout.query_start_loc[1:][sampling_rows] - 1
    if num_drafts is not None:  # the last 1 + num_drafts tokens of each sampling row
        counts = num_drafts[sampling_rows] + 1
        ends = np.repeat(logits_indices + 1, counts)  # one past each row's last token
        logits_indices = ends - (np.repeat(np.cumsum(counts), counts) - np.arange(counts.sum()))
    query_start_loc = _to_device(layout.query_start_loc, torch.int32, device)
    per_group = build_common_attn_metadata(batch.block_tables, layout, query_start_loc, device)
    return ModelInputs(
        input_ids=_to_device(input_ids, torch.int64, device),
        positions=_to_device(layout.positions, torch.int64, device),
        query_start_loc=query_start_loc,
        attn_metadata=build_attn_metadata(attn_backend, kv_cache_group_specs, per_group),
        common_metadata=per_group or None,
        logits_indices=_to_device(logits_indices, torch.int64, device),
        sampling_rows=sampling_rows.tolist(),
    )


# A profiling step cut to a token limit keeps requests at least this long: 128 one-token
# requests made the CPU profile twice as slow (an attention call each) and its sampler 18x.
PROFILE_MIN_QUERY_LEN = 16


def profile_query_lens(
    max_num_tokens: int, max_num_reqs: int, max_model_len: int, token_limit: int | None
) -> tuple[list[int], list[int]]:
    """The query lengths of the largest step the scheduler may send (`max_num_tokens` spread
    evenly over up to `max_num_reqs` requests, none longer than max_model_len), and of the step
    a profile runs for it: the same, or under `token_limit` at most that many tokens in
    requests of at least PROFILE_MIN_QUERY_LEN tokens."""
    num_tokens = min(max_num_tokens, max_num_reqs * max_model_len)
    query_lens = _spread(num_tokens, min(max_num_reqs, num_tokens))
    if token_limit is None or sum(query_lens) <= token_limit:
        return query_lens, query_lens
    num_reqs = min(len(query_lens), max(1, token_limit // PROFILE_MIN_QUERY_LEN))
    num_reqs = max(num_reqs, cdiv(token_limit, max_model_len))  # none too long
    return query_lens, _spread(token_limit, num_reqs)


def _spread(num_tokens: int, num_reqs: int) -> list[int]:
    """`num_tokens` split as evenly as possible over `num_reqs` requests."""
    base, extra = divmod(num_tokens, num_reqs)
    return [base + (1 if i < extra else 0) for i in range(num_reqs)]


def build_dummy_model_inputs(
    query_lens: list[int],
    attn_backend: AttentionBackend,
    kv_cache_group_specs: list[AttentionSpec],
    device: torch.device,
) -> ModelInputs:
    """A profiling or warm-up batch of fresh sequences (token id 0) in which every request
    samples. Its metadata (one per group; None without groups) writes no KV cache: every slot is
    -1, every block table entry is block 0 and each row has one entry per token, so a bound
    cache of any block size is read in range and nothing in it changes."""
    lens = np.asarray(query_lens, dtype=np.int64)
    layout = step_layout(np.zeros_like(lens), lens)
    query_start_loc = _to_device(layout.query_start_loc, torch.int32, device)
    common = CommonAttentionMetadata(
        slot_mapping=torch.full((int(lens.sum()),), -1, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc,
        seq_lens=_to_device(lens, torch.int32, device),
        block_table=torch.zeros(len(lens), layout.max_query_len, dtype=torch.int32, device=device),
        max_query_len=layout.max_query_len,
        max_seq_len=layout.max_query_len,
    )
    per_group = [common] * len(kv_cache_group_specs)
    positions = _to_device(layout.positions, torch.int64, device)
    return ModelInputs(
        input_ids=torch.zeros_like(positions),
        positions=positions,
        query_start_loc=query_start_loc,
        attn_metadata=build_attn_metadata(attn_backend, kv_cache_group_specs, per_group),
        common_metadata=per_group or None,
        logits_indices=query_start_loc[1:].long() - 1,
        sampling_rows=list(range(len(query_lens))),
    )


# -- the sampler's inputs --------------------------------------------------------------------------
# From request states to the sampler's `SamplingMetadata`, and from its output to lists.
#
# Only the driver (rank 0) samples. Penalties need every request's prompt and output tokens, so
# those lists are passed only when some request in the batch turns a penalty on; likewise the
# logit-bias and mask lists only when some request uses logit_bias, allowed_token_ids, bad words
# or min_tokens.
#
# The profiling run samples with every stage on (logprobs at the engine's max_logprobs), so its
# memory peak covers the costliest step.
_PROFILE_NUM_ALLOWED = 20


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def has_masks(params: SamplingParams) -> bool:
    uses_masks = params.logit_bias or params.allowed_token_ids or params._bad_words_token_ids
    return params.min_tokens > 0 or bool(uses_masks)


def banned_token_ids(state: CachedRequestState, vocab_size: int) -> list[int]:
    """Tokens the request must not sample next: EOS (unless ignored) and its stop tokens while
    the output is shorter than min_tokens, and the last token of each bad word whose other
    tokens end the output so far (a one-token bad word always)."""
    params, output = state.sampling_params, state.output_token_ids
    banned = []
    if len(output) < params.min_tokens:
        banned += params.stop_token_ids
        if not params.ignore_eos and params._eos_token_id is not None:
            banned.append(params._eos_token_id)
    for word in params._bad_words_token_ids or []:
        prefix_len = len(word) - 1
        if prefix_len <= len(output) and output[len(output) - prefix_len :] == word[:-1]:
            banned.append(word[-1])
    # A stop token id outside the vocabulary can never be sampled anyway.
    return [t for t in banned if 0 <= t < vocab_size]


def grammar_bitmask_rows(
    sampling_req_ids: list[str], scheduler_output: SchedulerOutput
) -> tuple[list[int], torch.Tensor] | None:
    """The step's grammar bitmask for the sampler: (sampling rows it constrains, their rows of
    the bitmask, in that order: one per row, and under speculative decoding one more per draft
    the request verifies, after its first), or None when no sampling request has a grammar.

    Raises:
        RuntimeError: the scheduler sent a bitmask row for a request that does not sample.
    """
    row_of = scheduler_output.structured_output_request_ids
    if scheduler_output.grammar_bitmask is None:
        return None
    pairs = [(row, row_of[r]) for row, r in enumerate(sampling_req_ids) if r in row_of]
    if len(pairs) != len(row_of):
        raise RuntimeError(
            f"the scheduler sent grammar bitmask rows for {sorted(row_of)} but only "
            f"{sorted(set(row_of) & set(sampling_req_ids))} sample this step"
        )
    drafts = scheduler_output.scheduled_spec_decode_tokens
    bitmask_rows = [
        first + i
        for row, first in pairs
        for i in range(1 + len(drafts.get(sampling_req_ids[row], ())))
    ]
    bitmask = scheduler_output.grammar_bitmask[bitmask_rows]
    return [row for row, _ in pairs], torch.from_numpy(bitmask)


def build_sampling_metadata(
    states: list[CachedRequestState],
    vocab_size: int,
    device: torch.device,
    grammar_bitmask: tuple[list[int], torch.Tensor] | None = None,
) -> SamplingMetadata:
    """One row per state, in order; seeded requests bring their own generators;
    `grammar_bitmask` from `grammar_bitmask_rows`."""
    params = [state.sampling_params for state in states]
    penalties = any(has_penalties(p) for p in params)
    masks = any(has_masks(p) for p in params)
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
        logit_bias=[p.logit_bias for p in params] if masks else None,
        allowed_token_ids=[p.allowed_token_ids for p in params] if masks else None,
        banned_token_ids=[banned_token_ids(s, vocab_size) for s in states] if masks else None,
        generators={
            row: state.generator for row, state in enumerate(states) if state.generator is not None
        },
        max_num_logprobs=max(num_logprobs) if num_logprobs else None,
        grammar_bitmask=grammar_bitmask,
    )


def dummy_sampling_metadata(
    num_reqs: int, vocab_size: int, prompt_len: int, max_logprobs: int, device: torch.device
) -> SamplingMetadata:
    """Random sampling with every stage on (a grammar bitmask, logit bias and masks over all
    rows, top-k, top-p, min-p, all penalties and `max_logprobs` logprobs, -1: every token's),
    for profiling."""
    prompt = list(range(min(prompt_len, vocab_size)))
    # A few allowed tokens are enough: the mask's [num_reqs, vocab_size] tensor is the cost.
    allowed = list(range(min(vocab_size, _PROFILE_NUM_ALLOWED)))
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
        logit_bias=[{allowed[0]: 1.0}] * num_reqs,
        allowed_token_ids=[allowed] * num_reqs,
        banned_token_ids=[allowed[1:2]] * num_reqs,
        max_num_logprobs=vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size),
        # Every bit set: every token allowed.
        grammar_bitmask=(
            list(range(num_reqs)),
            torch.full((num_reqs, cdiv(vocab_size, 32)), -1, dtype=torch.int32),
        ),
    )


def to_logprobs_lists(logprobs: LogprobsTensors | None) -> LogprobsLists | None:
    if logprobs is None:
        return None
    return LogprobsLists(
        token_ids=logprobs.token_ids.tolist(),
        logprobs=logprobs.logprobs.tolist(),
        sampled_token_ranks=logprobs.sampled_token_ranks.tolist(),
    )
