"""StructuredOutputsParams: exactly one constraint, checked shapes, the cache key, and the msgspec
wire between the client and the engine core (inside SamplingParams)."""

from __future__ import annotations

import msgspec
import pytest

from v1engine.request import EngineCoreRequest
from v1engine.sampling_params import SamplingParams
from v1engine.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        (dict(json=SCHEMA), "json"),
        (dict(json='{"type": "string"}'), "json"),
        (dict(json_object=True), "json_object"),
        (dict(regex=r"\d+"), "regex"),
        (dict(choice=("yes", "no")), "choice"),
        (dict(grammar='root ::= "x"'), "grammar"),
    ],
)
def test_one_constraint_names_its_kind(kwargs, kind) -> None:
    assert StructuredOutputsParams(**kwargs).kind == kind


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of json, json_object, regex, choice, grammar, structural_tag, got 0"),
        (dict(json=SCHEMA, regex="a"), "got 2: ['json', 'regex']"),
        (dict(json_object=False), "json_object must be True"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice must be a non-empty list"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(grammar="  "), "grammar must be a non-empty string"),
    ],
)
def test_bad_shapes_raise_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match="StructuredOutputsParams") as info:
        StructuredOutputsParams(**kwargs)
    assert message in str(info.value)


def test_sampling_params_take_a_dict_and_refuse_other_types() -> None:
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs="json")
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "grammar": "root ::= 'a'"})


def test_cache_key_ignores_dict_key_order_but_not_whitespace_mode() -> None:
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json={"required": ["x"], "type": "object"})
    compact = StructuredOutputsParams(json=a.json, disable_any_whitespace=True)
    assert a.cache_key == b.cache_key != compact.cache_key
    assert (
        StructuredOutputsParams(regex="a").cache_key
        != StructuredOutputsParams(grammar="a").cache_key
    )


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(json='{"type": "string"}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-z]{3}"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='root ::= "x" | "y"'),
    ],
)
def test_round_trips_the_client_core_wire(structured) -> None:
    request = EngineCoreRequest("r", [1, 2], SamplingParams(seed=3, structured_outputs=structured))
    decoded = msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.encode(request))
    assert isinstance(decoded.sampling_params.structured_outputs, StructuredOutputsParams)
    assert decoded.sampling_params == request.sampling_params


def test_an_invalid_params_on_the_wire_is_refused() -> None:
    # What a client that skipped the checks could send: decoding runs __post_init__ again.
    request = EngineCoreRequest("r", [1], SamplingParams())
    raw = msgspec.msgpack.encode(request)
    fields = msgspec.msgpack.decode(raw)
    fields[2]["structured_outputs"] = {"regex": "a", "choice": ["b"]}
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.encode(fields))
