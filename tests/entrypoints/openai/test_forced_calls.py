"""Reading forced tool calls out of growing JSON text: whatever the text's pieces, each call's
head comes once its name is written and its pieces add up to its `parameters` exactly as
written; strings with quotes and braces, nested values, any key order and a cut text."""

from __future__ import annotations

import pytest

from v1engine.entrypoints.openai.forced_calls import ForcedCallReader

REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "deep": {"a": [1, {"b": 2}]}}}, '
    '{"parameters": {"zone": "UTC"}, "name": "get_time"},{"name":"ping","parameters":{}}]'
)
EXPECTED = [
    ("get_weather", '{"city": "Pa\\"ris}", "deep": {"a": [1, {"b": 2}]}}'),
    ("get_time", '{"zone": "UTC"}'),
    ("ping", "{}"),
]


def _read(named: str | None, text: str, step: int) -> tuple[ForcedCallReader, dict]:
    reader, streamed = ForcedCallReader(named), {}
    for start in range(0, len(text), step):
        for index, new, arguments in reader.feed(text[start : start + step]):
            if new is not None:
                assert index not in streamed, "a call's head comes once"
                streamed[index] = [new.name, ""]
            streamed[index][1] += arguments
    return reader, streamed


@pytest.mark.parametrize("step", [1, 2, 5, 13, len(REQUIRED)])
def test_required_calls_add_up_whatever_the_pieces(step) -> None:
    reader, streamed = _read(None, REQUIRED, step)
    assert [(c.name, c.arguments) for c in reader.calls] == EXPECTED
    assert [tuple(streamed[i]) for i in sorted(streamed)] == EXPECTED
    assert len({c.id for c in reader.calls}) == 3


def test_arguments_stream_while_their_object_is_open() -> None:
    reader = ForcedCallReader(None)
    ((index, new, arguments),) = reader.feed('[{"name": "f", "param')  # the head, at once
    assert (index, new.name, arguments) == (0, "f", "")
    assert reader.feed('eters": {"a": ') == [(0, None, '{"a":')]  # trailing whitespace waits
    assert reader.feed("1}") == [(0, None, " 1}")]
    assert reader.feed('}, {"name": "g", "parameters": {}}]') == [(1, reader.calls[1], "{}")]


def test_a_call_is_not_a_call_before_its_name_is_written() -> None:
    reader = ForcedCallReader(None)
    assert reader.feed('[{"parameters": {"x": 1}, "na') == []
    ((_, new, arguments),) = reader.feed('me": "late"}]')
    assert (new.name, arguments) == ("late", '{"x": 1}')


def test_a_value_that_is_not_an_object_comes_when_it_ends() -> None:
    reader, _ = _read(None, '[{"name": "a", "parameters": "s"}, {"parameters": 5, "name": "b"}]', 1)
    assert [(c.name, c.arguments) for c in reader.calls] == [("a", '"s"'), ("b", "5")]


def test_a_named_functions_text_is_its_arguments() -> None:
    reader, streamed = _read("get_time", '{"zone": "U', 3)
    assert streamed == {0: ["get_time", '{"zone": "U']}
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_time", '{"zone": "U')]
    assert ForcedCallReader("f").feed("") == []
