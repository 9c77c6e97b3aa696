"""OutputProcessor: prompt-logprob chunks from the core -> `RequestOutput.prompt_logprobs` (None
first, decoded tokens, shown once per delta stream, on the parent of n > 1), on the real SmolLM2
tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from v1engine.engine.output_processor import OutputProcessor
from v1engine.engine.processor import make_child_requests
from v1engine.model.hf_config import default_model_path, prepare_checkpoint
from v1engine.outputs import Logprob, LogprobsLists
from v1engine.request import EngineCoreOutput, FinishReason
from v1engine.sampling_params import SamplingParams

PROMPT = "Paris is the capital of France"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))


def _rows(prompt_token_ids: list[int], first: int, end: int) -> LogprobsLists:
    """Rows for positions first .. end - 1: the next prompt token at rank 2, then top-1 id 7."""
    return LogprobsLists(
        token_ids=[[prompt_token_ids[p + 1], 7] for p in range(first, end)],
        logprobs=[[-1.0 - p, -0.5] for p in range(first, end)],
        sampled_token_ranks=[2] * (end - first),
    )


def _expected(tokenizer, prompt_token_ids: list[int]) -> list[dict[int, Logprob] | None]:
    return [None] + [
        {
            token_id: Logprob(-1.0 - p, 2, tokenizer.decode([token_id])),
            7: Logprob(-0.5, 1, tokenizer.decode([7])),
        }
        for p, token_id in enumerate(prompt_token_ids[1:])
    ]


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final"])
def test_chunks_gather_into_one_list_shown_with_the_first_token(tokenizer, output_kind):
    prompt_ids = tokenizer.encode(PROMPT)
    num_positions = len(prompt_ids) - 1
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", PROMPT, prompt_ids, SamplingParams(prompt_logprobs=1), output_kind)
    # A first prefill chunk samples nothing: no RequestOutput yet.
    chunk = EngineCoreOutput("r", [], new_prompt_logprobs=_rows(prompt_ids, 0, 3))
    assert processor.process_outputs([chunk]) == ([], [])
    last = EngineCoreOutput("r", [42], new_prompt_logprobs=_rows(prompt_ids, 3, num_positions))
    first_outputs, _ = processor.process_outputs([last])
    done = EngineCoreOutput("r", [43], finish_reason=FinishReason.LENGTH)
    final_outputs, _ = processor.process_outputs([done])
    expected = _expected(tokenizer, prompt_ids)
    if output_kind == "final":
        assert first_outputs == [] and final_outputs[0].prompt_logprobs == expected
    else:
        assert first_outputs[0].prompt_logprobs == expected
        later = None if output_kind == "delta" else expected
        assert final_outputs[0].prompt_logprobs == later


def test_without_prompt_logprobs_the_field_stays_none(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", PROMPT, tokenizer.encode(PROMPT), SamplingParams(), "final")
    (output,), _ = processor.process_outputs(
        [EngineCoreOutput("r", [42], finish_reason=FinishReason.LENGTH)]
    )
    assert output.prompt_logprobs is None


def test_only_child_0_computes_them_and_the_parent_shows_them(tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    params = SamplingParams(n=3, prompt_logprobs=1)
    children = make_child_requests("p", params)
    assert [child.prompt_logprobs for _, _, child in children] == [1, None, None]
    processor = OutputProcessor(tokenizer)
    for child_id, index, _ in children:
        processor.add_request(child_id, PROMPT, prompt_ids, params, "final", "p", index)
    rows = _rows(prompt_ids, 0, len(prompt_ids) - 1)
    outputs = [EngineCoreOutput("0_p", [42], FinishReason.LENGTH, new_prompt_logprobs=rows)]
    outputs += [EngineCoreOutput(f"{i}_p", [42], FinishReason.LENGTH) for i in (1, 2)]
    (parent,), _ = processor.process_outputs(outputs)
    assert parent.request_id == "p" and len(parent.outputs) == 3
    assert parent.prompt_logprobs == _expected(tokenizer, prompt_ids)
