"""Structural tags (vLLM's `structural_tag`): both of vLLM's forms compile to a grammar that lets
text run free and constrains the tagged parts, checked with xgrammar's matcher over SmolLM2's
tokenizer; malformed tags are ValueErrors naming the field, without xgrammar's C++ noise."""

from __future__ import annotations

import json

import pytest

from v1engine.structured_outputs import StructuredOutputsParams
from v1engine.structured_outputs.backend import GrammarBackend, import_xgrammar

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
LEGACY = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
    "triggers": ["<f"],
}
FORMAT = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<f>",
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</f>",
    },
}


@pytest.fixture(scope="module")
def backend():
    from transformers import AutoTokenizer

    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(prepare_checkpoint(default_model_path()))
    backend = GrammarBackend("smollm2", lambda: tokenizer, len(tokenizer))
    yield backend
    backend.shutdown()


def _accepts(backend, tag, text: str) -> bool:
    grammar = backend.compile(StructuredOutputsParams(structural_tag=tag))
    matcher = import_xgrammar().GrammarMatcher(grammar)
    return matcher.accept_string(text)


@pytest.mark.parametrize("as_text", [False, True])
def test_the_legacy_form_frees_the_text_and_constrains_each_tag(backend, as_text):
    tag = json.dumps(LEGACY) if as_text else LEGACY
    assert _accepts(backend, tag, 'Let me call it: <f>{"x": 12}</f> and more text')
    assert not _accepts(backend, tag, "Let me call it: <f>not json")
    assert not _accepts(backend, tag, '<f>{"y": 1}</f>')  # x is required


def test_xgrammars_format_form(backend):
    assert _accepts(backend, FORMAT, '<f>{"x": 3}</f>')
    assert not _accepts(backend, FORMAT, 'free text <f>{"x": 3}</f>')  # a tag, and only it


@pytest.mark.parametrize(
    "tag, words",
    [
        ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized"),
        ({"type": "structural_tag", "structures": [{"begin": "<f>"}], "triggers": []}, "schema"),
    ],
)
def test_a_malformed_tag_names_the_field_and_says_why(backend, tag, words):
    with pytest.raises(ValueError, match="StructuredOutputsParams.structural_tag") as info:
        backend.compile(StructuredOutputsParams(structural_tag=tag))
    assert words in str(info.value) and "Check failed" not in str(info.value)


@pytest.mark.parametrize("tag", ["{not json", '["a list"]', 3])
def test_a_tag_that_is_not_a_json_object_is_refused_at_once(tag):
    with pytest.raises(ValueError, match="StructuredOutputsParams.structural_tag"):
        StructuredOutputsParams(structural_tag=tag)
