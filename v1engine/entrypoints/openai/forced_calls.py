"""Tool calls read out of a forced tool choice's text while it grows, so that a stream sends each
call's name as soon as it is written and its arguments as they come (as OpenAI and vLLM stream
them), and a whole reply is read the same way.

The grammar makes the text a prefix of valid JSON: for a named function, the function's
arguments object; for "required", an array of `{"name": ..., "parameters": {...}}` objects, one
per call. A call's arguments are its `parameters` exactly as written (so the streamed pieces
add up to them); a call whose name is not written yet is not a call yet.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

_OPENERS, _CLOSERS = "{[", "}]"


@dataclass
class ForcedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class _Element:
    """One object of the "required" array, as far as it is written."""

    name: str | None = None
    key: str | None = None  # the key whose value is being read
    reading_key: bool = True  # the next string at the object's depth is a key
    args_start: int | None = None  # where the arguments' value starts in the text
    args_end: int | None = None  # where it ends, once it has
    waiting_for_args: bool = False  # after the arguments' key and its colon, before the value
    call: ForcedCall | None = None


@dataclass
class ForcedCallReader:
    """`feed` the text as it grows; it returns each call's new pieces: `(call index, the call
    when it is new, the arguments written since)`. `calls` holds the calls so far.
    `argument_keys`: the keys an array item's arguments may be under (hermes writes
    `"arguments"`; see tool_parsers.HermesCallReader)."""

    named: str | None  # the named function, or None for "required"
    argument_keys: tuple[str, ...] = ("parameters",)
    calls: list[ForcedCall] = field(default_factory=list)
    _text: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _element: _Element | None = None
    _pieces: list[tuple[int, ForcedCall | None, str]] = field(default_factory=list)

    def feed(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        start = len(self._text)
        self._text += delta
        if self.named is not None:
            return self._feed_named(delta)
        self._pieces = []
        for index in range(start, len(self._text)):
            self._scan(index)
        self._take_pieces()
        return _merge(self._pieces)

    def _feed_named(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        if not delta:
            return []
        new = None
        if not self.calls:
            new = _new_call(self.named)
            self.calls.append(new)
        self.calls[0].arguments += delta
        return [(0, new, delta)]

    def _scan(self, index: int) -> None:
        """Advances the JSON state over the text's character at `index`."""
        char = self._text[index]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self._end_string(index)
            return
        element = self._element
        if element is not None and element.waiting_for_args and not char.isspace():
            element.waiting_for_args, element.args_start = False, index
        if char == '"':
            self._in_string, self._string_start = True, index
        elif char in _OPENERS:
            self._depth += 1
            if self._depth == 2 and char == "{":
                self._take_pieces()  # the previous element's last ones
                self._element = _Element()
        elif char in _CLOSERS:
            self._depth -= 1
            if element is not None and self._in_arguments(element):
                # The arguments' object closes (back at the element's depth), or the element
                # closes right after a value that is not an object.
                if self._depth == 2:
                    element.args_end = index + 1
                elif self._depth == 1:
                    element.args_end = index
        elif element is not None and self._depth == 2:
            self._at_object_depth(element, char, index)

    def _at_object_depth(self, element: _Element, char: str, index: int) -> None:
        if char == ":":
            element.reading_key = False
            element.waiting_for_args = element.key in self.argument_keys
        elif char == ",":
            if self._in_arguments(element):
                element.args_end = index  # a value that is not an object ends here
            element.reading_key, element.key = True, None

    def _in_arguments(self, element: _Element) -> bool:
        return element.key in self.argument_keys and element.args_end is None

    def _end_string(self, index: int) -> None:
        element = self._element
        if element is None or self._depth != 2:
            return
        value = json.loads(self._text[self._string_start : index + 1])
        if element.reading_key:
            element.key = value
        elif element.key == "name":
            element.name = value

    def _take_pieces(self) -> None:
        """Adds to `_pieces` the current element's call, once it has a name, and the
        arguments written since (the text is scanned to its end, or the element closed)."""
        element = self._element
        if element is None or element.name is None:
            return
        new = None
        if element.call is None:
            element.call = new = _new_call(element.name)
            self.calls.append(new)
        index = len(self.calls) - 1  # the current element's call is the latest
        if element.args_start is None:
            if new is not None:
                self._pieces.append((index, new, ""))
            return
        end = element.args_end
        if end is None:
            # Inside an object the text so far is its own; any other value waits for its end.
            opened = self._text[element.args_start] in _OPENERS
            end = len(self._text) if opened else element.args_start
        arguments = self._text[element.args_start : end].rstrip()
        call = element.call
        delta = arguments[len(call.arguments) :]
        call.arguments = arguments
        if new is not None or delta:
            self._pieces.append((index, new, delta))


class MarkedCallReader:
    """The base of a parser's reader that finds calls after a marker in the text and feeds them
    to a ForcedCallReader as the items of its array (tool_parsers.HermesCallReader,
    tool_parser_mistral.MistralCallReader); a call's arguments are its `"arguments"`."""

    def __init__(self, marker: str) -> None:
        self.reader = ForcedCallReader(None, argument_keys=("arguments",))
        self.marker = marker
        self._text = ""
        self._read = 0  # text[:_read] is consumed

    @property
    def calls(self) -> list[ForcedCall]:
        return self.reader.calls

    def _find_marker(self) -> int:
        """Where the next marker starts, or -1, having skipped the text before what may begin
        one."""
        start = self._text.find(self.marker, self._read)
        if start < 0:
            self._read = max(self._read, len(self._text) - len(self.marker) + 1)
        return start


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _new_call(name: str) -> ForcedCall:
    return ForcedCall(id=new_call_id(), name=name)


def _merge(
    pieces: list[tuple[int, ForcedCall | None, str]],
) -> list[tuple[int, ForcedCall | None, str]]:
    """One piece per call: its head (if new in these pieces) and its arguments joined."""
    merged: dict[int, tuple[ForcedCall | None, str]] = {}
    for index, new, delta in pieces:
        head, arguments = merged.get(index, (None, ""))
        merged[index] = (head or new, arguments + delta)
    return [(index, head, arguments) for index, (head, arguments) in merged.items()]
