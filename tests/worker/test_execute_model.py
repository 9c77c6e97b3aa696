"""execute_model semantics on two CPU ranks, driven by the real scheduler: who replies, partial
chunks, seeded sampling across batches, preemption and an unscheduled step, logprobs, penalties,
and what happens to finished or unknown requests."""

from __future__ import annotations

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.worker.worker_utils import (
    executor_step,
    make_engine_config,
    make_prompts,
    make_request,
    make_scheduler,
    num_known_requests,
    run_kv_cache_handshake,
    run_requests,
)
from v1engine.executor.errors import WorkerError
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.executor.uniproc_executor import UniProcExecutor
from v1engine.outputs import CachedRequestData, SchedulerOutput

VOCAB_SIZE = 131


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("execute"), "llama")


@pytest.fixture(scope="module")
def tp2(llama_path):
    executor = MultiprocExecutor(make_engine_config(llama_path, 2))
    try:
        kv_cache_config = run_kv_cache_handshake(executor)[0]
        yield executor, kv_cache_config
    finally:
        executor.shutdown()


def test_only_rank_0_replies_and_partial_chunks_sample_nothing(tp2):
    executor, kv_cache_config = tp2
    scheduler = make_scheduler(kv_cache_config, token_budget=10)
    request = make_request("chunked", make_prompts(VOCAB_SIZE, [17])[0])
    steps = []

    def step(scheduler_output):
        outputs = executor.collective_rpc("execute_model", args=(scheduler_output,))
        assert len(outputs) == 2 and outputs[1] is None
        steps.append(outputs[0].sampled_token_ids)
        return outputs[0], None

    run_requests(scheduler, step, {0: [request]})
    assert steps[0] == [[]]  # the first 10 of 17 prompt tokens: nothing sampled
    assert steps[-1] == []  # the flush step only reports the finished request
    assert all(len(s) == 1 and len(s[0]) == 1 for s in steps[1:-1])
    assert executor.collective_rpc(num_known_requests) == [(0, 0), (0, 0)]


def _run(executor, kv_cache_config, requests, budgets=None, num_blocks_per_group=None):
    """One request arrives per step; the scheduler's budget is 8 tokens."""
    scheduler = make_scheduler(kv_cache_config, 8, num_blocks_per_group)
    arrivals = {i: [r] for i, r in enumerate(requests)}
    return run_requests(scheduler, executor_step(executor), arrivals, budgets)


def test_seeded_sampling_ignores_batch_and_preemption(tp2):
    executor, kv_cache_config = tp2
    prompt, *others = make_prompts(VOCAB_SIZE, [7, 12, 5, 9], seed=3)

    def seeded(req_id: str, seed: int):
        return make_request(req_id, prompt, temperature=1.5, top_p=0.95, seed=seed, max_tokens=8)

    alone = seeded("alone", 7)
    _run(executor, kv_cache_config, [alone])
    crowded = seeded("crowded", 7)
    noise = [
        make_request(f"noise{i}", p, temperature=1.0, max_tokens=6) for i, p in enumerate(others)
    ]
    # 9 blocks run out, so "crowded", the newest, is preempted after sampling twice and resumes;
    # a budget of 1 in step 4 leaves it unscheduled.
    record = _run(
        executor,
        kv_cache_config,
        [noise[0], noise[1], crowded, noise[2]],
        budgets={4: 1},
        num_blocks_per_group=9,
    )
    events = {event for event, req_id in record.events() if req_id == "crowded"}
    assert {"chunked_prefill", "preempted", "resumed", "unscheduled"} <= events
    other_seed = seeded("other_seed", 8)
    _run(executor, kv_cache_config, [other_seed])
    assert crowded.output_token_ids == alone.output_token_ids
    assert other_seed.output_token_ids != alone.output_token_ids


def test_logprobs_describe_the_raw_logits(tp2):
    executor, kv_cache_config = tp2
    request = make_request("logprobs", make_prompts(VOCAB_SIZE, [6])[0], logprobs=3, max_tokens=4)
    record = _run(executor, kv_cache_config, [request])
    output, all_logprobs = request.output_token_ids, record.logprobs["logprobs"]
    assert len(all_logprobs) == len(output) == 4
    for token, logits, (token_ids, logprobs, rank) in zip(
        output, record.logits["logprobs"], all_logprobs
    ):
        expected = torch.log_softmax(logits, dim=-1)
        assert token_ids[0] == token and rank == 1  # greedy picks the most likely token
        assert token_ids[1:] == expected.topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(logprobs), expected[token_ids], atol=1e-5, rtol=0)


def _penalized_argmax(logits, prompt, output, params) -> int:
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0])
    seen = counts > 0
    seen[prompt] = True
    penalty = params.repetition_penalty
    logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return int(logits.argmax())


def test_penalties_use_prompt_and_output_tokens(tp2):
    executor, kv_cache_config = tp2
    prompt = make_prompts(VOCAB_SIZE, [10])[0]
    request = make_request(
        "penalized",
        prompt,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        max_tokens=6,
    )
    params = request.sampling_params
    record = _run(executor, kv_cache_config, [request])
    output = request.output_token_ids
    for i, (token, logits) in enumerate(zip(output, record.logits["penalized"])):
        assert token == _penalized_argmax(logits, prompt, output[:i], params)


def test_unknown_request_is_a_clear_error_and_changes_nothing(tp2):
    executor, _ = tp2
    ghost = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["ghost"], [False], [None], [3]),
        num_scheduled_tokens={"ghost": 1},
        total_num_scheduled_tokens=1,
    )
    with pytest.raises(WorkerError, match="'ghost'") as info:
        executor.execute_model(ghost)
    assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
    assert executor.collective_rpc(num_known_requests) == [(0, 0), (0, 0)]


def test_execute_before_initialize_from_config(llama_path):
    executor = UniProcExecutor(make_engine_config(llama_path))
    try:
        with pytest.raises(WorkerError, match="initialize_from_config"):
            executor.execute_model(SchedulerOutput())
    finally:
        executor.shutdown()
