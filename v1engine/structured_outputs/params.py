"""StructuredOutputsParams: the constraint one request's output must follow (vLLM's names).

It travels inside `SamplingParams` from the client to the engine core (msgspec, as a dataclass), so
it is plain data and imports no grammar library; `backend.py` turns it into a compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint kinds, of which a request sets exactly one.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    # A JSON schema, as a dict or its JSON text.
    json: str | dict[str, Any] | None = None
    # Any JSON object (OpenAI's response_format {"type": "json_object"}).
    json_object: bool | None = None
    regex: str | None = None
    # The output is exactly one of these strings.
    choice: list[str] | None = None
    # An EBNF (GBNF) grammar as xgrammar reads it, starting at the rule `root`.
    grammar: str | None = None
    # Free text with constrained parts, as JSON text (or a dict), in vLLM's two forms:
    # {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}
    # (a JSON schema between `begin` and `end`, once the text reaches a trigger), or xgrammar's
    # {"type": "structural_tag", "format": {...}} (backend.py compiles both).
    structural_tag: str | dict[str, Any] | None = None
    # JSON kinds: no whitespace between tokens (xgrammar's any_whitespace=False), which also
    # keeps a weak model from spending its tokens on indentation.
    disable_any_whitespace: bool = False
    # vLLM's field for the outlines and guidance backends; xgrammar refuses it (backend.py).
    whitespace_pattern: str | None = None
    # Set by the server's reasoning parser, not by users: the grammar applies only after the
    # output's first token of this id (the model's one-token `</think>`); before it the model
    # thinks freely.
    _reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if _is_set(getattr(self, kind))]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}, got "
                f"{len(given)}: {given or 'none'}"
            )
        if self.json_object is False:
            raise ValueError("StructuredOutputsParams.json_object must be True when given")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    "StructuredOutputsParams.choice must be a non-empty list of non-empty "
                    f"strings, got {self.choice!r}"
                )
        if self.structural_tag is not None:
            _check_structural_tag(self.structural_tag)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise ValueError(
                    f"StructuredOutputsParams.{kind} must be a non-empty string, got {value!r}"
                )

    @property
    def kind(self) -> str:
        """The one constraint kind set: one of KINDS."""
        return next(kind for kind in KINDS if _is_set(getattr(self, kind)))

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, text, disable_any_whitespace): requests with equal keys share one compiled
        grammar. A dict schema is written with sorted keys, so key order does not matter."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag") and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            value = json.dumps(value)
        return kind, str(value), self.disable_any_whitespace


def _is_set(value: object) -> bool:
    # json_object=False counts as given, so that __post_init__ can name it.
    return value is not None


def _check_structural_tag(tag: object) -> None:
    """Raises ValueError unless `tag` is a JSON object (or its text); its content is
    xgrammar's to check when it compiles."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.structural_tag is not JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError(
            'StructuredOutputsParams.structural_tag must be a JSON object with "type": '
            f'"structural_tag", got {tag!r:.80}'
        )
