"""The CUDA path of the worker: device placement, NCCL, memory profiling and parity on a GPU.
Skipped without CUDA (see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import load_hf_model, make_checkpoint
from tests.worker.worker_utils import (
    check_parity_with_hf,
    executor_step,
    make_engine_config,
    memory_profile,
    run_kv_cache_handshake,
    run_mixed_scenario,
)
from v1engine.executor.multiproc_executor import MultiprocExecutor

pytestmark = pytest.mark.gpu

# GPU float32 matmuls may use TF32-like reductions and a different summation order.
GPU_ATOL = 2e-3


def placement(worker) -> dict:
    import torch.distributed as dist

    runner = worker.model_runner
    key, _ = next(iter(runner.kv_caches.values()))
    return {
        "device": str(worker.device),
        "param_device": str(next(runner.model.parameters()).device),
        "kv_device": str(key.device),
        "backend": dist.get_backend(),
    }


def graph_replays(worker) -> int | None:
    graphs = worker.model_runner.cuda_graphs
    return None if graphs is None else graphs.num_replays


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("gpu"), "llama")


def test_cuda_worker_places_everything_on_its_device_with_nccl(llama_path):
    config = make_engine_config(llama_path, device="cuda", kv_cache_memory_bytes=16 << 20)
    executor = MultiprocExecutor(config)
    try:
        kv_cache_config = run_kv_cache_handshake(executor)[0]
        [where] = executor.collective_rpc(placement)
        hf_model = load_hf_model(llama_path)
        vocab_size = hf_model.config.vocab_size
        requests, record = run_mixed_scenario(executor_step(executor), kv_cache_config, vocab_size)
        [replays] = executor.collective_rpc(graph_replays)
    finally:
        executor.shutdown()
    # The decode-only steps replayed the captured CUDA graphs (padded to 1, 2, 4 or 8 requests);
    # the parity check below covers their tokens and logits.
    assert replays is not None and replays > 0
    assert where == {
        "device": "cuda:0",
        "param_device": "cuda:0",
        "kv_device": "cuda:0",
        "backend": "nccl",
    }
    check_parity_with_hf(hf_model, requests, record, GPU_ATOL)


def test_enforce_eager_captures_no_cuda_graphs(llama_path):
    config = make_engine_config(
        llama_path, device="cuda", kv_cache_memory_bytes=16 << 20, enforce_eager=True
    )
    executor = MultiprocExecutor(config)
    try:
        run_kv_cache_handshake(executor)
        assert executor.collective_rpc(graph_replays) == [None]
    finally:
        executor.shutdown()


def test_cuda_memory_profile(llama_path):
    config = make_engine_config(
        llama_path, device="cuda", kv_cache_memory_bytes=None, gpu_memory_utilization=0.5
    )
    executor = MultiprocExecutor(config)
    try:
        [available] = executor.determine_available_memory()
        [profile] = executor.collective_rpc(memory_profile)
    finally:
        executor.shutdown()
    total = torch.cuda.mem_get_info(0)[1]
    assert profile.total_bytes == total
    assert profile.budget_bytes == int(total * 0.5)
    assert profile.weights_bytes > 0 and profile.activation_peak_bytes > 0
    assert 0 < available == profile.available_kv_bytes < profile.budget_bytes
