"""The mistral tool-call parser (`--tool-call-parser mistral`: Mistral 7B Instruct v0.3, Mistral
Small, Devstral, ...). Calls follow the `[TOOL_CALLS]` control token, as a JSON array of
`{"name", "arguments"}` objects (tokenizers before v11), or as `name{arguments}` /
`name[ARGS]{arguments}`, one per `[TOOL_CALLS]`; the text before the first is the content. The
token is special, so such requests keep special tokens in their text
(`tool_parsers.KEEPS_SPECIAL_TOKENS`), and their calls get Mistral's ids (9 letters and digits),
which Mistral's chat templates insist on when the calls come back in the conversation.
"""

from __future__ import annotations

import json
import re
import secrets
import string

from v1engine.engine.detokenizer import partial_stop_len
from v1engine.entrypoints.openai.forced_calls import ForcedCall, MarkedCallReader

MISTRAL_MARKER = "[TOOL_CALLS]"
_MAX_NAME_CHARS = 200


def parse_mistral(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """`(content or None, [(name, arguments JSON)])`; no calls where the text holds no whole
    ones (it then stays content)."""
    if MISTRAL_MARKER not in text:
        return text, []
    reader = MistralCallReader()
    reader.feed(text)
    calls = []
    for call in reader.calls:
        try:  # a call is whole only when its arguments are a JSON object, closed
            arguments = json.loads(call.arguments or "{}")
        except ValueError:
            return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append((call.name, json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.index(MISTRAL_MARKER)].strip()
    return content or None, calls


class MistralCallReader(MarkedCallReader):
    """Mistral calls read while the reply grows. Each `[TOOL_CALLS]` section is fed to a
    ForcedCallReader as items of its array: a JSON array passes as it is; `name{...}` (or
    `name[ARGS]{...}`) becomes `{"name": "name", "arguments": {...}`, whose arguments object
    closes itself; a `{...}` call object passes as an item. A section that is none of these
    ends the reading (no later call is read)."""

    _HEAD = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\])?\s*$")

    def __init__(self) -> None:
        super().__init__(MISTRAL_MARKER)
        self._state = "between"  # "between" sections, at a section's "head", or in its "body"
        self._num_items = 0
        self._named_item = False  # the section is `name{...}`: its item's object is ours

    def feed(self, delta: str) -> list[tuple[int, ForcedCall | None, str]]:
        self._text += delta
        array_text = ""
        while self._state != "done":
            if self._state == "between":
                start = self._find_marker()
                if start < 0:
                    break
                self._state, self._read = "head", start + len(MISTRAL_MARKER)
            elif self._state == "head":
                head = self._read_head()
                if head is None:
                    break
                array_text += head
            else:  # the section's body runs to the next marker
                end = self._text.find(MISTRAL_MARKER, self._read)
                stop = end if end >= 0 else len(self._text)
                hold = 0 if end >= 0 else partial_stop_len(self._text, [MISTRAL_MARKER])
                array_text += self._text[self._read : stop - hold]
                self._read = stop - hold
                if end < 0:
                    break
                array_text += "}" if self._named_item else ""  # its object, opened in the head
                self._state = "between"
        pieces = self.reader.feed(array_text)
        for _, new, _ in pieces:
            if new is not None:
                new.id = mistral_call_id()
        return pieces

    def _read_head(self) -> str | None:
        """What a section's start turns into for the array reader, once it is decided (None
        until then); moves to its body, or ends the reading."""
        rest = self._text[self._read :]
        stripped = rest.lstrip()
        if not stripped:
            return None
        opening = "[" if self._num_items == 0 else ","
        if stripped[0] in "[{":
            self._read += len(rest) - len(stripped)
            self._state, self._named_item = "body", False
            self._num_items += 1
            return "" if stripped[0] == "[" else opening
        brace = rest.find("{")
        if brace < 0:
            return None if len(rest) < _MAX_NAME_CHARS else self._stop()
        match = self._HEAD.match(rest[:brace])
        if match is None:
            return self._stop()
        self._read += brace
        self._state, self._named_item = "body", True
        self._num_items += 1
        return f'{opening}{{"name": {json.dumps(match.group(1))}, "arguments": '

    def _stop(self) -> None:
        self._state = "done"
        return None


def mistral_call_id() -> str:
    """A call id as Mistral's templates want them: 9 letters and digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
