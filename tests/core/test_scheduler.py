"""Scheduler: FCFS, chunked prefill, preemption, aborts, stops, prefix caching, worker diffs.

Every test drives the real SchedulerOutput -> ModelRunnerOutput loop through `FakeWorker`, which
rebuilds requests from the diffs alone and checks each request reads only its own KV.
"""

from __future__ import annotations

import msgspec
import pytest

from tests.core.fake_worker import (
    assert_all_free,
    make_request,
    make_scheduler,
    make_worker,
    reference_output,
    run_to_completion,
    step,
)
from v1engine.outputs import LogprobsLists, ModelRunnerOutput
from v1engine.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Request,
    RequestStatus,
)
from v1engine.sampling_params import SamplingParams


def test_fcfs_admission_and_completion() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", [i + 10] * (3 + i), ignore_eos=True) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    scheduler_output, outputs = step(scheduler, worker := make_worker(scheduler))
    assert [new.req_id for new in scheduler_output.scheduled_new_reqs] == ["r0", "r1", "r2", "r3"]
    assert scheduler_output.num_scheduled_tokens == {"r0": 3, "r1": 4, "r2": 5, "r3": 6}
    assert all(len(out.new_token_ids) == 1 for out in outputs.values())
    run_to_completion(scheduler, worker)
    for request in requests:
        outcome = (request.output_token_ids, str(request.get_finish_reason()))
        assert outcome == reference_output(request, 128)
    assert_all_free(scheduler, worker)


def test_head_of_queue_is_never_overtaken() -> None:
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)  # 4 usable blocks
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("big0", list(range(12)), max_tokens=2))  # 3 blocks
    scheduler.add_request(make_request("big1", list(range(20, 28)), max_tokens=2))  # 2 blocks
    scheduler.add_request(make_request("small", [50], max_tokens=2))  # 1 block would fit
    scheduler_output, _ = step(scheduler, worker)
    assert list(scheduler_output.num_scheduled_tokens) == ["big0"]
    assert [r.request_id for r in scheduler.waiting] == ["big1", "small"]
    run_to_completion(scheduler, worker)
    assert_all_free(scheduler, worker)


def test_budget_chunks_a_long_prompt_and_mixes_in_decodes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=10, ignore_eos=True))
    scheduler_output, outputs = step(scheduler, worker)
    assert scheduler_output.num_scheduled_tokens == {"a": 3} and "a" in outputs
    scheduler.add_request(make_request("b", list(range(30, 50)), ignore_eos=True))  # 20 tokens
    chunks = []
    for expected_b in (7, 7, 6):
        scheduler_output, outputs = step(scheduler, worker)
        assert scheduler_output.num_scheduled_tokens == {"a": 1, "b": expected_b}
        assert scheduler_output.total_num_scheduled_tokens == 1 + expected_b
        # "a" computes the token it sampled last step, which the worker appended itself.
        assert "a" in scheduler_output.scheduled_cached_reqs.req_ids
        chunks.append("b" in outputs)
    assert chunks == [False, False, True]  # only the last chunk samples
    b = scheduler.requests["b"]
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1
    run_to_completion(scheduler, worker)
    assert_all_free(scheduler, worker)


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    worker = make_worker(scheduler)
    for i, max_tokens in enumerate([1, 3, 3]):
        scheduler.add_request(make_request(f"r{i}", [i + 5] * 4, max_tokens=max_tokens))
    scheduler_output, outputs = step(scheduler, worker)
    assert set(scheduler_output.num_scheduled_tokens) == {"r0", "r1"}
    assert outputs["r0"].finish_reason == FinishReason.LENGTH
    scheduler_output, _ = step(scheduler, worker)
    assert scheduler_output.finished_req_ids == {"r0"}
    assert set(scheduler_output.num_scheduled_tokens) == {"r1", "r2"}
    assert scheduler.make_stats().num_running_reqs == 2
    run_to_completion(scheduler, worker)
    assert_all_free(scheduler, worker)


def test_preempts_the_newest_and_resumes_it_with_its_whole_table() -> None:
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks of 4 tokens
    worker = make_worker(scheduler)
    a = make_request("a", [1, 2, 3, 4], max_tokens=6, ignore_eos=True)
    b = make_request("b", [5, 6, 7, 8], max_tokens=8, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(5):  # both compute tokens 0-7 in 2 blocks each: the pool is full
        scheduler_output, _ = step(scheduler, worker)
        assert set(scheduler_output.num_scheduled_tokens) == {"a", "b"}
    scheduler_output, outputs = step(scheduler, worker)  # a needs a 3rd block: b goes
    assert scheduler_output.num_scheduled_tokens == {"a": 1}
    assert scheduler_output.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and scheduler.make_stats().num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("b") == ([],)
    assert outputs["a"].finish_reason == FinishReason.LENGTH and "b" not in outputs
    scheduler_output, _ = step(scheduler, worker)
    cached = scheduler_output.scheduled_cached_reqs
    assert scheduler_output.finished_req_ids == {"a"} and cached.req_ids == ["b"]
    assert cached.resumed_from_preemption == [True]
    assert cached.new_block_ids[0] == scheduler.kv_cache_manager.get_block_ids("b")
    assert len(cached.new_block_ids[0][0]) == 3  # 9 tokens: the whole table, hits included
    # Its first block was still cached (a's new block evicted its second): the rest is recomputed.
    assert cached.num_computed_tokens == [4] and scheduler_output.num_scheduled_tokens == {"b": 5}
    # No token is sent back: the worker kept the ones it sampled for b (step() checks it holds
    # exactly b's tokens, the one it just sampled on its own recomputation included).
    run_to_completion(scheduler, worker)
    assert (b.output_token_ids, str(b.get_finish_reason())) == reference_output(b, 128)
    assert_all_free(scheduler, worker)


def test_a_request_may_preempt_itself() -> None:
    scheduler = make_scheduler(num_blocks=5)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", list(range(7)), max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("b", list(range(10, 18)), max_tokens=3, ignore_eos=True))
    step(scheduler, worker)  # 2 + 2 blocks
    scheduler_output, _ = step(scheduler, worker)  # a fits its block; b needs a 3rd: itself
    assert scheduler_output.num_scheduled_tokens == {"a": 1}
    assert scheduler_output.preempted_req_ids == {"b"} and scheduler.running == [
        scheduler.requests["a"]
    ]
    run_to_completion(scheduler, worker)
    assert_all_free(scheduler, worker)


def test_aborts_free_every_block_and_reach_the_workers() -> None:
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=16)
    worker = make_worker(scheduler)
    for name, prompt in [("run", [1] * 8), ("pre", [2] * 6), ("wait", [3] * 12)]:
        scheduler.add_request(make_request(name, prompt, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        step(scheduler, worker)
    assert scheduler.requests["pre"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["wait"].status == RequestStatus.WAITING
    scheduler.finish_requests(["run", "pre", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    scheduler.finish_requests("run", RequestStatus.FINISHED_ABORTED)  # again: ignored
    assert not scheduler.has_unfinished_requests()
    scheduler_output = scheduler.schedule()
    assert scheduler_output.finished_req_ids == {"run", "pre", "wait"}
    worker.execute_model(scheduler_output)
    assert worker.states.requests == {}
    assert_all_free(scheduler, worker)


def test_an_abort_between_schedule_and_update_is_ignored() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", [1, 2, 3]))
    scheduler.add_request(make_request("b", [4, 5, 6]))
    scheduler_output = scheduler.schedule()
    model_runner_output = worker.execute_model(scheduler_output)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
    assert [out.request_id for out in outputs.outputs] == ["b"]
    assert scheduler.schedule().finished_req_ids == {"a"}


def _scripted(script: list[int]):
    """A model that emits `script` in order, whatever the tokens."""
    return lambda token_ids: script[len(token_ids) - 4]  # prompts here are 4 tokens long


@pytest.mark.parametrize(
    ("kwargs", "eos", "expected", "reason", "stop_reason"),
    [
        ({}, 2, [5, 6, 2], "stop", None),  # EOS
        ({"ignore_eos": True}, 2, [5, 6, 2, 7, 8], "length", None),  # max_tokens=5
        ({}, None, [5, 6, 2, 7, 8], "length", None),  # no EOS token at all
        ({"stop_token_ids": [6]}, 2, [5, 6], "stop", 6),
        ({"stop_token_ids": [7], "ignore_eos": True}, 2, [5, 6, 2, 7], "stop", 7),
        ({"stop_token_ids": [2]}, 2, [5, 6, 2], "stop", None),  # EOS is checked first
        ({"max_tokens": 2}, 2, [5, 6], "length", None),
        ({"min_tokens": 4}, 2, [5, 6, 2, 7, 8], "length", None),  # EOS 3rd: held off
        ({"min_tokens": 3}, 2, [5, 6, 2], "stop", None),  # EOS once min_tokens are out
        ({"stop_token_ids": [6], "min_tokens": 3}, 2, [5, 6, 2], "stop", None),
    ],
)
def test_stop_conditions(kwargs, eos, expected, reason, stop_reason) -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler, _scripted([5, 6, 2, 7, 8, 9, 9, 9]))
    kwargs.setdefault("max_tokens", 5)
    request = make_request("a", [1, 1, 1, 1], eos_token_id=eos, **kwargs)
    scheduler.add_request(request)
    outputs: list[EngineCoreOutput] = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, worker)[1].values()
    assert [t for out in outputs for t in out.new_token_ids] == expected
    assert all(out.finish_reason is None for out in outputs[:-1])
    assert str(outputs[-1].finish_reason) == reason and outputs[-1].stop_reason == stop_reason
    assert request.stop_reason == stop_reason
    finished = (
        RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH_CAPPED
    )
    assert request.status == finished and request.is_finished()
    assert_all_free(scheduler, worker)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "num_outputs"), [(7, None, 3), (7, 50, 3), (10, None, 1)]
)
def test_max_model_len_caps_the_output(prompt_len, max_tokens, num_outputs) -> None:
    scheduler = make_scheduler(max_model_len=10)
    worker = make_worker(scheduler)
    request = make_request(
        "a", [3] * prompt_len, max_model_len=10, max_tokens=max_tokens, ignore_eos=True
    )
    assert request.max_tokens == num_outputs
    scheduler.add_request(request)
    results = run_to_completion(scheduler, worker)
    assert len(results["a"][0]) == num_outputs and results["a"][1] == "length"
    assert_all_free(scheduler, worker)


def test_a_shared_prefix_is_computed_once() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=128)
    worker = make_worker(scheduler)
    prefix = list(range(40, 80))  # 40 tokens: 10 blocks
    scheduler.add_request(make_request("a", prefix + [1, 2, 3], max_tokens=4))
    step(scheduler, worker)
    second = make_request("b", prefix + [9, 9], max_tokens=4)
    scheduler.add_request(second)
    scheduler_output, _ = step(scheduler, worker)
    assert scheduler_output.num_scheduled_tokens["b"] == 2
    (new_req,) = scheduler_output.scheduled_new_reqs
    assert new_req.num_computed_tokens == 40 and second.num_cached_tokens == 40
    a_ids, b_ids = (scheduler.kv_cache_manager.get_block_ids(r)[0] for r in ("a", "b"))
    assert b_ids[:10] == a_ids[:10] and b_ids[10] != a_ids[10]
    stats = scheduler.make_stats()
    assert stats.num_prefix_cache_hit_tokens == 40 and stats.num_prefix_cache_query_tokens == 85
    assert stats.prefix_cache_hit_rate == pytest.approx(40 / 85)
    run_to_completion(scheduler, worker)
    assert second.output_token_ids == reference_output(second, 128)[0]
    assert_all_free(scheduler, worker)


def test_identical_prompts_in_one_step_share_blocks() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, list(range(13)), max_tokens=3))
    scheduler_output, _ = step(scheduler, worker)
    # a's full blocks are cached as soon as they are allocated, so b finds them in the same step.
    assert scheduler_output.num_scheduled_tokens == {"a": 13, "b": 1}
    assert scheduler.requests["b"].num_cached_tokens == 12
    results = run_to_completion(scheduler, worker)
    assert results["a"] == results["b"]
    assert_all_free(scheduler, worker)


def test_reset_prefix_cache() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", list(range(20)), max_tokens=2))
    step(scheduler, worker)
    assert scheduler.reset_prefix_cache() is False
    run_to_completion(scheduler, worker)
    assert scheduler.reset_prefix_cache() is True
    scheduler.add_request(make_request("b", list(range(20)), max_tokens=2))
    scheduler_output, _ = step(scheduler, worker)
    assert scheduler_output.num_scheduled_tokens == {"b": 20}


def test_logprobs_follow_the_requests_that_sampled() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", [1, 2, 3]))
    scheduler.add_request(make_request("b", list(range(20))))  # partial chunk: no sample
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {"a": 3, "b": 7}
    logprobs = LogprobsLists(token_ids=[[7, 8]], logprobs=[[-0.1, -2.0]], sampled_token_ranks=[1])
    model_runner_output = ModelRunnerOutput(["a", "b"], [[7], []], logprobs)
    (out,) = scheduler.update_from_output(scheduler_output, model_runner_output).outputs
    assert out.request_id == "a" and out.new_logprobs == logprobs


def test_wire_types_round_trip_through_msgpack() -> None:
    request = EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=3, stop=["x"]), 2, 1.5)
    data = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(data, type=EngineCoreRequest) == request
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("r", [4], FinishReason.STOP, 4, LogprobsLists([[4]], [[-0.5]], [1]))],
        make_scheduler().make_stats(),
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(outputs), type=EngineCoreOutputs)
    assert decoded == outputs and decoded.outputs[0].finished
    converted = Request.from_engine_core_request(request, max_model_len=16)
    assert converted.max_tokens == 3 and converted.eos_token_id == 2


def test_a_pooled_prompt_finishes_its_request_without_decoding() -> None:
    # A pooling engine's request: a one-token generation whose token the workers replace with
    # the prompt's last hidden state. Its prompt is chunked (budget 8), and a step planned while
    # its last chunk is in flight (async scheduling) must not schedule it again.
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("e", list(range(3, 15)), max_tokens=1))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"e": 8}
    chunk = scheduler.update_from_output(first, ModelRunnerOutput(["e"], [[]]))
    assert chunk.outputs == []
    last = scheduler.schedule()
    assert last.num_scheduled_tokens == {"e": 4}
    assert scheduler.schedule().num_scheduled_tokens == {}  # planned ahead: nothing to run
    hidden = [0.5, -1.0, 2.0]
    (out,) = scheduler.update_from_output(
        last, ModelRunnerOutput(["e"], [[]], pooler_output={"e": hidden})
    ).outputs
    assert (out.new_token_ids, out.pooling_output, out.finish_reason) == ([], hidden, "stop")
    assert out.scheduled_ts > 0.0  # its one output is its first: it carries the metrics' times
    assert not scheduler.has_unfinished_requests()
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=EngineCoreOutput)
    assert decoded == out
