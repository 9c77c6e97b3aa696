"""LLMEngine, vLLM's step-by-step offline API (`add_request`, `step` until no request is
unfinished, `abort_request`), on a real engine: the loop under `LLM.generate`, so its tokens are
generate's."""

from __future__ import annotations

import pytest

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, all_blocks_free, make_llm, token_ids
from v1engine import EngineArgs, LLMEngine
from v1engine.outputs import RequestOutput
from v1engine.pooling_params import PoolingParams
from v1engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    with make_llm(llama_checkpoint) as llm:
        yield llm


def _run_to_the_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Every step's outputs, per request, in order."""
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
    return seen


def test_stepping_gives_cumulative_outputs_ending_in_generates_tokens(llm):
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    engine = llm.llm_engine
    for index, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=4 + index, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
    assert engine.get_num_unfinished_requests() == len(PROMPTS)
    seen = _run_to_the_end(engine)
    assert engine.step() == []  # nothing left to run
    for index, prompt in enumerate(PROMPTS):
        outputs = seen[f"r{index}"]
        tokens = [output.outputs[0].token_ids for output in outputs]
        # Cumulative (vLLM's default): each output holds every token so far, one more per step.
        assert [len(t) for t in tokens] == list(range(1, 5 + index))
        assert all(t == tokens[-1][: len(t)] for t in tokens)
        assert tokens[-1] == expected[index][: 4 + index]
        assert [output.finished for output in outputs] == [False] * (3 + index) + [True]
        assert outputs[-1].prompt_token_ids == prompt
    assert all_blocks_free(llm)


@pytest.mark.parametrize("kind", ["delta", "final"])
def test_delta_and_final_outputs_as_async_llm_gives_them(llm, kind):
    expected = token_ids(llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False))[0]
    llm.llm_engine.add_request("r", PROMPTS[2], GREEDY, output_kind=kind)
    outputs = _run_to_the_end(llm.llm_engine)["r"]
    pieces = [output.outputs[0].token_ids for output in outputs]
    if kind == "delta":  # one new token per output, adding up to the whole
        assert all(len(piece) == 1 for piece in pieces)
        assert [token for piece in pieces for token in piece] == expected
    else:
        assert pieces == [expected] and outputs[0].finished


def test_an_aborted_request_gets_no_further_outputs(llm):
    engine = llm.llm_engine
    engine.add_request("kept", PROMPTS[0], GREEDY)
    engine.add_request("dropped", PROMPTS[1], GREEDY)
    started: set[str] = set()
    while started != {"kept", "dropped"}:  # a step may return nothing (scheduled ahead)
        started |= {output.request_id for output in engine.step()}
    engine.abort_request("dropped")
    assert engine.get_num_unfinished_requests() == 1
    seen = _run_to_the_end(engine)
    assert set(seen) == {"kept"} and seen["kept"][-1].finished
    assert len(seen["kept"][-1].outputs[0].token_ids) == GREEDY.max_tokens
    assert all_blocks_free(llm)


def test_n_children_come_folded_into_their_request(llm):
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=7, ignore_eos=True)
    llm.llm_engine.add_request("parent", PROMPTS[2], params)
    final = _run_to_the_end(llm.llm_engine)["parent"][-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    assert all(len(c.token_ids) == 3 for c in final.outputs)


@pytest.mark.parametrize(
    "request_id, prompt, params, error, match",
    [
        ("too-long", list(range(3, 131)), GREEDY, ValueError, "max_model_len"),
        # n = 2: the core refuses the first child; the error names the caller's id.
        (
            "bad-token",
            [1, 99999],
            SamplingParams(n=2, max_tokens=1),
            ValueError,
            "'bad-token'.*outside the vocabulary",
        ),
        ("pooled", [1, 2], PoolingParams(), ValueError, "pooling"),
        ("bad-params", [1, 2], {"max_tokens": 3}, TypeError, "SamplingParams or PoolingParams"),
    ],
)
def test_a_refused_request_leaves_nothing_queued(llm, request_id, prompt, params, error, match):
    with pytest.raises(error, match=match):
        llm.llm_engine.add_request(request_id, prompt, params)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.step() == []


def test_an_id_in_use_is_refused_and_the_first_request_runs_on(llm):
    engine = llm.llm_engine
    engine.add_request("same", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="same"):
        engine.add_request("same", PROMPTS[1], GREEDY)
    seen = _run_to_the_end(engine)
    assert seen["same"][-1].prompt_token_ids == PROMPTS[0]


def test_from_engine_args_starts_its_own_engine(llama_checkpoint):
    args = EngineArgs(
        model=llama_checkpoint,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
    )
    engine = LLMEngine.from_engine_args(args, skip_tokenizer_init=True)
    try:
        assert engine.get_tokenizer() is None
        engine.add_request("0", PROMPTS[3], GREEDY)
        final = _run_to_the_end(engine)["0"][-1]
        assert final.finished and len(final.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        engine.shutdown()


def test_an_unknown_output_kind_is_refused(llm):
    with pytest.raises(ValueError, match="output_kind must be one of"):
        llm.llm_engine.add_request("r", PROMPTS[0], GREEDY, output_kind="DELTA")
    assert not llm.llm_engine.has_unfinished_requests()
