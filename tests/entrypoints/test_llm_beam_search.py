"""LLM.beam_search end to end (real worker processes, real weights): the same beams as the
search spelled out over transformers' logits, width 1 is greedy decoding, and a bad prompt leaves
nothing running."""

from __future__ import annotations

import pytest

from tests.entrypoints.llm_utils import (
    GREEDY,
    PROMPTS,
    all_blocks_free,
    hf_beam_search,
    make_llm,
    token_ids,
)
from tests.model.checkpoints import load_hf_model
from v1engine.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    with make_llm(llama_checkpoint, tensor_parallel_size=1) as llm:
        yield llm


def test_beams_equal_the_search_over_transformers_logits(llm, llama_checkpoint):
    hf_model = load_hf_model(llama_checkpoint)
    prompts = PROMPTS[:3]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outputs = llm.beam_search(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        expected = hf_beam_search(hf_model, prompt, width=3, max_tokens=6)
        got = [(s.tokens[len(prompt) :], s.cum_logprob) for s in output.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, logprob), (_, want) in zip(got, expected):
            assert logprob == pytest.approx(want, abs=1e-3)
        for sequence in output.sequences:
            assert sequence.tokens[: len(prompt)] == prompt  # vLLM's: prompt and output
            assert sequence.finish_reason == "length" and len(sequence.logprobs) == 6
            assert sequence.text is None  # no tokenizer
    assert all_blocks_free(llm)


def test_width_one_is_greedy_decoding(llm):
    prompts = PROMPTS[:3]
    params = BeamSearchParams(beam_width=1, max_tokens=GREEDY.max_tokens, ignore_eos=True)
    beams = [
        o.sequences[0].tokens[len(p) :] for p, o in zip(prompts, llm.beam_search(prompts, params))
    ]
    assert beams == token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))


def test_a_concurrency_limit_runs_the_searches_in_turn_with_the_same_results(llm, monkeypatch):
    prompts = PROMPTS[:3]
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    step_sizes = []  # beams per step
    generate = llm.generate

    def recording_generate(beams, *args, **kwargs):
        step_sizes.append(len(beams))
        return generate(beams, *args, **kwargs)

    monkeypatch.setattr(llm, "generate", recording_generate)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    assert step_sizes == [1, 2, 2, 2] * 3  # one search at a time: its first step has 1 beam
    for alone, batched in zip(one_at_a_time, together):
        # Other batch shapes may move the last bits of a logprob, not the beams.
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in batched.sequences]
        for a, b in zip(alone.sequences, batched.sequences):
            assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=1e-4)
    with pytest.raises(ValueError, match="concurrency_limit must be >= 1 or None, got 0"):
        llm.beam_search(prompts, params, concurrency_limit=0)
    # Each step reads 2 * beam_width logprobs: within the engine's max_logprobs (20 here).
    with pytest.raises(ValueError, match="beam_width 11 reads 22 logprobs per step"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=11, max_tokens=2))


def test_a_prompt_the_engine_refuses_raises_and_leaves_nothing_running(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([PROMPTS[0], list(range(1, 200))], params)
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.engine_core.scheduler.has_unfinished_requests()
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"beam_width": 0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}"):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
