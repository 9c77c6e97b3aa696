"""The scheduler's side of speculative decoding, driven by hand: drafts the workers propose are
scheduled after the known tokens, count as computed only once accepted, stay within the token
budget and the length limits, and rejected drafts give their KV slots back to later tokens."""

from __future__ import annotations

from tests.core.fake_worker import make_request, make_scheduler
from v1engine.core.scheduler import Scheduler
from v1engine.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput


def _reply(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    tokens: dict[str, list[int]],
    drafts: dict[str, list[int]],
    logprobs: LogprobsLists | None = None,
):
    """The workers' reply to a step: `tokens` per request, and `drafts` for their next step."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    reply = ModelRunnerOutput(
        req_ids,
        [tokens.get(r, []) for r in req_ids],
        logprobs,
        spec_token_ids=[drafts.get(r, []) for r in req_ids],
    )
    return scheduler.update_from_output(scheduler_output, reply)


def test_drafts_are_verified_after_the_known_tokens_and_only_accepted_ones_count() -> None:
    scheduler = make_scheduler(block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=20, ignore_eos=True)
    scheduler.add_request(a)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 5} and not out.scheduled_spec_decode_tokens
    _reply(scheduler, out, {"a": [6]}, {"a": [7, 8, 9]})
    assert a.spec_token_ids == [7, 8, 9] and a.num_computed_tokens == 5

    out = scheduler.schedule()
    # The sampled token and the three drafts; the drafts are not computed yet.
    assert out.num_scheduled_tokens == {"a": 4} and out.total_num_scheduled_tokens == 4
    assert out.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    assert a.num_computed_tokens == 6 and a.spec_token_ids == []
    # 6 known tokens and 3 drafts need 3 blocks of 4.
    assert len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == 3
    outputs = _reply(scheduler, out, {"a": [7, 8, 30]}, {"a": [31]})  # 2 accepted, 1 more
    assert outputs.outputs[0].new_token_ids == [7, 8, 30]
    assert a.output_token_ids == [6, 7, 8, 30] and a.num_computed_tokens == 8
    stats = outputs.scheduler_stats
    assert (stats.num_spec_drafts, stats.num_spec_draft_tokens) == (1, 3)
    assert stats.num_spec_accepted_tokens == 2

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 2} and out.scheduled_spec_decode_tokens == {"a": [31]}
    _reply(scheduler, out, {"a": [40]}, {})  # the draft rejected
    assert a.num_computed_tokens == 9 and a.num_tokens == 10
    assert scheduler.make_stats().num_spec_accepted_tokens == 2

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens
    scheduler.finish_requests("a", a.status.FINISHED_ABORTED)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_fewer_blocks_after_rejection_and_a_draft_free_step_allocate_nothing_new() -> None:
    scheduler = make_scheduler(block_size=4)
    a = make_request("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    scheduler.add_request(a)
    _reply(scheduler, scheduler.schedule(), {"a": [4]}, {"a": [5, 6, 7, 8]})
    out = scheduler.schedule()  # 4 known + 4 drafts: 2 blocks
    assert len(scheduler.kv_cache_manager.get_block_ids("a")[0]) == 2
    _reply(scheduler, out, {"a": [9]}, {})  # every draft rejected
    assert a.num_computed_tokens == 4 and a.num_tokens == 5
    out = scheduler.schedule()  # 5 tokens fit in the 2 blocks held
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [None]


def test_drafts_stay_within_max_tokens_max_model_len_and_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6, max_model_len=32)
    short = make_request("short", [1, 2], max_tokens=3, ignore_eos=True, max_model_len=32)
    near = make_request(
        "near", list(range(10, 38)), max_tokens=20, ignore_eos=True, max_model_len=32
    )
    scheduler.add_request(short)
    _reply(scheduler, scheduler.schedule(), {"short": [3]}, {"short": [4, 5, 6, 7]})
    # One output so far, three at most: one draft and the token after it.
    assert short.spec_token_ids == [4]
    out = scheduler.schedule()
    _reply(scheduler, out, {"short": [4, 5]}, {})
    assert short.is_finished() and short.output_token_ids == [3, 4, 5]

    scheduler.add_request(near)
    for _ in range(5):  # 28 prompt tokens in chunks of 6
        out = scheduler.schedule()
        last = sum(out.num_scheduled_tokens.values()) < 6
        _reply(scheduler, out, *(({"near": [50]}, {"near": [1, 2, 3, 4]}) if last else ({}, {})))
    # 29 tokens of 32: two drafts at most, so that 29 + 2 + 1 fit.
    assert near.num_tokens == 29 and near.spec_token_ids == [1, 2]

    scheduler.add_request(b := make_request("b", [7] * 5, max_tokens=20, ignore_eos=True))
    out = scheduler.schedule()
    # "near" takes its token and both drafts (3); "b" gets the 3 left.
    assert out.num_scheduled_tokens == {"near": 3, "b": 3}
    _reply(scheduler, out, {"near": [1, 2, 60]}, {"near": [9]})
    assert near.is_finished() and near.num_tokens == 32
    assert b.num_computed_tokens == 3


def test_drafts_are_dropped_before_anyone_is_preempted_for_them() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=4)  # 2 usable blocks
    for req_id, prompt in (("a", [1, 2, 3]), ("b", [5, 6, 7])):
        scheduler.add_request(make_request(req_id, prompt, max_tokens=8, ignore_eos=True))
    _reply(scheduler, scheduler.schedule(), {"a": [4], "b": [8]}, {"a": [9, 9]})
    out = scheduler.schedule()  # a's drafts would need a third block
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not out.scheduled_spec_decode_tokens and not out.preempted_req_ids
    assert scheduler.make_stats().num_preemptions == 0


def test_each_emitted_token_keeps_its_logprobs_row_up_to_a_stop_among_the_drafts() -> None:
    scheduler = make_scheduler(block_size=4)
    a = make_request("a", [1, 2, 3], max_tokens=20, stop_token_ids=[8], logprobs=1)
    b = make_request("b", [1, 2], max_tokens=20, ignore_eos=True, logprobs=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    _reply(scheduler, scheduler.schedule(), {"a": [5], "b": [5]}, {"a": [7, 8, 9]})
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    # A row per emitted token, a's three then b's one: a's token after the stop goes, and so
    # does its row.
    rows = LogprobsLists([[t, t] for t in (7, 8, 30, 6)], [[-0.1, -0.1]] * 4, [1, 2, 3, 4])
    outputs = _reply(scheduler, out, {"a": [7, 8, 30], "b": [6]}, {}, rows)
    by_id = {output.request_id: output for output in outputs.outputs}
    assert by_id["a"].new_token_ids == [7, 8] and by_id["a"].finish_reason is not None
    assert by_id["a"].new_logprobs == rows.rows(0, 2)
    assert by_id["b"].new_token_ids == [6] and by_id["b"].new_logprobs == rows.rows(3, 4)
