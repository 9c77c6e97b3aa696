"""The CUDA graphs' static decode inputs (worker/cuda_graphs.py).

The padding is checked here on the CPU, with the Triton kernels the graphs capture run under the
interpreter: a step padded into a graph's buffers must attend and write the cache exactly as the
step alone does. Capturing and replaying graphs needs a GPU: tests/worker/test_gpu_worker.py
drives the real scheduler through the captured graphs and checks every token against
transformers.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.model.paged_batch import BlockAllocator, attention_spec, build_metadata
from tests.worker.worker_utils import make_engine_config, run_kv_cache_handshake
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.model.layers import triton_attention as ta
from v1engine.worker.cuda_graphs import DecodeInputBuffers, capture_sizes
from v1engine.worker.model_inputs import ModelInputs

_BLOCK_SIZE, _NUM_KV_HEADS, _HEAD_SIZE, _NUM_HEADS = 4, 2, 16, 4
_MAX_MODEL_LEN = 64


def test_capture_sizes_stop_at_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
    assert capture_sizes(256)[-1] == 256 and capture_sizes(10_000)[-1] == 256


def _decode_inputs(allocator: BlockAllocator, seq_lens: list[int]) -> ModelInputs:
    """A decode step: request r computes its token seq_lens[r] - 1."""
    common = build_metadata(allocator, [(r, n - 1, 1) for r, n in enumerate(seq_lens)])
    num_reqs = len(seq_lens)
    return ModelInputs(
        input_ids=torch.arange(100, 100 + num_reqs),
        positions=torch.tensor(seq_lens) - 1,
        query_start_loc=common.query_start_loc,
        attn_metadata=[common],
        common_metadata=[common],
        logits_indices=torch.arange(num_reqs),
        sampling_rows=list(range(num_reqs)),
    )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton runs CPU tensors only with TRITON_INTERPRET=1 (a GPU runs the graphs)",
)
def test_padded_decode_step_attends_and_writes_like_the_step_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    cache_shape = (40, _BLOCK_SIZE, _NUM_KV_HEADS, _HEAD_SIZE)
    key_cache, value_cache = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape)
    spec = attention_spec(key_cache)
    allocator = BlockAllocator(cache_shape[0], _BLOCK_SIZE, seed=1)
    buffers = DecodeInputBuffers(8, _MAX_MODEL_LEN, [spec], torch.device("cpu"))
    # A larger step first leaves real requests in rows 3..5, which must become padding.
    buffers.fill(_decode_inputs(allocator, [9, 30, 3, 17, 5, 22]), 8)
    inputs = _decode_inputs(allocator, [13, 1, 40])
    buffers.fill(inputs, 4)

    [step] = inputs.common_metadata
    [padded] = buffers.common_metadata(4)
    assert padded.seq_lens.tolist() == [13, 1, 40, 0]
    assert padded.slot_mapping.tolist() == step.slot_mapping.tolist() + [-1]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(padded.block_table[:3, : step.block_table.shape[1]], step.block_table)
    assert buffers.input_ids[:3].tolist() == [100, 101, 102]
    assert buffers.positions[:3].tolist() == [12, 0, 39]
    assert padded.max_seq_len == _MAX_MODEL_LEN  # the launch covers any request a replay meets

    query = torch.randn(4, _NUM_HEADS, _HEAD_SIZE, generator=gen)
    key, value = torch.randn(2, 4, _NUM_KV_HEADS, _HEAD_SIZE, generator=gen)
    results = []
    for metadata, num_rows in ((step, 3), (padded, 4)):
        caches = key_cache.clone(), value_cache.clone()
        ta.write_kv_cache(key[:num_rows], value[:num_rows], *caches, metadata.slot_mapping)
        q = query[:num_rows]
        config = ta._choose_launch_config(q, caches[0], metadata)
        if metadata is padded:
            # A GPU splits a long max_seq_len's keys: most splits of short requests (and all
            # of a padding request's) find no key, which the merge must weigh as nothing.
            config = dataclasses.replace(config, num_kv_splits=8)
        out = ta._paged_attention(q, *caches, metadata, _HEAD_SIZE**-0.5, None, config)
        results.append((out, caches))
    (out, caches), (padded_out, padded_caches) = results
    # The padded launch splits the keys: the same math summed in another order.
    torch.testing.assert_close(padded_out[:3], out, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(padded_out[3]) == 0  # a padding request sees no key
    assert all(torch.equal(a, b) for a, b in zip(padded_caches, caches))  # and writes nothing


def _capture_and_report(worker) -> bool:
    worker.model_runner.capture_cuda_graphs()
    return worker.model_runner.cuda_graphs is not None


def test_a_backend_that_reads_metadata_on_the_host_is_never_captured(tmp_path) -> None:
    # The CPU and torch backends read their metadata on the host, so a graph would bake in the
    # capture's values: the runner declines (on any device) rather than capture them.
    config = make_engine_config(make_checkpoint(tmp_path, "llama"))
    executor = MultiprocExecutor(config)
    try:
        run_kv_cache_handshake(executor)
        assert executor.collective_rpc(_capture_and_report) == [False]
    finally:
        executor.shutdown()
