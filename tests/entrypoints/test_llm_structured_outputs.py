"""Structured outputs end to end through `LLM` on a random 2-layer llama with SmolLM2's tokenizer:
a random model constrained by a grammar still produces output that fits it. 50 prompts x 3 JSON
schemas (nested objects, arrays, enums, required fields), choice, regex, a grammar, chat, n > 1
with a seed, a mixed batch, invalid grammars, TP=2 against TP=1, and speculative decoding.

The schemas bound every string, number and array, and whitespace is off, so every output ends
(the grammar's stop token) well within max_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from v1engine.entrypoints.llm import LLM
from v1engine.sampling_params import SamplingParams
from v1engine.structured_outputs import StructuredOutputsParams

_ENGINE_ARGS = dict(
    device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20
)
# A pattern, not maxLength: xgrammar 0.2.8's length-bounded strings let raw control characters
# through (strict JSON parsers refuse them); its pattern strings do not.
_SHORT = {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"}
NESTED = {
    "type": "object",
    "properties": {
        "name": _SHORT,
        "address": {
            "type": "object",
            "properties": {
                "city": _SHORT,
                "zip": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "address"],
    "additionalProperties": False,
}
ARRAYS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "maxItems": 3,
        },
    },
    "required": ["tags", "scores"],
    "additionalProperties": False,
}
ENUMS = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["color", "size", "ok", "count"],
    "additionalProperties": False,
}
PROMPTS = [
    f"Item {i}: tell me about {word}"
    for i, word in enumerate(["cats", "rain", "jazz", "tea", "maps"] * 10)
]
REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]


def constrained(max_tokens: int = 80, **structured) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **structured)
        if "json" in structured
        else StructuredOutputsParams(**structured),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint, **_ENGINE_ARGS) as llm:
        yield llm


def texts(outputs) -> list[str]:
    return [out.outputs[0].text for out in outputs]


@pytest.mark.parametrize("schema", [NESTED, ARRAYS, ENUMS], ids=["nested", "arrays", "enums"])
def test_every_output_validates_against_its_schema(llm, schema) -> None:
    outputs = llm.generate(PROMPTS, constrained(json=schema), use_tqdm=False)
    assert len(outputs) == 50
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0]
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_choice_regex_and_grammar(llm) -> None:
    prompts = PROMPTS[:8]
    for text in texts(llm.generate(prompts, constrained(choice=CHOICES), use_tqdm=False)):
        assert text in CHOICES
    for text in texts(llm.generate(prompts, constrained(regex=REGEX), use_tqdm=False)):
        assert re.fullmatch(REGEX, text), text
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for text in texts(llm.generate(prompts, constrained(grammar=grammar), use_tqdm=False)):
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text), text


def test_chat_with_a_schema(llm) -> None:
    messages = [{"role": "user", "content": "Pick a color and a size."}]
    [output] = llm.chat(messages, constrained(json=ENUMS), use_tqdm=False)
    jsonschema.validate(json.loads(output.outputs[0].text), ENUMS)


def test_seeded_n2_children_each_follow_the_schema(llm) -> None:
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=NESTED, disable_any_whitespace=True),
    )
    first = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    again = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for output in first:
        assert len(output.outputs) == 2
        for child in output.outputs:
            jsonschema.validate(json.loads(child.text), NESTED)
    assert [[c.token_ids for c in o.outputs] for o in first] == [
        [c.token_ids for c in o.outputs] for o in again
    ]
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in first)


def test_unconstrained_requests_in_a_mixed_batch_are_unchanged(llm) -> None:
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:4], plain, use_tqdm=False)
    params = [plain, constrained(json=ENUMS), plain, constrained(regex=REGEX), plain, plain]
    prompts = PROMPTS[:1] + PROMPTS[10:11] + PROMPTS[1:2] + PROMPTS[11:12] + PROMPTS[2:4]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    plain_mixed = [mixed[i] for i in (0, 2, 4, 5)]
    assert [o.outputs[0].token_ids for o in plain_mixed] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), ENUMS)


@pytest.mark.parametrize(
    "structured, named",
    [
        (dict(json='{"type": "objekt"}'), "StructuredOutputsParams.json"),
        (dict(json="{not json"), "StructuredOutputsParams.json"),
        (dict(regex="[a-"), "StructuredOutputsParams.regex"),
        (dict(grammar="root ::= missing_rule"), "StructuredOutputsParams.grammar"),
        (dict(json={"type": "object"}, whitespace_pattern=r"\s*"), "whitespace_pattern"),
    ],
)
def test_an_invalid_constraint_raises_value_error_naming_it(llm, structured, named) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured))
    with pytest.raises(ValueError, match=re.escape(named)):
        llm.generate(["hello"], params, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


def test_greedy_outputs_match_at_tp2(llm, checkpoint) -> None:
    prompts = PROMPTS[:6]
    per_schema = [constrained(json=s) for s in (NESTED, ARRAYS, ENUMS)] + [constrained(regex=REGEX)]
    tp1 = [texts(llm.generate(prompts, params, use_tqdm=False)) for params in per_schema]
    with LLM(checkpoint, tensor_parallel_size=2, **_ENGINE_ARGS) as tp2_llm:
        tp2 = [texts(tp2_llm.generate(prompts, params, use_tqdm=False)) for params in per_schema]
    assert tp1 == tp2


def test_speculative_decoding_keeps_greedy_outputs_in_the_grammar(llm, checkpoint) -> None:
    """n-gram drafts for structured requests: the core keeps those the grammar accepts and
    sends a bitmask row for each; greedy outputs are plain decoding's, sampled ones fit."""
    prompts = PROMPTS[:6]
    per_schema = [constrained(json=s) for s in (NESTED, ARRAYS, ENUMS)] + [constrained(regex=REGEX)]
    plain = [texts(llm.generate(prompts, params, use_tqdm=False)) for params in per_schema]
    spec_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with LLM(checkpoint, speculative_config=spec_config, **_ENGINE_ARGS) as spec_llm:
        spec = [texts(spec_llm.generate(prompts, p, use_tqdm=False)) for p in per_schema]
        sampled = SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=80,
            structured_outputs=StructuredOutputsParams(json=NESTED, disable_any_whitespace=True),
        )
        for text in texts(spec_llm.generate(PROMPTS[:8], sampled, use_tqdm=False)):
            jsonschema.validate(json.loads(text), NESTED)
        stats = spec_llm.engine_core.scheduler.make_stats()
    assert spec == plain
    assert stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens > 0
