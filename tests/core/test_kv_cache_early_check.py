"""A KV budget the user fixed is checked before any worker starts (issue 15): with
`kv_cache_memory_bytes` or `num_gpu_blocks_override` too small for one max_model_len request,
EngineCore raises the handshake's ValueError, naming the max_model_len that fits, in a second
instead of after loading and profiling; no worker is ever built. The spec it checks is the one
the workers report later, for every architecture and split over ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.model.checkpoints import make_checkpoint
from v1engine.core.engine_core import EngineCore
from v1engine.core.kv_cache_utils import estimate_max_model_len
from v1engine.engine_args import EngineArgs
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.executor.uniproc_executor import UniProcExecutor
from v1engine.worker.gpu_worker import Worker
from v1engine.worker.kv_cache import kv_cache_spec_from_config

RECORDING_WORKER = "tests.core.test_kv_cache_early_check.StartRecordingWorker"


class StartRecordingWorker(Worker):
    """The built-in worker, leaving a file in the model directory once it is built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        open(os.path.join(self.config.model_config.model, f"STARTED-{self.rank}"), "w").close()


def make_config(checkpoint: str, **kwargs: Any):
    args = dict(model=checkpoint, device="cpu", dtype="float32", max_model_len=256)
    return EngineArgs(**{**args, **kwargs}).create_engine_config()


# The llama preset at TP=2 holds 4 KiB per 16-token block and rank: one 256-token request
# needs 16 blocks and the null block.
@pytest.mark.parametrize(
    "budget", [{"kv_cache_memory_bytes": 32 << 10}, {"num_gpu_blocks_override": 5}]
)
def test_a_budget_too_small_fails_before_any_worker_starts(tmp_path, budget):
    checkpoint = make_checkpoint(tmp_path, "llama")
    config = make_config(checkpoint, tensor_parallel_size=2, worker_cls=RECORDING_WORKER, **budget)
    spec = kv_cache_spec_from_config(config)
    memory = budget.get("kv_cache_memory_bytes", 0)
    fits = estimate_max_model_len(config.cache_config, config.scheduler_config, spec, memory)
    assert 0 < fits < 256
    with pytest.raises(ValueError, match=rf"max_model_len=256\).*maximum model length is {fits}\."):
        EngineCore(config)
    assert not [name for name in os.listdir(checkpoint) if name.startswith("STARTED-")]


def test_a_budget_that_fits_starts_the_engine(tmp_path):
    checkpoint = make_checkpoint(tmp_path, "llama")
    # At TP=1 a block takes 8 KiB: 17 blocks hold one 256-token request and the null block.
    config = make_config(checkpoint, kv_cache_memory_bytes=136 << 10, worker_cls=RECORDING_WORKER)
    core = EngineCore(config)
    try:
        assert core.info.num_blocks == 17  # exactly one request and the null block
    finally:
        core.shutdown()
    assert os.path.exists(os.path.join(checkpoint, "STARTED-0"))


@pytest.mark.parametrize(
    "preset", ["llama", "llama_tied", "qwen2_hybrid", "qwen3", "mistral", "gemma3"]
)
def test_the_spec_from_the_config_is_what_a_worker_reports(tmp_path, preset):
    config = make_config(make_checkpoint(tmp_path, preset), distributed_executor_backend="uni")
    with UniProcExecutor(config) as executor:
        assert executor.get_kv_cache_specs() == [kv_cache_spec_from_config(config)]


@pytest.mark.parametrize("preset", ["qwen2_hybrid", "qwen3"])
def test_the_spec_from_the_config_is_what_each_rank_reports(tmp_path, preset):
    config = make_config(make_checkpoint(tmp_path, preset), tensor_parallel_size=2)
    spec = kv_cache_spec_from_config(config)
    assert all(s.num_kv_heads == 1 for s in spec.values())  # 2 KV heads over 2 ranks
    with MultiprocExecutor(config) as executor:
        assert executor.get_kv_cache_specs() == [spec, spec]
