"""Request and response models for structured outputs and tool calls (OpenAI's and vLLM's names).

`response_format` and `tools` follow OpenAI; `structured_outputs` (an object of
`StructuredOutputsParams` fields) and the older `guided_*` fields are vLLM's extras.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Part):
    name: str
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # "structural_tag" (vLLM's): its older form's tags and triggers, or xgrammar's `format`
    # (see StructuredOutputsParams.structural_tag).
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class FunctionDefinition(_Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Part):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredFields(BaseModel):
    """The constraint fields both endpoints take; at most one constraint per request."""

    response_format: ResponseFormat | None = None
    # vLLM's: {"json": ..., "regex": ..., "choice": ..., "grammar": ..., "json_object": true,
    # "disable_any_whitespace": ...}; the keys are checked by StructuredOutputsParams.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
