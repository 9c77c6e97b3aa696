"""Test doubles for the scheduler: a fake worker that sees only what a real one sees.

`FakeWorker` applies every `SchedulerOutput` with the real `RequestStates` (as `GPUModelRunner`
does) and then "computes" from the input batch rows alone: each scheduled token's KV goes into a
fake paged cache, at the slot the row's block table maps it to, as a key of the tokens 0..p.
Reading back every earlier position before sampling proves that block tables, prefix-cache hits
and preemption never hand a request someone else's KV or lose its own. Tokens come from
`token_fn(prompt and outputs)`, a pure function, so a request generates the same tokens however
it is scheduled.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.scheduler import Scheduler
from v1engine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from v1engine.lora.request import LoRARequest
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput
from v1engine.request import EngineCoreOutput, Request
from v1engine.sampling_params import SamplingParams
from v1engine.worker.request_states import InputBatch, RequestStates

VOCAB_SIZE = 97
EOS_TOKEN_ID = 2


def next_token(token_ids: list[int]) -> int:
    """The fake model: deterministic in the whole sequence so far."""
    return (31 * token_ids[-1] + 17 * len(token_ids) + 7) % VOCAB_SIZE


def make_kv_cache_config(num_blocks: int, block_size: int = 4, num_groups: int = 1):
    spec = FullAttentionSpec(block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec([f"layers.{g}"], spec) for g in range(num_groups)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 128,
    enable_prefix_caching: bool = True,
    num_groups: int = 1,
    policy: str = "fcfs",
    max_loras: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len, max_num_batched_tokens, max_num_seqs, policy=policy),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        make_kv_cache_config(num_blocks, block_size, num_groups),
        max_loras=max_loras,
    )


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_model_len: int = 128,
    eos_token_id: int | None = EOS_TOKEN_ID,
    priority: int = 0,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
    **sampling_kwargs,
) -> Request:
    sampling_kwargs.setdefault("max_tokens", 8)
    return Request(
        request_id,
        prompt_token_ids,
        SamplingParams(**sampling_kwargs),
        eos_token_id=eos_token_id,
        max_model_len=max_model_len,
        arrival_time=0.0,  # ties keep the order requests were added in
        priority=priority,
        cache_salt=cache_salt,
        lora_request=lora_request,
    )


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], str]:
    """What the request must generate, by the stop rules written out independently."""
    params, tokens, outputs = request.sampling_params, list(request.prompt_token_ids), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        outputs.append(token)
        is_eos = token == request.eos_token_id and request.eos_token_id is not None
        if (is_eos and not params.ignore_eos) or token in params.stop_token_ids:
            return outputs, "stop"
        max_tokens = params.max_tokens or max_model_len
        if len(outputs) >= max_tokens or len(tokens) >= max_model_len:
            return outputs, "length"


class FakeWorker:
    def __init__(
        self, states: RequestStates, token_fn: Callable[[list[int]], int] = next_token
    ) -> None:
        self.states = states
        self.token_fn = token_fn
        # Cache slot -> key of the token sequence whose last KV is stored there.
        self.kv: dict[int, int] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.states.update(scheduler_output)
        req_ids = list(self.states.input_batch.req_ids)
        sampled = [
            self._compute(row, scheduler_output.num_scheduled_tokens[req_id])
            for row, req_id in enumerate(req_ids)
        ]
        sampled = self.pick_tokens(scheduler_output, req_ids, sampled)
        self.states.append_sampled(req_ids, sampled)
        return ModelRunnerOutput(req_ids, sampled)

    def pick_tokens(
        self, scheduler_output: SchedulerOutput, req_ids: list[str], sampled: list[list[int]]
    ) -> list[list[int]]:
        """The tokens the worker samples (and appends): `token_fn`'s, unless a subclass picks."""
        return sampled

    def _compute(self, row: int, num_tokens: int) -> list[int]:
        batch = self.states.input_batch
        token_ids = batch.token_ids[row, : batch.num_tokens[row]].tolist()
        start = int(batch.num_computed_tokens[row])
        end = start + num_tokens
        assert 0 < num_tokens and end <= len(token_ids), "scheduled past known tokens"
        keys = _prefix_keys(token_ids[:end])
        for table in batch.block_tables:
            assert table.num_blocks[row] * table.block_size >= end, "no slot for a scheduled token"
            slots = table.slot_mapping(np.full(end, row), np.arange(end)).tolist()
            for pos in range(start, end):
                self.kv[slots[pos]] = keys[pos]
            # Attention reads every position up to the last: it must be this request's own KV.
            for pos in range(end):
                assert self.kv.get(slots[pos]) == keys[pos], pos
        if end < len(token_ids):
            return []  # a partial prefill chunk samples nothing
        return [self.token_fn(token_ids)]


def _prefix_keys(token_ids: list[int]) -> list[int]:
    keys, key = [], 0
    for token_id in token_ids:
        key = hash((key, token_id))
        keys.append(key)
    return keys


def assert_worker_mirrors_scheduler(
    scheduler: Scheduler, worker: FakeWorker, scheduler_output: SchedulerOutput
) -> None:
    """After the worker ran `scheduler_output` and the scheduler took its reply (with no other
    step in flight), the worker's state equals the scheduler's and its batch holds exactly the
    scheduled requests."""
    known = {r.request_id for r in scheduler.requests.values() if r.sent_to_workers}
    held = set(worker.states.requests)
    # The workers drop requests finished since this step with the next SchedulerOutput.
    assert known <= held and held - known <= scheduler.finished_req_ids
    assert sorted(worker.states.input_batch.req_ids) == sorted(
        scheduler_output.num_scheduled_tokens
    )
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests.get(req_id)
        if request is None:
            continue  # finished by this step: the next SchedulerOutput drops it
        state = worker.states.requests[req_id]
        assert state.all_token_ids == request.all_token_ids
        assert state.block_ids == list(scheduler.kv_cache_manager.get_block_ids(req_id))
        assert state.num_computed_tokens + num_tokens == request.num_computed_tokens


def step(
    scheduler: Scheduler, worker: FakeWorker
) -> tuple[SchedulerOutput, dict[str, EngineCoreOutput]]:
    """One engine step through the fake worker, checking the worker mirrors the scheduler."""
    scheduler_output = scheduler.schedule()
    model_runner_output = worker.execute_model(scheduler_output)
    outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
    assert_worker_mirrors_scheduler(scheduler, worker, scheduler_output)
    return scheduler_output, {out.request_id: out for out in outputs.outputs}


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker, max_steps: int = 500
) -> dict[str, tuple[list[int], str | None]]:
    """Steps to completion; returns every request's (output tokens, finish reason)."""
    results: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, worker)
        for req_id, out in outputs.items():
            tokens = results.get(req_id, ([], None))[0] + out.new_token_ids
            results[req_id] = (tokens, out.finish_reason and str(out.finish_reason))
    assert not scheduler.has_unfinished_requests(), "did not finish"
    return results


def assert_all_free(scheduler: Scheduler, worker: FakeWorker) -> None:
    """Every block is back, and the next SchedulerOutput lets the worker drop everything."""
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
    assert scheduler.kv_cache_manager.req_to_blocks == {}
    assert scheduler.make_stats().kv_cache_usage == 0.0
    worker.execute_model(scheduler.schedule())
    assert worker.states.requests == {} and worker.states.input_batch.num_reqs == 0


def make_worker(
    scheduler: Scheduler,
    token_fn: Callable[[list[int]], int] = next_token,
    worker_cls: type[FakeWorker] = FakeWorker,
) -> FakeWorker:
    """A worker whose batch has the scheduler's limits and one block table per KV cache group."""
    manager = scheduler.kv_cache_manager
    block_sizes = [manager.block_size] * manager.num_groups
    batch = InputBatch(scheduler.max_num_seqs, scheduler.max_model_len, block_sizes)
    return worker_cls(RequestStates(batch, generator_device="cpu"), token_fn)
