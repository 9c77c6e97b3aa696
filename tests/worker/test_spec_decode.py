"""The workers' side of speculative decoding, without a model: n-gram drafts, which drafts a
step's sampled rows accept, where the LM head reads, and what each verifying row samples with."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from v1engine.config import SpeculativeConfig
from v1engine.engine_args import EngineArgs
from v1engine.kv_cache_interface import FullAttentionSpec
from v1engine.model.layers.torch_attention import TorchAttentionBackend
from v1engine.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from v1engine.sampling_params import SamplingParams
from v1engine.worker.model_inputs import build_model_inputs
from v1engine.worker.request_states import CachedRequestState, InputBatch, RequestStates
from v1engine.worker.spec_decode import (
    emitted_rows,
    emitted_tokens,
    expand_rows,
    ngram_drafts,
)


def _drafts(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 3) -> list[int]:
    return ngram_drafts(np.array(tokens, dtype=np.int32), min_n, max_n, k)


def test_ngram_drafts_follow_the_earliest_occurrence_of_the_longest_suffix() -> None:
    # "7 8" occurs at 0 and 4; the longest suffix found is "7 8" (3 tokens "9 7 8" is not).
    assert _drafts([7, 8, 1, 2, 7, 8, 3, 4, 7, 8]) == [1, 2, 7]
    # "5 7 8" (n=3) occurs once, after which "3" came: longer beats earlier.
    assert _drafts([7, 8, 1, 5, 7, 8, 3, 9, 5, 7, 8]) == [3, 9, 5]
    assert _drafts([1, 2, 3, 4]) == []  # the last token never occurred before
    assert _drafts([4, 4]) == [4]  # only what exists after the match
    assert _drafts([9]) == [] and _drafts([]) == []
    # min_n: a one-token match is not enough.
    assert _drafts([7, 1, 2, 3, 7], min_n=2) == []
    assert _drafts([7, 1, 2, 3, 7], k=2) == [1, 2]


def test_emitted_tokens_take_drafts_up_to_the_first_the_model_did_not_sample() -> None:
    drafts = [[5, 6, 7], [], [9, 9]]
    # Rows: request 0 at 0..3, request 1 at 4, request 2 at 5..7.
    sampled = [5, 6, 1, 2, 3, 9, 9, 4]
    assert emitted_tokens(drafts, sampled) == [[5, 6, 1], [3], [9, 9, 4]]
    assert emitted_tokens([[5]], [6, 7]) == [[6]]  # the first draft rejected


def _state(req_id: str, **params) -> CachedRequestState:
    return CachedRequestState(req_id, [1, 2], SamplingParams(**params), None, [[]], 2, [3])


def test_expanded_rows_repeat_each_state_and_move_the_grammar_rows() -> None:
    states = [_state("a"), _state("b"), _state("c")]
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    rows, grammar = expand_rows(states, [[1, 2], [], [3]], ([1], bitmask))
    assert [row.req_id for row in rows] == ["a", "a", "a", "b", "c", "c"]
    assert all(row is states[0] for row in rows[:3])  # nothing reads the output: no copies
    assert grammar[0] == [3] and grammar[1] is bitmask
    # Structured requests with drafts: a bitmask row for each of their logits rows.
    bitmask = torch.zeros(5, 4, dtype=torch.int32)
    _, grammar = expand_rows(states, [[1, 2], [], [3]], ([0, 2], bitmask))
    assert grammar[0] == [0, 1, 2, 4, 5] and grammar[1] is bitmask


def test_rows_after_drafts_see_them_in_the_output_where_the_sampler_reads_it() -> None:
    """Penalties, min_tokens and bad words at row i count the drafts before it."""
    for params in ({"repetition_penalty": 1.2}, {"min_tokens": 3}, {"frequency_penalty": 0.5}):
        state = _state("a", **params)
        rows, _ = expand_rows([state], [[7, 8]], None)
        assert [row.output_token_ids for row in rows] == [[3], [3, 7], [3, 7, 8]]
        assert rows[0] is state and state.output_token_ids == [3]
        assert [row.sampling_params for row in rows] == [state.sampling_params] * 3


def test_emitted_rows_are_the_rows_that_sampled_each_emitted_token() -> None:
    drafts = [[5, 6, 7], [], [9, 9]]
    emitted = emitted_tokens(drafts, [5, 6, 1, 2, 3, 9, 9, 4])  # [[5, 6, 1], [3], [9, 9, 4]]
    assert emitted_rows(drafts, emitted) == [0, 1, 2, 4, 5, 6, 7]
    assert emitted_rows([[5, 6]], [[8]]) == [0]  # the first draft rejected


def test_the_lm_head_reads_the_last_known_token_and_every_draft() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=32, block_sizes=[4])
    states = RequestStates(batch, "cpu")
    params = SamplingParams(temperature=0.0)
    new = [
        NewRequestData("a", [1, 2, 3], params, ([0],), num_computed_tokens=2),
        NewRequestData("b", [4, 5, 6, 7, 8], params, ([1, 2],), num_computed_tokens=0),
    ]
    scheduler_output = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"a": 3, "b": 5},
        total_num_scheduled_tokens=8,
        scheduled_spec_decode_tokens={"a": [9, 10]},
    )
    states.update(scheduler_output)
    assert batch.num_tokens[0] == 3  # drafts are written after the known tokens, not added
    spec = FullAttentionSpec(4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cpu, backend = torch.device("cpu"), TorchAttentionBackend()
    inputs = build_model_inputs(batch, np.array([3, 5]), backend, [spec], cpu, np.array([2, 0]))
    assert inputs.input_ids.tolist() == [3, 9, 10, 4, 5, 6, 7, 8]
    assert inputs.positions.tolist() == [2, 3, 4, 0, 1, 2, 3, 4]
    assert inputs.sampling_rows == [0, 1]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 7]


def test_a_bad_speculative_config_is_refused_naming_the_fix(caplog) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "model": "x"})
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.from_dict(
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}
        )
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig(num_speculative_tokens=1).prompt_lookup_min == 5
    with caplog.at_level(logging.INFO, logger="v1engine.config"):
        engine = EngineArgs(speculative_config={"num_speculative_tokens": 2}).create_engine_config()
    assert engine.speculative_config.num_speculative_tokens == 2
    assert not engine.scheduler_config.async_scheduling  # drafts come back with the step
    assert "async scheduling is off" in caplog.text  # said, not silently changed
    pooling = EngineArgs(speculative_config={"num_speculative_tokens": 2}, runner="pooling")
    with pytest.raises(ValueError, match="this engine pools"):
        pooling.create_engine_config()


def test_the_server_flag_takes_vllms_json() -> None:
    from v1engine.serve import make_arg_parser

    flag = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    args = make_arg_parser().parse_args(["--speculative-config", flag])
    config = EngineArgs.from_cli_args(args).create_engine_config().speculative_config
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (4, 4)
