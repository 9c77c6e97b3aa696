"""CUDA graphs of the decode forward: one graph per padded batch size, replayed for decode steps.

On a GPU a small model's decode step is bound by the host, not the device: the eager forward
launches dozens of kernels per layer from Python (on an H100, SmolLM2-135M's bf16 decode step took
~29 ms at batch 1 and ~31 ms at batch 64, the GPU idle most of it). A graph captured once launches
the whole forward with one call. vLLM captures its decode batches the same way, by default. (On
the H100 the batch-1 step fell to 3.7 ms, ~2.3 of them waiting for the GPU to run the graph's
dozens of small kernels per layer: fusing the norms and the rotary embedding would shorten it.)

A graph replays fixed kernels on fixed addresses with fixed scalar arguments, so everything a
step varies lives in static buffers that the replay reads:
- `input_ids`, `positions`, `seq_lens` and, per KV cache group, `slot_mapping` and
  `block_table`, written before each replay; `query_start_loc` is `arange`: a decode-only step
  has one token per request, so a batch of B tokens is B requests whatever the step.
- A step of n requests replays the graph of the smallest captured size B >= n. Rows n .. B - 1
  are padding requests with no keys (`seq_len` 0: the attention kernel sees no key and writes 0)
  and slot -1 (nothing is written to the cache); their rows of the output are ignored.
- The attention launch is chosen for `max_seq_len = max_model_len`, the longest a replay may
  meet, so the key splits cover every request (a split past a short request's keys finds none).

The graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
Only steps whose every request computes one token replay; prefills and mixed steps run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from v1engine.kv_cache_interface import AttentionSpec
from v1engine.logger import init_logger
from v1engine.model.layers.attention_backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    set_forward_context,
)
from v1engine.utils import cdiv
from v1engine.worker.model_inputs import ModelInputs

logger = init_logger(__name__)

# Batch sizes captured (those up to max_num_seqs): fine steps while padding would cost the most
# relative to the batch, coarser ones above. A step past the largest runs eagerly.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Eager runs per size before its capture: Triton compiles and cuBLAS picks its kernels outside
# the capture (neither may happen inside one).
_WARM_UP_RUNS = 2

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def capture_sizes(max_num_reqs: int) -> list[int]:
    """The captured batch sizes for a scheduler that runs up to `max_num_reqs` requests."""
    sizes = [size for size in CAPTURE_SIZES if size <= max_num_reqs]
    return sizes or [1]


class DecodeInputBuffers:
    """The static inputs every graph reads, sized for the largest batch; `fill` writes a step's.

    Kept apart from the graphs so the padding itself runs (and is tested) anywhere."""

    def __init__(
        self,
        max_batch_size: int,
        max_model_len: int,
        kv_cache_group_specs: list[AttentionSpec],
        device: torch.device,
    ) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.max_model_len = max_model_len
        self.input_ids = zeros(max_batch_size, dtype=torch.int64)
        self.positions = zeros(max_batch_size, dtype=torch.int64)
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.seq_lens = zeros(max_batch_size, dtype=torch.int32)
        self.slot_mappings = [
            torch.full((max_batch_size,), -1, dtype=torch.int64, device=device)
            for _ in kv_cache_group_specs
        ]
        self.block_tables = [
            zeros(max_batch_size, cdiv(max_model_len, spec.block_size), dtype=torch.int32)
            for spec in kv_cache_group_specs
        ]

    def common_metadata(self, batch_size: int) -> list[CommonAttentionMetadata]:
        """Per group, views of the first `batch_size` rows: what a graph of that size reads."""
        return [
            CommonAttentionMetadata(
                slot_mapping=slot_mapping[:batch_size],
                query_start_loc=self.query_start_loc[: batch_size + 1],
                seq_lens=self.seq_lens[:batch_size],
                block_table=block_table[:batch_size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            for slot_mapping, block_table in zip(self.slot_mappings, self.block_tables)
        ]

    def fill(self, inputs: ModelInputs, batch_size: int) -> None:
        """Writes a decode step's n <= batch_size requests into rows 0 .. n - 1 and makes rows
        n .. batch_size - 1 padding (no keys, no cache write; their ids and positions are left
        as whatever valid values they hold)."""
        num_reqs = inputs.input_ids.shape[0]
        self.input_ids[:num_reqs].copy_(inputs.input_ids)
        self.positions[:num_reqs].copy_(inputs.positions)
        self.seq_lens[:num_reqs].copy_(inputs.common_metadata[0].seq_lens)  # shared by groups
        self.seq_lens[num_reqs:batch_size].zero_()
        for g, common in enumerate(inputs.common_metadata):
            self.slot_mappings[g][:num_reqs].copy_(common.slot_mapping)
            self.slot_mappings[g][num_reqs:batch_size].fill_(-1)
            width = common.block_table.shape[1]
            self.block_tables[g][:num_reqs, :width].copy_(common.block_table)


class DecodeCudaGraphs:
    """The decode forward captured at `capture_sizes(max_num_reqs)` batch sizes
    (`max_num_reqs`: the most requests a decode-only step can hold)."""

    def __init__(
        self,
        forward: Forward,
        attn_backend: AttentionBackend,
        kv_cache_group_specs: list[AttentionSpec],
        max_num_reqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.attn_backend = attn_backend
        self.kv_cache_group_specs = kv_cache_group_specs
        self.sizes = capture_sizes(max_num_reqs)
        self.buffers = DecodeInputBuffers(
            self.sizes[-1], max_model_len, kv_cache_group_specs, device
        )
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def capture(self) -> None:
        """Captures every size, largest first, into one shared memory pool. The buffers hold
        padding while capturing, so the warm-up runs write nothing into the KV cache."""
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.graphs[size], self.outputs[size] = self._capture_one(size, pool)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "Captured CUDA graphs of the decode forward for %d batch sizes (1 to %d) in %.2f s, "
            "%.1f MiB",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
            used / (1 << 20),
        )

    def _run_static(self, size: int) -> torch.Tensor:
        buffers = self.buffers
        attn_metadata = [
            self.attn_backend.build_metadata(common, spec)
            for common, spec in zip(buffers.common_metadata(size), self.kv_cache_group_specs)
        ]
        query_start_loc = buffers.query_start_loc[: size + 1]
        with set_forward_context(query_start_loc, self.attn_backend, attn_metadata):
            return self.forward(buffers.input_ids[:size], buffers.positions[:size])

    def _capture_one(self, size: int, pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream, as torch's capture docs ask (capture uses its own).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(_WARM_UP_RUNS):
                self._run_static(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self._run_static(size)
        return graph, output

    def fits(self, inputs: ModelInputs) -> bool:
        """Whether the step is decode-only (one token per request) and small enough to replay."""
        num_tokens = inputs.input_ids.shape[0]
        num_reqs = inputs.query_start_loc.shape[0] - 1
        return (
            inputs.common_metadata is not None
            and num_tokens == num_reqs
            and num_tokens <= self.sizes[-1]
        )

    def replay(self, inputs: ModelInputs) -> torch.Tensor:
        """The forward of a step that `fits`: [num_tokens, hidden_size], valid until the next
        replay (it lives in the graph's output buffer)."""
        num_tokens = inputs.input_ids.shape[0]
        size = next(size for size in self.sizes if size >= num_tokens)
        self.buffers.fill(inputs, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:num_tokens]
