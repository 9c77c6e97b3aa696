"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), the subset
`serve` serves: text in and out, function tools, `text.format` constraints, logprobs, and
conversations chained by `previous_response_id`.

The request's `input` items are read by `responses_input.py`, which turns them into chat
messages; their JSON types are checked there, item by item, with errors that name the item.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from v1engine.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    Int64,
    ReasoningEffort,
    _NotesIgnoredFields,
    _now,
)
from v1engine.entrypoints.openai.protocol_structured import JsonSchemaFormat, _Part


class FunctionTool(_Part):
    """A function the model may call; the Responses API's flat form of a chat tool."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Part):
    type: Literal["function"]
    name: str


class TextFormat(_Part):
    """`text.format`: plain text, any JSON object, or JSON of a schema (the Responses API's
    flat form of chat's `response_format`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_json_schema_format(self) -> JsonSchemaFormat:
        return JsonSchemaFormat(
            name=self.name or "response",
            description=self.description,
            schema=self.json_schema,
            strict=self.strict,
        )


class TextConfig(_Part):
    format: TextFormat = Field(default_factory=TextFormat)


# What `include` may ask for that this server sends: the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ReasoningConfig(_NotesIgnoredFields):
    """OpenAI's `reasoning`: its `effort` goes to the chat template (as chat's
    `reasoning_effort`); `summary` and the rest are logged as ignored."""

    effort: ReasoningEffort | None = None


class ResponsesRequest(_NotesIgnoredFields):
    model: str | None = None
    # A user message, or a list of items: messages, function calls and their outputs.
    input: str | list[dict[str, Any]]
    # A system message before the input (not carried over by previous_response_id).
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Return at once and generate in the server (responses_background.py).
    background: bool = False
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # vLLM's sampling extras, as chat takes them.
    request_id: str | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    @property
    def ignored_fields(self) -> list[str]:
        """The body's unknown fields, and the `include` values this server does not send."""
        ignored = [f"include.{value}" for value in self.include or [] if value != LOGPROBS_INCLUDE]
        if self.reasoning is not None:
            ignored += [f"reasoning.{name}" for name in self.reasoning.ignored_fields]
        return self._ignored_fields + ignored

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None


# -- responses ----------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a background response failed (OpenAI's `error`)."""

    code: str
    message: str


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=_now)
    model: str
    # "queued", "cancelled" and "failed" are a background response's (responses_background.py).
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: str | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    metadata: dict[str, str] | None = None
    store: bool = True
    truncation: str = "disabled"
    background: bool = False
    user: str | None = None
