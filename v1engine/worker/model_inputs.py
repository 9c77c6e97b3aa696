"""One step's flat model inputs, built from the input batch with numpy and copied to the device.

Request r (batch row r) computes tokens `num_computed_tokens[r] .. + query_lens[r] - 1` of its
token row. Flattened in row order, token i belongs to row `req_indices[i]` at `positions[i]`; a
KV cache group g maps it to slot `block_tables[g][row, pos // block_size] * block_size +
pos % block_size`. Only the slot mapping and block table differ between groups; query_start_loc
and seq_lens are shared. A request samples iff this step reaches the end of its token row;
otherwise it is a partial prefill chunk and its logits are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from v1engine.model.layers.attention_metadata import AttentionMetadata
from v1engine.worker.input_batch import BlockTable, InputBatch


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    # One metadata for a single KV cache group, else one per layer name (None: no KV cache).
    attn_metadata: AttentionMetadata | dict[str, AttentionMetadata] | None
    # [num_sampling_reqs] int64: the flat index of each sampling request's last token.
    logits_indices: torch.Tensor
    # Batch rows that sample this step, in row order (rows of logits_indices).
    sampling_rows: list[int]


def _to_device(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # One host -> device copy per tensor; on CPU no copy at all beyond the dtype cast.
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def query_layout(query_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query_start_loc [num_reqs + 1], req_indices [num_tokens], offsets [num_tokens]):
    prefix sums of the query lengths, and each flat token's row and index within its query."""
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    req_indices = np.repeat(np.arange(len(query_lens)), query_lens)
    offsets = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1], query_lens)
    return query_start_loc, req_indices, offsets


def _group_metadata(
    table: BlockTable,
    req_indices: np.ndarray,
    positions: np.ndarray,
    shared: dict,
    max_seq_len: int,
    device: torch.device,
) -> AttentionMetadata:
    num_reqs = shared["seq_lens"].shape[0]
    # Only the blocks the longest request reaches; the rest of the row is never read.
    width = max(1, -(-max_seq_len // table.block_size))
    return AttentionMetadata(
        slot_mapping=_to_device(table.slot_mapping(req_indices, positions), torch.int64, device),
        block_table=_to_device(table.table[:num_reqs, :width], torch.int32, device),
        max_seq_len=max_seq_len,
        **shared,
    )


def _attention_metadata(
    batch: InputBatch,
    query_lens: np.ndarray,
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    group_layer_names: list[list[str]],
    device: torch.device,
) -> AttentionMetadata | dict[str, AttentionMetadata] | None:
    """One metadata per KV cache group, keyed by layer name when there are several."""
    shared = dict(
        query_start_loc=_to_device(query_start_loc, torch.int32, device),
        seq_lens=_to_device(seq_lens, torch.int32, device),
        max_query_len=int(query_lens.max()),
    )
    max_seq_len = int(seq_lens.max())
    per_group = [
        _group_metadata(table, req_indices, positions, shared, max_seq_len, device)
        for table in batch.block_tables
    ]
    if len(per_group) <= 1:
        return per_group[0] if per_group else None  # None: an attention-free model
    return {
        name: metadata for names, metadata in zip(group_layer_names, per_group) for name in names
    }


def _check_known_tokens(batch: InputBatch, seq_lens: np.ndarray, num_tokens: np.ndarray) -> None:
    if np.any(seq_lens > num_tokens):
        row = int(np.argmax(seq_lens > num_tokens))
        raise RuntimeError(
            f"request {batch.req_ids[row]!r} is scheduled up to token {int(seq_lens[row])} but "
            f"the workers know only {int(num_tokens[row])} of its tokens; the scheduler must "
            "send every sampled token in new_token_ids before scheduling past it"
        )


def build_model_inputs(
    batch: InputBatch,
    query_lens: np.ndarray,
    group_layer_names: list[list[str]],
    device: torch.device,
) -> ModelInputs:
    """Inputs for the batch's rows (at least one), each computing `query_lens[row]` new tokens.

    `group_layer_names[g]` are the attention layers that read KV cache group g.

    Raises:
        RuntimeError: a request is scheduled past the end of its known tokens.
    """
    num_reqs = batch.num_reqs
    num_computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
    seq_lens = num_computed + query_lens  # [num_reqs]
    num_tokens = batch.num_tokens[:num_reqs]
    _check_known_tokens(batch, seq_lens, num_tokens)
    query_start_loc, req_indices, offsets = query_layout(query_lens)
    positions = num_computed[req_indices] + offsets  # [num_tokens]
    input_ids = batch.token_ids[req_indices, positions]  # [num_tokens]
    sampling_rows = np.flatnonzero(seq_lens == num_tokens)
    attn_metadata = _attention_metadata(
        batch,
        query_lens,
        query_start_loc,
        seq_lens,
        req_indices,
        positions,
        group_layer_names,
        device,
    )
    return ModelInputs(
        input_ids=_to_device(input_ids, torch.int64, device),
        positions=_to_device(positions, torch.int64, device),
        attn_metadata=attn_metadata,
        logits_indices=_to_device(query_start_loc[1:][sampling_rows] - 1, torch.int64, device),
        sampling_rows=sampling_rows.tolist(),
    )


def dummy_attention_metadata(
    query_lens: list[int], device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a profiling or warm-up batch of fresh sequences that writes no KV cache
    (every slot is -1), and the positions [num_tokens] of its tokens.

    Every block table entry is block 0 and each row has one entry per token, so a bound cache of
    any block size is read in range and nothing in it changes.
    """
    lens = np.asarray(query_lens, dtype=np.int64)
    query_start_loc, _, offsets = query_layout(lens)
    max_query_len = int(lens.max())
    metadata = AttentionMetadata(
        slot_mapping=torch.full((int(lens.sum()),), -1, dtype=torch.int64, device=device),
        query_start_loc=_to_device(query_start_loc, torch.int32, device),
        seq_lens=_to_device(lens, torch.int32, device),
        block_table=torch.zeros(len(lens), max_query_len, dtype=torch.int32, device=device),
        max_query_len=max_query_len,
        max_seq_len=max_query_len,
    )
    return metadata, _to_device(offsets, torch.int64, device)
