"""The qwen3_coder tool-call parser (`--tool-call-parser qwen3_coder`: Qwen3-Coder and the Qwen
models trained on its format). Each call is XML-like text,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

and the text before the first `<tool_call>` is the message's content. A parameter's value is raw
text (less one newline after its opening tag and one before its closing tag), typed as vLLM's
parser types it, by the function's schema in the request's `tools`: "null" is null; "string"
stays text; "integer" and "number" are numbers (a whole number an integer); "boolean" is true
or false; an object or array is JSON, or a Python literal (read by `ast`, never run). A
parameter the schema does not list stays text. The arguments are the JSON object of the values.
A reply whose calls are not well-formed stays content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from v1engine.engine.detokenizer import partial_stop_len
from v1engine.entrypoints.openai.forced_calls import ForcedCall, new_call_id

# Function name -> the JSON schema of its parameters, from the request's tools.
Schemas = dict[str, dict[str, Any]]

QWEN3_CODER_MARKER = "<tool_call>"
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
_FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")


def parse_qwen3_coder(text: str, schemas: Schemas) -> tuple[str | None, list[tuple[str, str]]]:
    """`(content or None, [(name, arguments JSON)])`; no calls where the text holds no whole
    ones (it then stays content). The text is read as a stream would read it."""
    reader = Qwen3CoderCallReader(schemas)
    reader.feed(text)
    if not reader.calls or reader.in_function:  # none, or the last one cut off
        return text, []
    calls = [(call.name, call.arguments) for call in reader.calls]
    marker = text.find(QWEN3_CODER_MARKER)
    content = text[: marker if 0 <= marker < reader.first_call_at else reader.first_call_at]
    return content.strip() or None, calls


def _parameter_schema(schemas: Schemas, function: str, key: str) -> dict[str, Any] | None:
    properties = (schemas.get(function) or {}).get("properties") or {}
    schema = properties.get(key)
    return schema if isinstance(schema, dict) else None


def typed_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's raw text as the value its schema types (see the module docstring)."""
    value = raw.removeprefix("\n").removesuffix("\n")
    if schema is None:
        return value
    if value.strip().lower() == "null":
        return None
    kind = schema.get("type", "string")
    if isinstance(kind, list):  # e.g. ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "string":
        return value
    if kind in ("integer", "number"):
        try:
            number = float(value.strip()) if kind == "number" else int(value.strip())
        except ValueError:
            return value
        return int(number) if kind == "number" and number.is_integer() else number
    if kind == "boolean":
        lowered = value.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else value
    for read in (json.loads, ast.literal_eval):
        try:
            return read(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


class Qwen3CoderCallReader:
    """Qwen3-Coder calls read while the reply grows: a call's id and name go out once its
    `<function=...>` tag is written, then its arguments a parameter at a time, as JSON (`{` and
    the first `"key": value`, then `, "key": value` for each next one, `}` at `</function>`), as
    vLLM streams them. A parameter is read to its closing tag, whatever its value holds (code
    that writes `</function>`, say)."""

    def __init__(self, schemas: Schemas) -> None:
        self.schemas = schemas
        self.calls: list[ForcedCall] = []
        self.in_function = False
        self.first_call_at = -1  # where the first `<function=` tag starts
        self._text = ""
        self._read = 0  # text[:_read] is consumed
        self._num_parameters = 0  # of the open call
        # The open parameter's name and where its value starts; None between parameters.
        self._key: str | None = None
        self._value_start = 0

    def feed(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        self._text += delta
        pieces = []
        while True:
            piece = self._read_function() if self.in_function else self._open_function()
            if piece is None:
                return pieces
            pieces.append(piece)

    def _open_function(self) -> tuple[int, ForcedCall | None, str] | None:
        """The next call's head, once its tag is whole (the text before it is not read)."""
        start = self._text.find("<function=", self._read)
        if start < 0:  # keep only what may begin a tag
            hold = partial_stop_len(self._text[self._read :], ["<function="])
            self._read = len(self._text) - hold
            return None
        self._read = start
        match = _FUNCTION_OPEN.match(self._text, start)
        if match is None:
            return None  # its name is still being written
        if not self.calls:
            self.first_call_at = start
        self.calls.append(ForcedCall(new_call_id(), match.group(1).strip()))
        self.in_function, self._num_parameters = True, 0
        self._read = match.end()
        return len(self.calls) - 1, self.calls[-1], ""

    def _read_function(self) -> tuple[int, ForcedCall | None, str] | None:
        """The open call's next parameter, or its end, once written whole. A value is searched
        for its closing tag only where the text grew, so a long one streams in linear time."""
        if self._key is None:  # between parameters: the next one opens, or the call ends
            opened = self._text.find("<parameter=", self._read)
            end = self._text.find("</function>", self._read)
            if end >= 0 and (opened < 0 or end < opened):
                self.in_function, self._read = False, end + len("</function>")
                return self._arguments("}" if self._num_parameters else "{}")
            tag = None if opened < 0 else _PARAMETER_OPEN.match(self._text, opened)
            if tag is None:
                return None  # not yet, or its tag is still being written
            self._key, self._value_start = tag.group(1).strip(), tag.end()
            self._read = tag.end()
        close = self._text.find("</parameter>", self._read)
        if close < 0:  # what may be the start of the closing tag is searched again
            self._read = max(self._read, len(self._text) - len("</parameter>") + 1)
            return None
        call, key = self.calls[-1], self._key
        raw = self._text[self._value_start : close]
        value = typed_value(raw, _parameter_schema(self.schemas, call.name, key))
        text = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._key, self._read = None, close + len("</parameter>")
        self._num_parameters += 1
        return self._arguments(("{" if self._num_parameters == 1 else ", ") + text)

    def _arguments(self, text: str) -> tuple[int, ForcedCall | None, str]:
        self.calls[-1].arguments += text
        return len(self.calls) - 1, None, text
