"""Tool-call parsers for `tool_choice: "auto"`: they find the calls a model wrote in its text.

hermes (Hermes, Qwen and many tool-tuned models): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first call is the
message's content.
"""

from __future__ import annotations

import json
import re

TOOL_CALL_PARSERS = ("hermes",)
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """`(content or None, [(name, arguments as JSON text)])`; no calls when any call is not a
    JSON object with a string `name` (the text then stays content, as vLLM's parser leaves it)."""
    calls = []
    for match in _HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls
