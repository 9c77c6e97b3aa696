"""Shared helpers for worker tests: configs, the KV cache handshake, functions that run inside
the workers through `collective_rpc`, and a parity check against transformers.

Functions taking `worker` first are module-level on purpose: `collective_rpc` imports them by name
in every worker process and calls `fn(worker, *args)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from tests.worker.toy_scheduler import ToyRequest, ToyScheduler
from v1engine.config import EngineConfig
from v1engine.core.kv_cache_utils import get_kv_cache_configs
from v1engine.engine_args import EngineArgs
from v1engine.executor.abstract import Executor
from v1engine.kv_cache_interface import KVCacheConfig
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput

KV_CACHE_BYTES = 4 << 20


def make_engine_config(model: str | None, tp: int = 1, **overrides: Any) -> EngineConfig:
    """A small CPU float32 config; `overrides` are EngineArgs fields."""
    args = dict(
        model=model,
        tensor_parallel_size=tp,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        block_size=4,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def run_kv_cache_handshake(executor: Executor) -> list[KVCacheConfig]:
    """specs -> available memory -> get_kv_cache_configs -> initialize_from_config (+ warm-up)."""
    config = executor.config
    specs = executor.get_kv_cache_specs()
    available = executor.determine_available_memory()
    configs = get_kv_cache_configs(config.cache_config, config.scheduler_config, specs, available)
    executor.initialize_from_config(configs)
    return configs


def make_scheduler(kv_cache_config: KVCacheConfig, token_budget: int = 10) -> ToyScheduler:
    block_sizes = [group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups]
    return ToyScheduler(block_sizes, kv_cache_config.num_blocks, token_budget)


# -- run inside the workers ---------------------------------------------------------------------
def execute_with_logits(
    worker: Any, scheduler_output: SchedulerOutput
) -> tuple[ModelRunnerOutput | None, torch.Tensor | None]:
    """`execute_model`, plus the logits the sampler saw ([num_sampled, vocab] on the CPU, or
    None when nothing sampled)."""
    model = worker.model_runner.model
    recorded: list[torch.Tensor] = []

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = type(model).compute_logits(model, hidden)
        recorded.append(logits.cpu().clone())
        return logits

    model.compute_logits = compute_logits
    try:
        output = worker.execute_model(scheduler_output)
    finally:
        del model.compute_logits
    return output, (recorded[0] if recorded else None)


def num_known_requests(worker: Any) -> tuple[int, int]:
    """(requests with state, rows in the input batch)."""
    runner = worker.model_runner
    return len(runner.requests), runner.input_batch.num_reqs


def kv_cache_layout(worker: Any) -> dict[str, tuple]:
    """Per layer: key shape, value shape, dtype, K and V data pointers, and whether the
    attention layer holds exactly the runner's cache tensors."""
    runner = worker.model_runner
    layout = {}
    for name, (key, value) in runner.kv_caches.items():
        bound = runner.attn_layers[name].kv_cache
        is_bound = bound is not None and bound[0] is key and bound[1] is value
        layout[name] = (
            tuple(key.shape),
            tuple(value.shape),
            key.dtype,
            key.data_ptr(),
            value.data_ptr(),
            is_bound,
        )
    return layout


def rss_bytes(worker: Any) -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def memory_profile(worker: Any) -> Any:
    return worker.memory_profile


def worker_threads(worker: Any) -> tuple[int, list[int], str]:
    return torch.get_num_threads(), sorted(os.sched_getaffinity(0)), str(worker.device)


# -- driving and checking ----------------------------------------------------------------------
StepFn = Callable[[SchedulerOutput], tuple[ModelRunnerOutput, torch.Tensor | None]]


def executor_step(executor: Executor) -> StepFn:
    def step(scheduler_output: SchedulerOutput):
        return executor.collective_rpc(
            execute_with_logits, args=(scheduler_output,), unique_reply_rank=0
        )

    return step


def run_requests(
    scheduler: ToyScheduler,
    step: StepFn,
    arrivals: dict[int, list[ToyRequest]] | None = None,
    preempt: dict[int, str] | None = None,
    pause: dict[int, str] | None = None,
    max_steps: int = 200,
) -> int:
    """Steps until every request finished, then flushes; returns the number of steps.

    `arrivals`, `preempt` and `pause` are keyed by step index: requests added before that step,
    a running request preempted before it, a running request left unscheduled in it.
    """
    arrivals, preempt, pause = arrivals or {}, preempt or {}, pause or {}
    num_steps = 0
    while scheduler.has_unfinished() or any(i >= num_steps for i in arrivals):
        assert num_steps < max_steps, "requests did not finish"
        for request in arrivals.get(num_steps, []):
            scheduler.add(request)
        if num_steps in preempt:
            scheduler.preempt(preempt[num_steps])
        if num_steps in pause:
            scheduler.paused.add(pause[num_steps])
        scheduler_output = scheduler.schedule()
        result, logits = step(scheduler_output)
        scheduler.update(scheduler_output, result, logits)
        num_steps += 1
    result, logits = step(scheduler.flush())
    assert result.req_ids == [] and logits is None
    return num_steps


def make_prompts(vocab_size: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def mixed_scenario(vocab_size: int) -> tuple[list[ToyRequest], dict, dict, dict]:
    """Requests and events covering chunked prefill, a cached prefix, a late arrival, a
    preemption with recomputation and an unscheduled step, with decodes mixed in throughout.

    Returns: (all requests, arrivals, preempt, pause) for `run_requests` (token budget 10).
    """
    a, b, c, e = make_prompts(vocab_size, [11, 5, 17, 3])
    extra = make_prompts(vocab_size, [4], seed=1)[0]
    req_a = ToyRequest("a", a)
    req_b = ToyRequest("b", b)
    req_c = ToyRequest("c", c)  # 17 tokens over a budget of 10: chunked
    # Shares a's first 8 tokens (2 blocks of 4), which a computed in step 0.
    req_d = ToyRequest("d", a[:8] + extra, num_cached_tokens=8, prefix_from="a")
    req_e = ToyRequest("e", e)
    arrivals = {0: [req_a, req_b, req_c], 2: [req_d], 4: [req_e]}
    return [req_a, req_b, req_c, req_d, req_e], arrivals, {3: "b"}, {5: "c"}


def check_parity_with_hf(hf_model: torch.nn.Module, requests: list[ToyRequest], atol: float):
    """Every sampled token is transformers' greedy choice, and the logits it was sampled from
    match transformers' at that position within `atol`."""
    for request in requests:
        ids = torch.tensor([request.tokens[:-1]])
        with torch.no_grad():
            expected = hf_model(ids).logits[0, len(request.prompt) - 1 :].float()
        ours = torch.stack(request.logits)
        torch.testing.assert_close(ours, expected, atol=atol, rtol=0, msg=request.req_id)
        assert request.output == expected.argmax(-1).tolist(), request.req_id
