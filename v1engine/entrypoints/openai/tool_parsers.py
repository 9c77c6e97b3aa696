"""Tool-call parsers for `tool_choice: "auto"` (vLLM's `--tool-call-parser`): they find the calls a
model wrote in its text. Each returns `(content or None, [(name, arguments as JSON text)])`, and
no calls where the text does not hold well-formed ones (it then stays content, as vLLM leaves it).

- hermes (Hermes, Qwen and many tool-tuned models): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first call is
  the message's content.
- llama3_json (Llama 3.1-3.3's JSON tool calling): the whole reply is one or more
  `{"name": ..., "parameters": {...}}` objects (or `"arguments"`), separated by `;`, perhaps after
  `<|python_tag|>`; no content.
- pythonic (Llama 3.2 and 4, and others): the whole reply is a Python list of calls with literal
  keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, perhaps between
  `<|python_start|>` and `<|python_end|>`; no content. It is read with `ast` (literals only:
  nothing in it runs).

- mistral (Mistral 7B Instruct v0.3, Mistral Small, Devstral, ...): calls after the
  `[TOOL_CALLS]` special token (tool_parser_mistral.py).

- qwen3_coder (Qwen3-Coder): XML-like calls typed by the request's tool schemas, which only
  this parser reads (tool_parser_qwen3_coder.py).
- granite (Granite 3.x): the whole reply is `<|tool_call|>` (or `<tool_call>`, or nothing) and
  a JSON array of `{"name", "arguments"}` objects; `<|tool_call|>` is a special token, so such
  requests keep special tokens. phi4_mini_json (Phi-4-mini): the same array after `functools`.

A stream reads the calls while they are written (`HermesCallReader`, `LeadingCallReader`'s kinds,
`PythonicCallReader`, `MistralCallReader`); `content_end` says how much of a reply may stream as
content.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any

from v1engine.engine.detokenizer import partial_stop_len
from v1engine.entrypoints.openai.forced_calls import (
    ForcedCall,
    ForcedCallReader,
    MarkedCallReader,
    new_call_id,
)
from v1engine.entrypoints.openai.tool_parser_mistral import (
    MISTRAL_MARKER,
    mistral_call_id,
    parse_mistral,
)
from v1engine.entrypoints.openai.tool_parser_qwen3_coder import Schemas, parse_qwen3_coder

Calls = list[tuple[str, str]]
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, Calls]:
    calls = []
    for match in _HERMES_CALL.finditer(text):
        call = _json_call(match.group(1), ("arguments",))
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, Calls]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, position = [], json.JSONDecoder(), 0
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        call = _as_call(value, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        position = _skip_separator(body, end)
        if position is None:
            return text, []
    return None, calls


def parse_granite(text: str) -> tuple[str | None, Calls]:
    return _parse_leading_array(text, _GRANITE_TAGS, tag_required=False)


def parse_phi4_mini_json(text: str) -> tuple[str | None, Calls]:
    return _parse_leading_array(text, _PHI4_TAGS, tag_required=True)


def _parse_leading_array(
    text: str, tags: tuple[str, ...], tag_required: bool
) -> tuple[str | None, Calls]:
    """A reply that is one of `tags` (optional unless `tag_required`) and a JSON array of call
    objects: no content."""
    body = text.strip()
    tag = next((tag for tag in tags if body.startswith(tag)), None)
    if tag is None and tag_required:
        return text, []
    body = body.removeprefix(tag or "").strip()
    try:
        value = json.loads(body) if body.startswith("[") else None
    except ValueError:
        value = None
    calls = [_as_call(item, ("arguments", "parameters")) for item in value or []]
    if not calls or None in calls:
        return text, []
    return None, calls


def parse_pythonic(text: str) -> tuple[str | None, Calls]:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        calls = _python_calls(ast.parse(body, mode="eval").body)
    # Not a list of calls with literal keyword arguments (a name, a call, **kwargs, bytes), or
    # nested too deeply to read: nothing is evaluated either way.
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return text, []
    return None, calls


def _python_calls(tree: ast.expr) -> Calls:
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            raise ValueError("not a call with keyword arguments only")
        if any(keyword.arg is None for keyword in node.keywords):
            raise ValueError("**kwargs")
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _json_call(text: str, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    try:
        return _as_call(json.loads(text), argument_keys)
    except ValueError:
        return None


def _as_call(value: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """`(name, arguments JSON)` of a call object: a string `name` and its arguments under the
    first of `argument_keys` it has (none: no arguments)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in argument_keys if key in value), {})
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _skip_separator(body: str, position: int) -> int | None:
    """Where the next call starts after one ends at `position` (whitespace, then `;` or `,`
    between calls), the end of the text, or None for anything else."""
    rest = body[position:].lstrip()
    if not rest:
        return len(body)
    if rest[0] not in ";,":
        return None
    rest = rest[1:].lstrip()
    return len(body) - len(rest)


# Where each parser's calls can begin, for streaming: at a marker anywhere (the content before
# it streams), or only at the reply's start (a reply that starts otherwise is all content).
_CALL_MARKERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": MISTRAL_MARKER}
# The parsers whose marker is a special token: their requests keep special tokens in the text.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "granite"})
_GRANITE_TAGS = ("<|tool_call|>", "<tool_call>")
_PHI4_TAGS = ("functools",)
_CALL_STARTS = {
    "llama3_json": ("{", "<|python_tag|>"),
    "pythonic": ("[", "<|python_start|>"),
    "granite": ("[", *_GRANITE_TAGS),
    "phi4_mini_json": _PHI4_TAGS,
}


def content_end(parser: str, text: str) -> int:
    """How much of `text`, a reply so far, is surely content (not the start of a call, nor
    whitespace that may precede one): what a stream may send before the reply ends."""
    marker = _CALL_MARKERS.get(parser)
    if marker is not None:
        end = text.find(marker)
        if end < 0:
            end = len(text) - partial_stop_len(text, [marker])
        return len(text[:end].rstrip())
    stripped = text.lstrip()
    starts = _CALL_STARTS[parser]
    if not stripped or any(s.startswith(stripped) or stripped.startswith(s) for s in starts):
        return 0  # undecided, or perhaps calls: held until the reply ends
    return len(text)


class HermesCallReader(MarkedCallReader):
    """Hermes calls read while the reply grows, so a stream sends each call's id and name as soon
    as the name is written and its arguments as they come (as vLLM streams them). The bodies of
    the `<tool_call>` tags are fed to a ForcedCallReader as the items of its array: `[`, then
    each body (less a closing tag that may be only partly written), `,` between bodies. A call's
    arguments are its `"arguments"` exactly as written."""

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__(self._OPEN)
        self._in_call = False
        self._num_opened = 0

    def feed(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        self._text += delta
        array_text = ""
        while True:
            if not self._in_call:
                start = self._find_marker()  # text between calls is not read
                if start < 0:
                    break
                array_text += "," if self._num_opened else "["
                self._num_opened += 1
                self._in_call, self._read = True, start + len(self._OPEN)
                continue
            end = self._text.find(self._CLOSE, self._read)
            if end < 0:
                body = self._text[self._read :]
                hold = partial_stop_len(body, [self._CLOSE])
                array_text += body[: len(body) - hold]
                self._read = len(self._text) - hold
                break
            array_text += self._text[self._read : end]
            self._in_call, self._read = False, end + len(self._CLOSE)
        return self.reader.feed(array_text)


def _decided_body(text: str, tags: tuple[str, ...], tag_required: bool = False) -> str | None:
    """A reply so far after its leading whitespace and one of `tags` (which may open it; must,
    with `tag_required`: a reply without one is then decided as ""), once its first character
    after them is written; None while that is undecided."""
    body = text.lstrip()
    if any(tag.startswith(body) and body != tag for tag in tags):
        return None  # empty, or perhaps a tag
    tag = next((tag for tag in tags if body.startswith(tag)), None)
    if tag is None:
        return "" if tag_required else body
    return body.removeprefix(tag).lstrip() or None


class LeadingCallReader:
    """Calls that make up the whole reply, read while it grows: a reply that starts, after its
    leading whitespace and one of `tags` (which may open it, or must, with `tag_required`), with
    `start` holds calls. `{`: call objects (llama3_json's, separated by `;`), fed to a
    ForcedCallReader as the items of its array; `[`: that array itself (granite's,
    phi4_mini_json's). Until the reply's start decides, nothing is read; a reply that starts
    otherwise is content and holds no calls."""

    def __init__(
        self,
        tags: tuple[str, ...],
        start: str,
        argument_keys: tuple[str, ...] = ("arguments", "parameters"),
        tag_required: bool = False,
    ) -> None:
        self.reader = ForcedCallReader(None, argument_keys=argument_keys)
        self.tags, self.start, self.tag_required = tags, start, tag_required
        self._text = ""
        self._reading: bool | None = None  # None until the reply's start decides

    @property
    def calls(self) -> list[ForcedCall]:
        return self.reader.calls

    def feed(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        if self._reading is not None:
            return self.reader.feed(delta) if self._reading else []
        self._text += delta
        body = _decided_body(self._text, self.tags, self.tag_required)
        if body is None:
            return []
        self._reading = body.startswith(self.start)
        if not self._reading:
            return []
        return self.reader.feed(("[" if self.start == "{" else "") + body)


class Llama3JsonCallReader(LeadingCallReader):
    def __init__(self) -> None:
        super().__init__(("<|python_tag|>",), "{", ("parameters", "arguments"))


class GraniteCallReader(LeadingCallReader):
    def __init__(self) -> None:
        super().__init__(_GRANITE_TAGS, "[")


class Phi4MiniJsonCallReader(LeadingCallReader):
    def __init__(self) -> None:
        super().__init__(_PHI4_TAGS, "[", tag_required=True)


class PythonicCallReader:
    """pythonic calls read while the reply grows: each call of the list goes out once it is
    written whole (its closing parenthesis), read as the whole reply is (`_python_calls`: literals
    only, nothing runs), so its arguments are the whole reply's. Until the reply's start decides,
    nothing is read; a reply that starts otherwise is content and holds no calls."""

    _TAG = "<|python_start|>"

    def __init__(self) -> None:
        self.calls: list[ForcedCall] = []
        self._text = ""
        self._reading: bool | None = None  # None until the reply's start decides
        self._position = 0  # text[:_position] is scanned
        self._depth = 0
        self._quote: str | None = None  # the quote of the string being read
        self._escaped = False
        self._call_start: int | None = None  # where the call being written starts

    def feed(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        self._text += delta
        if self._reading is None:
            body = _decided_body(self._text, (self._TAG,))
            if body is None:
                return []
            self._reading = body.startswith("[")
            self._position = len(self._text) - len(body)
        pieces = []
        while self._reading and self._position < len(self._text):
            call = self._scan(self._text[self._position])
            self._position += 1
            if call is not None:
                self.calls.append(call)
                pieces.append((len(self.calls) - 1, call, call.arguments))
        return pieces

    def _scan(self, char: str) -> ForcedCall | None:
        """Advances over one character; returns the call it closes, if it closes one."""
        if self._quote is not None:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == self._quote:
                self._quote = None
        elif char in "'\"":
            self._quote = char
        elif char in "([{":
            self._depth += 1
        elif char in ")]}":
            self._depth -= 1
            if char == ")" and self._depth == 1 and self._call_start is not None:
                return self._end_call()
        elif self._depth == 1 and self._call_start is None and char not in " \t\n,":
            self._call_start = self._position
        return None

    def _end_call(self) -> ForcedCall | None:
        text = self._text[self._call_start : self._position + 1]
        self._call_start = None
        try:
            ((name, arguments),) = _python_calls(ast.parse(f"[{text}]", mode="eval").body)
        # Not a call the whole reply's parse would read (see parse_pythonic): neither it nor
        # any later call is streamed, as the reply cannot be read whole.
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            self._reading = False
            return None
        return ForcedCall(new_call_id(), name, arguments)


# The parsers whose models want call ids of their own form (others: forced_calls.new_call_id).
CALL_IDS: dict[str, Callable[[], str]] = {"mistral": mistral_call_id}


# (reply, the request's tool schemas) -> (content or None, calls).
ToolCallParser = Callable[[str, Schemas], tuple[str | None, Calls]]


def _untyped(parse: Callable[[str], tuple[str | None, Calls]]) -> ToolCallParser:
    return lambda text, _schemas: parse(text)


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    "granite": _untyped(parse_granite),
    "hermes": _untyped(parse_hermes),
    "llama3_json": _untyped(parse_llama3_json),
    "mistral": _untyped(parse_mistral),
    "phi4_mini_json": _untyped(parse_phi4_mini_json),
    "pythonic": _untyped(parse_pythonic),
    "qwen3_coder": parse_qwen3_coder,
}
