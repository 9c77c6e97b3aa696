"""Speculative decoding (n-gram drafts) end to end on a tiny random llama: greedy tokens equal
plain decoding's, with drafts accepted and rejected, with penalties, min_tokens and logit bias,
under preemption and at tensor-parallel size 2; sampled tokens keep their distribution;
requests with logprobs get every token's logprobs."""

from __future__ import annotations

import collections
import logging

import pytest

from tests.entrypoints.llm_utils import PREEMPTING, PROMPTS, make_llm, preempted_greedy, token_ids
from v1engine.engine import stat_logger
from v1engine.engine.metrics_reader import Counter
from v1engine.entrypoints.llm import LLM
from v1engine.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
# The tiny model's greedy output falls into loops, which the drafts then predict.
LOOPING = PROMPTS + [[5, 6, 7, 8] * 6]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(llama_checkpoint: str):
    with make_llm(llama_checkpoint) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec(llama_checkpoint: str):
    """With metrics, and the stats lines logged at every chance."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("V1ENGINE_LOG_STATS_INTERVAL", "0.001")
        llm = make_llm(llama_checkpoint, speculative_config=SPEC, disable_log_stats=False)
    with llm:
        yield llm


def _spec_stats(llm: LLM) -> tuple[int, int]:
    stats = llm.engine_core.scheduler.make_stats()
    return stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens


def test_greedy_tokens_equal_plain_decoding(plain: LLM, spec: LLM, caplog) -> None:
    assert not spec.llm_engine.config.scheduler_config.async_scheduling
    expected = token_ids(plain.generate(LOOPING, GREEDY, use_tqdm=False))
    drafted, accepted = _spec_stats(spec)
    with caplog.at_level(logging.INFO, logger=stat_logger.__name__):
        assert token_ids(spec.generate(LOOPING, GREEDY, use_tqdm=False)) == expected
    now_drafted, now_accepted = _spec_stats(spec)
    # Some drafts were accepted, some rejected: both paths ran.
    assert now_drafted - drafted > now_accepted - accepted > 0
    # vLLM's counters and stats line.
    counters = {m.name: m.value for m in spec.get_metrics() if isinstance(m, Counter)}
    assert counters["vllm:spec_decode_num_draft_tokens"] == now_drafted
    assert counters["vllm:spec_decode_num_accepted_tokens"] == now_accepted
    lines = [r.getMessage() for r in caplog.records if r.name == stat_logger.__name__]
    assert any(line.startswith("SpecDecoding metrics: Mean acceptance length") for line in lines)


def test_penalties_and_masks_see_the_drafts_before_each_row(plain: LLM, spec: LLM) -> None:
    """Each verifying row penalizes, and counts toward min_tokens, the drafts before it: the
    tokens are plain decoding's, with drafts accepted."""
    loop = LOOPING[-1]
    stop_at = token_ids(plain.generate([loop], GREEDY, use_tqdm=False))[0][4]
    greedy = dict(max_tokens=40, temperature=0.0)
    # A frequency penalty of 0.1 changes these prompts' tokens if a row leaves out the drafts
    # before it (checked by breaking `after_drafts`).
    frequency = SamplingParams(**greedy, ignore_eos=True, frequency_penalty=0.1)
    params = [
        frequency,
        frequency,
        SamplingParams(**greedy, ignore_eos=True, repetition_penalty=1.05, presence_penalty=0.1),
        # The stop token would end it at once; min_tokens bans it until the 30th token.
        SamplingParams(**greedy, stop_token_ids=[stop_at], min_tokens=30),
        SamplingParams(**greedy, ignore_eos=True, logit_bias={stop_at: -1.0}),
    ]
    prompts = [loop, [8] * 20] + [loop] * 3
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    accepted = _spec_stats(spec)[1]
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == expected
    assert _spec_stats(spec)[1] > accepted


def test_requests_with_logprobs_speculate_and_get_every_tokens_logprobs(
    plain: LLM, spec: LLM
) -> None:
    """Each emitted token's logprobs come from the row that sampled it, accepted drafts
    included; a stop among accepted drafts drops the rows after it with the tokens."""
    loop = LOOPING[-1]
    stop_at = token_ids(plain.generate([loop], GREEDY, use_tqdm=False))[0][20]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_at], logprobs=0),
    ]
    expected = plain.generate([loop, loop], params, use_tqdm=False)
    accepted = _spec_stats(spec)[1]
    got = spec.generate([loop, loop], params, use_tqdm=False)
    assert _spec_stats(spec)[1] > accepted  # they did speculate
    assert token_ids(got) == token_ids(expected)
    for want, have in zip(expected, got):
        want, have = want.outputs[0], have.outputs[0]
        assert len(have.logprobs) == len(have.token_ids)
        for token, want_row, have_row in zip(have.token_ids, want.logprobs, have.logprobs):
            assert want_row.keys() == have_row.keys() and token in have_row
            assert all(abs(want_row[t].logprob - have_row[t].logprob) < 1e-4 for t in want_row)
            assert all(want_row[t].rank == have_row[t].rank for t in want_row)
        assert abs(want.cumulative_logprob - have.cumulative_logprob) < 1e-3


def test_sampled_tokens_keep_their_distribution(plain: LLM, spec: LLM) -> None:
    """At a low temperature the model mostly continues its loop, so drafts are often accepted
    and often not; each output position's token distribution over many seeds must match plain
    decoding's (the first token is the same draw in both)."""
    n = 300
    params = [
        SamplingParams(max_tokens=6, temperature=0.15, seed=i, ignore_eos=True) for i in range(n)
    ]
    prompts = [[8] * 20] * n
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    drafted, accepted = _spec_stats(spec)
    got = token_ids(spec.generate(prompts, params, use_tqdm=False))
    now_drafted, now_accepted = _spec_stats(spec)
    assert now_accepted - accepted > (now_drafted - drafted) / 4
    assert [t[0] for t in got] == [t[0] for t in expected]
    for position in range(1, 6):
        want = collections.Counter(t[position] for t in expected)
        have = collections.Counter(t[position] for t in got)
        distance = sum(abs(want[t] - have[t]) for t in want.keys() | have.keys()) / (2 * n)
        assert distance < 0.12, (position, want.most_common(4), have.most_common(4))


def test_greedy_tokens_survive_preemption(plain: LLM, llama_checkpoint: str) -> None:
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = token_ids(plain.generate(PROMPTS, short, use_tqdm=False))
    with make_llm(llama_checkpoint, speculative_config=SPEC, **PREEMPTING) as llm:
        assert preempted_greedy(llm) == expected
        assert _spec_stats(llm)[1] > 0


def test_tensor_parallel_2_verifies_on_every_rank(plain: LLM, llama_checkpoint: str) -> None:
    expected = token_ids(plain.generate(LOOPING, GREEDY, use_tqdm=False))
    with make_llm(llama_checkpoint, speculative_config=SPEC, tensor_parallel_size=2) as llm:
        assert token_ids(llm.generate(LOOPING, GREEDY, use_tqdm=False)) == expected
        assert _spec_stats(llm)[1] > 0


def test_stops_inside_accepted_drafts_end_the_output_where_plain_decoding_does(
    plain: LLM, spec: LLM
) -> None:
    """A stop token or max_tokens reached among a step's accepted drafts ends the output there,
    and the tokens after it are dropped; n=2 children speculate alike."""
    loop = LOOPING[-1]
    free = token_ids(plain.generate([loop], GREEDY, use_tqdm=False))[0]
    stop_at = free[20]  # a token the loop repeats: drafts are accepted around it
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_at]),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, n=2),
    ]
    expected = plain.generate([loop, loop], params, use_tqdm=False)
    got = spec.generate([loop, loop], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].token_ids[-1] == stop_at
    assert [len(c.token_ids) for c in got[1].outputs] == [13, 13]
