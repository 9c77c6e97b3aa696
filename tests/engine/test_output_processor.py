"""OutputProcessor: EngineCoreOutputs -> RequestOutputs with stop strings, finish reasons, n > 1
fan-in, logprobs and aborts, on the real SmolLM2 tokenizer; and the Processor's check that keeps a
bad prompt from ever reaching it."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from v1engine.config import EngineConfig
from v1engine.core_protocol import EngineCoreInfo
from v1engine.engine.output_processor import OutputProcessor
from v1engine.engine.pooling_state import PoolingState
from v1engine.engine.processor import Processor, as_parent_error, make_child_requests
from v1engine.model.hf_config import default_model_path, prepare_checkpoint
from v1engine.outputs import ClassificationRequestOutput, Logprob, LogprobsLists, RequestOutput
from v1engine.pooling_params import PoolingParams
from v1engine.request import EngineCoreOutput, FinishReason
from v1engine.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nTell me<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))


def _add(processor, tokenizer, request_id, params, output_kind="cumulative", **kwargs):
    processor.add_request(
        request_id, PROMPT, tokenizer.encode(PROMPT), params, output_kind, **kwargs
    )


def _stream(processor, request_id, token_ids, finish_reason="length", stop_reason=None):
    """One token per step, the core finishing the request on the last (never when finish_reason
    is None); returns every step's (request_outputs, request_ids_to_abort)."""
    steps = []
    for i, token_id in enumerate(token_ids):
        last = i == len(token_ids) - 1 and finish_reason is not None
        output = EngineCoreOutput(
            request_id,
            [token_id],
            finish_reason=FinishReason(finish_reason) if last else None,
            stop_reason=stop_reason if last else None,
        )
        steps.append(processor.process_outputs([output]))
    return steps


def _final(steps):
    outputs = [out for request_outputs, _ in steps for out in request_outputs]
    assert outputs and outputs[-1].finished
    return outputs[-1]


def test_cumulative_text_tokens_and_length_finish(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams())
    token_ids = tokenizer.encode("Hello wörld 😀 你好!")
    steps = _stream(processor, "r", token_ids, "length")
    for request_outputs, to_abort in steps[:-1]:
        assert not request_outputs[0].finished and to_abort == []
    final = _final(steps)
    assert final.request_id == "r" and final.prompt == PROMPT
    assert final.prompt_token_ids == tokenizer.encode(PROMPT)
    (completion,) = final.outputs
    assert completion.text == "Hello wörld 😀 你好!"
    assert completion.token_ids == token_ids
    assert (completion.finish_reason, completion.stop_reason) == ("length", None)
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_passes_through(tokenizer, include):
    processor = OutputProcessor(tokenizer)
    stop_token = tokenizer.encode(".")[0]
    _add(processor, tokenizer, "r", SamplingParams(include_stop_str_in_output=include))
    token_ids = tokenizer.encode("Done") + [stop_token]
    completion = _final(_stream(processor, "r", token_ids, "stop", stop_token)).outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    assert completion.token_ids == token_ids  # the stop token stays in the tokens
    assert completion.text == ("Done." if include else "Done")


def test_eos_and_abort_pass_through(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "eos", SamplingParams())
    _add(processor, tokenizer, "ab", SamplingParams())
    eos = _final(
        _stream(processor, "eos", [*tokenizer.encode("Hi"), tokenizer.eos_token_id], "stop")
    )
    assert (eos.outputs[0].text, eos.outputs[0].finish_reason) == ("Hi", "stop")
    assert eos.outputs[0].stop_reason is None
    aborted = _final(_stream(processor, "ab", tokenizer.encode("Hi"), "abort"))
    assert aborted.outputs[0].finish_reason == "abort"


@pytest.mark.parametrize(
    ("stop", "include", "expected_text", "expected_reason"),
    [
        (["world"], False, "Hello ", "world"),
        (["world"], True, "Hello world", "world"),
        (["lo wo"], False, "Hel", "lo wo"),  # spans token boundaries
        (["or"], True, "Hello wor", "or"),  # ends inside a token: the rest of it is cut
        (["zzz", "ld", "o w"], False, "Hell", "o w"),  # several: the earliest wins
    ],
)
def test_stop_strings(tokenizer, stop, include, expected_text, expected_reason):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams(stop=stop, include_stop_str_in_output=include))
    token_ids = tokenizer.encode("Hello world, and more text after it.")
    steps = _stream(processor, "r", token_ids, finish_reason=None)
    final = _final(steps)
    completion = final.outputs[0]
    assert completion.text == expected_text
    assert (completion.finish_reason, completion.stop_reason) == ("stop", expected_reason)
    # The core is told to stop once; later outputs for the request are ignored.
    assert [abort for _, to_abort in steps for abort in to_abort] == ["r"]
    assert [len(outs) for outs, _ in steps].count(1) == len(completion.token_ids)
    assert not processor.has_unfinished_requests()


def test_stop_string_and_core_finish_in_same_step(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams(stop=["world"]))
    steps = _stream(processor, "r", tokenizer.encode("Hello world"), "length")
    completion = _final(steps).outputs[0]
    assert (completion.text, completion.stop_reason) == ("Hello ", "world")
    assert all(to_abort == [] for _, to_abort in steps)  # the core already finished it


def test_delta_mode_holds_back_partial_stop_string(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams(stop=["END!"]), "delta")
    # Tokens: The| END| of| the| END|ING|.| END|!
    token_ids = tokenizer.encode("The END of the ENDING. END!")
    steps = _stream(processor, "r", token_ids, finish_reason=None)
    completions = [outs[0].outputs[0] for outs, _ in steps]
    # "END" could start "END!", so it waits until the next character rules that out; a streamed
    # client never sees text that the stop string later cuts.
    assert [c.text for c in completions] == [
        "The",
        " ",
        "END of",
        " the",
        " ",
        "ENDING",
        ".",
        " ",
        "",
    ]
    assert [c.token_ids for c in completions] == [[token_id] for token_id in token_ids]
    assert (completions[-1].finish_reason, completions[-1].stop_reason) == ("stop", "END!")
    assert steps[-1][1] == ["r"]


def test_held_back_text_released_when_no_stop_follows(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams(stop=["\n\n"]), "delta")
    token_ids = tokenizer.encode("one\ntwo\n")
    texts = [outs[0].outputs[0].text for outs, _ in _stream(processor, "r", token_ids)]
    assert "".join(texts) == "one\ntwo\n"
    assert not texts[-2].endswith("\n")  # the lone "\n" waited for the next character
    assert texts[-1].endswith("\n")  # and is flushed when the request finishes


def test_make_child_requests():
    params = SamplingParams(n=3, seed=7, temperature=0.8, stop=["x"])
    children = make_child_requests("p", params)
    assert [(child_id, index) for child_id, index, _ in children] == [
        ("0_p", 0),
        ("1_p", 1),
        ("2_p", 2),
    ]
    assert [child.seed for _, _, child in children] == [7, 8, 9]
    assert all(child.n == 1 and child.stop == ["x"] for _, _, child in children)
    assert params.n == 3 and params.seed == 7  # the parent's params are untouched
    unseeded = make_child_requests("q", SamplingParams(n=2))
    assert [child.seed for _, _, child in unseeded] == [None, None]


def _add_children(processor, tokenizer, params, output_kind):
    for child_id, index, _ in make_child_requests("p", params):
        _add(processor, tokenizer, child_id, params, output_kind, parent_id="p", index=index)


def _step_children(processor, tokens_by_child, step):
    outputs = []
    for child_id, token_ids in tokens_by_child.items():
        if step < len(token_ids):
            finished = step == len(token_ids) - 1
            reason = FinishReason.LENGTH if finished else None
            outputs.append(EngineCoreOutput(child_id, [token_ids[step]], finish_reason=reason))
    return processor.process_outputs(outputs)[0]


@pytest.mark.parametrize("output_kind", ["cumulative", "delta", "final"])
def test_n_children_fold_into_parent(tokenizer, output_kind):
    processor = OutputProcessor(tokenizer)
    _add_children(processor, tokenizer, SamplingParams(n=2), output_kind)
    # Child 1 is listed first and finishes first; outputs are still ordered by index.
    tokens = {"1_p": tokenizer.encode("Short."), "0_p": tokenizer.encode("A longer one here.")}
    texts, emitted = {0: "", 1: ""}, []
    for step in range(max(len(t) for t in tokens.values())):
        request_outputs = _step_children(processor, tokens, step)
        assert len(request_outputs) <= 1  # one output per parent per step
        for request_output in request_outputs:
            assert request_output.request_id == "p"
            assert [c.index for c in request_output.outputs] == sorted(
                c.index for c in request_output.outputs
            )
            emitted.append(request_output)
            for completion in request_output.outputs:
                if output_kind == "delta":
                    texts[completion.index] += completion.text
                else:
                    texts[completion.index] = completion.text
    assert [out.finished for out in emitted].count(True) == 1 and emitted[-1].finished
    assert texts == {0: "A longer one here.", 1: "Short."}
    if output_kind == "final":
        assert len(emitted) == 1
    if output_kind != "delta":
        assert [c.finish_reason for c in emitted[-1].outputs] == ["length", "length"]
    assert not processor.has_unfinished_requests() and not processor.parent_states


def test_child_params_rejected_for_parent(tokenizer):
    processor = OutputProcessor(tokenizer)
    _, index, child_params = make_child_requests("p", SamplingParams(n=2))[1]
    with pytest.raises(ValueError, match="parent's sampling_params"):
        _add(processor, tokenizer, "1_p", child_params, parent_id="p", index=index)
    assert not processor.has_unfinished_requests() and not processor.parent_states


def test_add_request_rejects_bad_input(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        _add(processor, tokenizer, "r", SamplingParams())
    with pytest.raises(ValueError, match="output_kind"):
        _add(processor, tokenizer, "s", SamplingParams(), "stream")


def _logprob_rows(token_ids, k):
    """Sampled token (rank 2 when k > 0) then top-k tokens 100, 101, ... with made-up logprobs."""
    rows, values, ranks = [], [], []
    for i, token_id in enumerate(token_ids):
        rows.append([token_id, *range(100, 100 + k)])
        values.append([-0.5 - i, *(-0.1 * (j + 1) for j in range(k))])
        ranks.append(2 if k else 1)
    return LogprobsLists(rows, values, ranks)


@pytest.mark.parametrize("output_kind", ["cumulative", "delta"])
def test_logprobs_dicts_and_cumulative_logprob(tokenizer, output_kind):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams(logprobs=2), output_kind)
    token_ids = tokenizer.encode("Hi there")
    first, rest = token_ids[:1], token_ids[1:]
    out1 = EngineCoreOutput("r", first, new_logprobs=_logprob_rows(first, 2))
    rows = _logprob_rows(rest, 2)
    rows.logprobs = [[-1.5 - i, -0.1, -0.2] for i in range(len(rest))]
    out2 = EngineCoreOutput("r", rest, FinishReason.LENGTH, new_logprobs=rows)
    step1 = processor.process_outputs([out1])[0][0].outputs[0]
    step2 = processor.process_outputs([out2])[0][0].outputs[0]
    logprobs = step1.logprobs + step2.logprobs if output_kind == "delta" else step2.logprobs
    assert len(logprobs) == len(token_ids)
    expected_first = {
        first[0]: Logprob(-0.5, 2, tokenizer.decode(first)),
        100: Logprob(-0.1, 1, tokenizer.decode([100])),
        101: Logprob(-0.2, 2, tokenizer.decode([101])),
    }
    assert logprobs[0] == expected_first
    assert all(len(entry) == 3 for entry in logprobs)
    expected_sum = -0.5 + sum(-1.5 - i for i in range(len(rest)))
    assert math.isclose(step2.cumulative_logprob, expected_sum)
    assert math.isclose(step1.cumulative_logprob, -0.5)


def test_logprobs_zero_gives_only_sampled_token(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "r", SamplingParams(logprobs=0))
    token_ids = tokenizer.encode("Yes")
    out = EngineCoreOutput(
        "r", token_ids, FinishReason.LENGTH, new_logprobs=_logprob_rows(token_ids, 0)
    )
    completion = processor.process_outputs([out])[0][0].outputs[0]
    assert completion.logprobs == [{token_ids[0]: Logprob(-0.5, 1, "Yes")}]


def test_abort_requests_removes_state(tokenizer):
    processor = OutputProcessor(tokenizer)
    _add(processor, tokenizer, "plain", SamplingParams())
    _add_children(processor, tokenizer, SamplingParams(n=2), "cumulative")
    assert processor.get_num_unfinished_requests() == 3
    assert processor.abort_requests(["plain", "nope"]) == ["plain"]
    assert processor.abort_requests(["1_p"]) == ["0_p", "1_p"]  # the whole family
    assert not processor.has_unfinished_requests() and not processor.parent_states
    late = [EngineCoreOutput("plain", [42]), EngineCoreOutput("0_p", [42])]
    assert processor.process_outputs(late) == ([], [])


@pytest.mark.parametrize(
    "prompt_token_ids, match",
    [([-1], r"\[-1\] are outside the vocabulary"), ([5, 10**30], "outside"), ([], "empty")],
)
def test_processor_refuses_a_bad_prompt_before_anything_decodes_it(
    tokenizer, prompt_token_ids, match
):
    # The detokenizer decodes the prompt's last tokens as soon as a request is registered; an id
    # outside the vocabulary made it raise OverflowError (an HTTP 500) before the range check.
    output_processor = OutputProcessor(tokenizer)
    info = EngineCoreInfo(num_blocks=8, block_size=16, max_model_len=64, vocab_size=len(tokenizer))
    processor = Processor(EngineConfig(), tokenizer, output_processor, info)
    params = SamplingParams(n=3)
    with pytest.raises(ValueError, match=match) as error:
        processor.process("cmpl-7", None, prompt_token_ids, params, "final")
    assert "'cmpl-7'" in str(error.value) and "_cmpl-7" not in str(error.value)
    assert not output_processor.has_unfinished_requests() and not output_processor.parent_states
    processor.process("cmpl-7", None, [5, 6], params, "final")
    with pytest.raises(ValueError, match="'cmpl-7' is already in use"):
        processor.process("cmpl-7", None, [5, 6], params, "final")


def test_a_childs_error_names_its_parent():
    error = ValueError("request '1_cmpl-7' cannot be encoded: integer out of range")
    parent_error = as_parent_error(error, "1_cmpl-7", "cmpl-7")
    assert str(parent_error) == "request 'cmpl-7' cannot be encoded: integer out of range"


def test_an_embedding_request_gets_its_vector_once() -> None:
    processor = OutputProcessor(None)
    processor.add_pooling_request(PoolingState("e", [1, 2, 3], PoolingParams()))
    processor.add_pooling_request(
        PoolingState("raw", [4], PoolingParams(normalize=False, dimensions=2))
    )
    with pytest.raises(ValueError, match="already running"):
        processor.add_pooling_request(PoolingState("e", [1], PoolingParams()))
    outputs, to_abort = processor.process_outputs(
        [
            EngineCoreOutput("e", [], FinishReason.STOP, pooling_output=[3.0, 4.0]),
            EngineCoreOutput("raw", [], FinishReason.STOP, pooling_output=[3.0, 4.0, 5.0]),
        ]
    )
    assert to_abort == [] and not processor.has_unfinished_requests()
    assert [o.outputs.embedding for o in outputs] == [[0.6, 0.8], [3.0, 4.0]]
    assert outputs[0].prompt_token_ids == [1, 2, 3] and outputs[0].finished


def test_a_classification_request_gets_its_class_scores() -> None:
    processor = OutputProcessor(None)
    processor.add_pooling_request(PoolingState("c", [7, 8], PoolingParams(), "softmax"))
    logits = [0.0, math.log(3.0)]
    outputs, _ = processor.process_outputs(
        [EngineCoreOutput("c", [], FinishReason.STOP, pooling_output=logits)]
    )
    (output,) = outputs
    assert isinstance(output, ClassificationRequestOutput) and output.finished
    assert output.outputs.probs == pytest.approx([0.25, 0.75])
    assert output.prompt_token_ids == [7, 8] and not processor.has_unfinished_requests()


def test_an_embedding_request_the_core_refused_ends_with_its_reason() -> None:
    processor = OutputProcessor(None)
    processor.add_pooling_request(PoolingState("e", [1, 2, 3], PoolingParams()))
    processor.add_pooling_request(PoolingState("gone", [5], PoolingParams()))
    assert processor.abort_requests(["gone"]) == ["gone"]
    (output,), _ = processor.process_outputs(
        [EngineCoreOutput("e", [], FinishReason.ABORT), EngineCoreOutput("gone", [])]
    )
    assert isinstance(output, RequestOutput) and output.finished
    assert output.outputs[0].finish_reason == "abort"
