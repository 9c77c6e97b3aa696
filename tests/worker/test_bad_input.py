"""Bad models and configs fail with a clear error, before or during worker start-up, and leave
no process, shared memory or ipc directory behind (the autouse leak check)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.timeouts import failed_start_limit
from tests.worker.worker_utils import make_engine_config
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.executor.uniproc_executor import UniProcExecutor
from v1engine.worker.gpu_worker import check_dtype_supported


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bad_input")


def _start_fails(config, match: str, error: type[Exception] = RuntimeError) -> str:
    start = time.monotonic()
    with pytest.raises(error, match=match) as info:
        MultiprocExecutor(config)
    assert time.monotonic() - start < failed_start_limit()
    return str(info.value)


def test_unknown_architecture_names_the_supported_ones(root):
    path = make_checkpoint(root, "llama", name="unknown_arch")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    hf_config["architectures"] = ["FancyNewForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(hf_config, f)
    # Caught by the worker's init_device today; an engine-side check may catch it earlier.
    with pytest.raises((ValueError, RuntimeError)) as info:
        MultiprocExecutor(make_engine_config(path, 1))
    text = str(info.value)
    assert "'FancyNewForCausalLM' is not supported" in text
    assert "LlamaForCausalLM" in text and "Qwen3ForCausalLM" in text


def test_heads_not_divisible_by_tensor_parallel_size(root):
    path = make_checkpoint(root, "llama", name="four_heads")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit") as info:
        make_engine_config(path, 3)
    assert "num_attention_heads=4" in str(info.value) and "[1, 2" in str(info.value)


def test_missing_weight_file_carries_the_worker_traceback(root):
    path = make_checkpoint(root, "llama", name="no_weights")
    os.remove(os.path.join(path, "model.safetensors"))
    text = _start_fails(make_engine_config(path, 2), "failed to start")
    assert "no model.safetensors" in text and "Traceback" in text


def test_missing_shard_is_named(root):
    path = make_checkpoint(root, "llama", name="sharded", max_shard_size="40KB")
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(os.path.join(path, shards[-1]))
    text = _start_fails(make_engine_config(path, 1), "failed to start")
    assert shards[-1] in text and "incomplete" in text


def test_builtin_worker_refuses_model_none():
    # A bad configuration: a ValueError, whether the worker runs in another process or here.
    text = _start_fails(make_engine_config(None, 2), "failed to start", ValueError)
    assert "needs a model" in text and "worker_cls" in text and "Traceback" in text
    with pytest.raises(ValueError, match="needs a model"):
        UniProcExecutor(make_engine_config(None))


def test_dtype_the_device_cannot_compute_in(monkeypatch):
    def no_half_matmul(self, other):
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    check_dtype_supported(torch.float32, torch.device("cpu"))
    monkeypatch.setattr(torch.Tensor, "__matmul__", no_half_matmul)
    with pytest.raises(ValueError, match="dtype=float16 cannot run matmuls on cpu") as info:
        check_dtype_supported(torch.float16, torch.device("cpu"))
    assert "dtype='float32'" in str(info.value)
