"""Workers against transformers: greedy tokens identical, logits close (float32, CPU).

Each case starts real worker processes (MultiprocExecutor, gloo), runs the KV cache handshake and
drives `execute_model` through `collective_rpc` with the real scheduler's SchedulerOutputs, mixing
chunked prefill, a cached prefix, late arrivals, a preemption, an unscheduled step and decodes
(see `worker_utils.run_mixed_scenario`). Tiny random checkpoints cover Llama (untied GQA, tied
MHA), Qwen2, Qwen3, Mistral (sliding window 8 < the sequences) and a hybrid Qwen2 (full +
sliding-window layers: two KV cache groups); the real SmolLM2-135M runs at TP=1 and TP=3. At TP=1
the greedy steps go through the LM head's bfloat16 screen, checked against the full logits.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import load_hf_model, make_checkpoint
from tests.worker.worker_utils import (
    check_parity_with_hf,
    executor_step,
    make_engine_config,
    make_prompts,
    make_request,
    make_scheduler,
    run_kv_cache_handshake,
    run_mixed_scenario,
    run_requests,
    screened_steps,
)
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.model.hf_config import default_model_path, prepare_checkpoint

# Float32 on CPU: only summation order differs from transformers (and across ranks).
TINY_ATOL = 1e-4
# 30 layers and a 49152-token vocabulary accumulate more rounding.
SMOLLM2_ATOL = 5e-4
ARCHS = ["llama", "llama_tied", "qwen2", "qwen3", "mistral", "qwen2_hybrid"]
ARCHS += ["gemma3", "smollm3", "granite", "qwen3_moe", "qwen2_moe", "mixtral", "phi3"]
ARCHS += ["olmo2", "gpt2", "phi", "gemma2", "starcoder2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("worker_parity")
    return {arch: make_checkpoint(root, arch) for arch in ARCHS}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batches_match_transformers(checkpoints, arch, tp):
    path = checkpoints[arch]
    executor = MultiprocExecutor(make_engine_config(path, tp))
    try:
        configs = run_kv_cache_handshake(executor)
        hf_model = load_hf_model(path)
        vocab_size = hf_model.config.vocab_size
        requests, record = run_mixed_scenario(executor_step(executor), configs[0], vocab_size)
        screened = executor.collective_rpc(screened_steps)
    finally:
        executor.shutdown()
    check_parity_with_hf(hf_model, requests, record, TINY_ATOL)
    check_greedy_screen_ran(screened, tp, lm_head_bias=arch == "phi")


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, torch.nn.Module]:
    """The converted SmolLM2 checkpoint (converted once, cached) and its transformers model."""
    checkpoint_dir = prepare_checkpoint(default_model_path())
    return checkpoint_dir, load_hf_model(checkpoint_dir)


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_matches_transformers(smollm2, tp):
    checkpoint_dir, hf_model = smollm2
    config = make_engine_config(
        default_model_path(), tp, max_model_len=128, kv_cache_memory_bytes=32 << 20
    )
    prompts = make_prompts(hf_model.config.vocab_size, [21, 6, 13])
    # 40 tokens hold every request; 12 blocks of 4 do not hold all three at once.
    max_model_len = 40
    requests = [
        make_request("long", prompts[0], max_model_len),
        make_request("short", prompts[1], max_model_len),
        # Shares the first 16 tokens (4 blocks) of "long", computed in the first two steps.
        make_request("prefix", prompts[0][:16] + prompts[2], max_model_len),
    ]
    executor = MultiprocExecutor(config)
    try:
        kv_cache_config = run_kv_cache_handshake(executor)[0]
        scheduler = make_scheduler(kv_cache_config, 12, 12, max_model_len)
        arrivals = {0: requests[:2], 2: requests[2:]}
        record = run_requests(scheduler, executor_step(executor), arrivals)
        screened = executor.collective_rpc(screened_steps)
    finally:
        executor.shutdown()
    events = {event for event, _ in record.events()}
    assert {"chunked_prefill", "prefix_hit", "preempted", "resumed"} <= events
    check_parity_with_hf(hf_model, requests, record, SMOLLM2_ATOL)
    check_greedy_screen_ran(screened, tp)


def check_greedy_screen_ran(screened: list[int], tp: int, lm_head_bias: bool = False) -> None:
    """One CPU rank samples its greedy steps of up to 4 requests through the bfloat16 screen of
    the float32 LM head (greedy_screen.py); with the vocabulary split over ranks none does, nor
    where the LM head adds a bias (Phi-2's), which the screen does not read."""
    if tp == 1 and not lm_head_bias:
        assert screened[0] > 0, "the greedy screen never sampled"
    else:
        assert screened == [0] * tp
