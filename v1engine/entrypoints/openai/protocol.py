"""Request and response bodies of the OpenAI API (the subset `serve` serves), as pydantic models.

Requests accept fields they do not know (as OpenAI's SDKs may send newer ones, and as vLLM does)
and list them in `ignored_fields`, which the server logs; value checks are left to
`SamplingParams`, whose errors name the field, so one set of rules serves `LLM` and HTTP.
The models check only what must hold before that: JSON types, finite floats (JSON parsing accepts
NaN and Infinity), integers that fit the engine's 64-bit fields, and OpenAI's message roles.
Beside OpenAI's fields, requests take vLLM's sampling extras (`top_k`, `min_p`, `ignore_eos`, ...).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from v1engine.entrypoints.openai.protocol_structured import (
    ChatTool,
    DeltaToolCall,
    StructuredFields,
    ToolCall,
    ToolChoice,
)
from v1engine.sampling_params import SamplingParams

# One prompt: text or token ids; a completion request may also send a list of prompts.
Prompt = str | list[int]
# What msgpack and torch's int64 hold (vLLM bounds `seed` the same way).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# OpenAI's roles; it answers any other with a 400, as this server does.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _NotesIgnoredFields(_Request):
    """A request body, or one of its objects whose unknown fields are worth a warning: notes the
    fields it ignores (one set difference per object)."""

    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data: Any, handler: Any) -> Any:
        request = handler(data)
        if isinstance(data, dict):
            request._ignored_fields = sorted(data.keys() - cls.model_fields.keys())
        return request

    @property
    def ignored_fields(self) -> list[str]:
        """The body's fields this server does not know, which it ignores."""
        return self._ignored_fields


class StreamOptions(_NotesIgnoredFields):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool = False


class _SamplingFields(_NotesIgnoredFields, StructuredFields):
    """The sampling (and constraint) fields both endpoints share; `None` means the OpenAI
    default."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's JSON object of token id (a string) -> bias; a key that is not an integer is a 400.
    logit_bias: dict[Int64, float] | None = None
    best_of: int | None = None  # not supported beyond 1 (vLLM V1 dropped it too)
    user: str | None = None  # OpenAI's end-user id: accepted and unused, as in vLLM
    # vLLM's: the response's id becomes f"{prefix}-{request_id}" (an X-Request-Id header wins).
    request_id: str | None = None
    # vLLM's, refused when set: this server schedules first come, first served.
    priority: int = 0
    # vLLM's: the request shares prefix-cache blocks only with requests of the same salt.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's beam search: n is its width; length_penalty scores it (see beam_search.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's extras.
    # None: the model's generation_config.json value if it has one, else SamplingParams'.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # Logprobs name their tokens "token_id:{id}" instead of by text.
    return_tokens_as_token_ids: bool = False
    # vLLM's: the response carries the prompt's and each choice's token ids (streamed: the
    # prompt's in a choice's first chunk, each chunk its new tokens').
    return_token_ids: bool = False

    @property
    def ignored_fields(self) -> list[str]:
        """The body's fields this server does not know, `stream_options`' included."""
        nested = [] if self.stream_options is None else self.stream_options.ignored_fields
        return self._ignored_fields + [f"stream_options.{name}" for name in nested]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries its choice's usage so far (`continuous_usage_stats`,
        which takes effect with `include_usage` only, as in vLLM)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        defaults: Mapping[str, Any],
    ) -> SamplingParams:
        """`defaults`: the model's sampling defaults (`engine/generation_defaults.py`) for the
        fields this request leaves out; their `max_tokens` caps the request's.

        Raises ValueError naming the field when a value is out of range."""
        defaults = dict(defaults)
        cap = defaults.pop("max_tokens", None)
        if cap is not None and (max_tokens is None or max_tokens > cap):
            max_tokens = cap
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        # Each left out: the model's default, else SamplingParams' own.
        chosen = {**defaults, **{name: v for name, v in given.items() if v is not None}}
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop_list,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
            logit_bias=None if self.logit_bias is None else dict(self.logit_bias),
            allowed_token_ids=_copy(self.allowed_token_ids),
            bad_words=_copy(self.bad_words),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            **chosen,
        )


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)


class CompletionRequest(_SamplingFields):
    prompt: Prompt | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # top-k alternatives per token, besides the sampled one
    echo: bool = False
    suffix: str | None = None  # not supported (nor by vLLM): a 400 when given

    @property
    def scores_prompt_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if self.scores_prompt_only:
            # SamplingParams needs >= 1 token: the server asks for one and drops it.
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            # The echoed prompt's logprobs are prompt logprobs (as vLLM asks for them).
            prompt_logprobs = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults or {})


class ChatMessage(_Request):
    role: Role
    # A string, or parts like [{"type": "text", "text": "..."}]; only text parts are supported.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant's earlier calls ({"id", "type", "function": {"name", "arguments"}}), and the
    # call a "tool" message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An assistant's earlier thinking (vLLM's `reasoning`; DeepSeek's `reasoning_content`).
    reasoning: str | None = None
    reasoning_content: str | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # + vLLM's


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's template options, as /tokenize takes them.
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply extends the last (assistant) message
    add_special_tokens: bool = False  # the template writes those it wants (BOS, role markers)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    reasoning_effort: ReasoningEffort | None = None  # to the template (template_variables)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # "auto" when tools are given, else "none"
    parallel_tool_calls: bool = True
    # vLLM's: with --reasoning-parser, false leaves the thinking out of the reply (it is still
    # kept out of the content).
    include_reasoning: bool = True

    def to_sampling_params(
        self, default_max_tokens: int, defaults: Mapping[str, Any] | None = None
    ) -> SamplingParams:
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults or {})

    def template_variables(self) -> dict[str, Any] | None:
        """`chat_template_kwargs` over vLLM's reading of `reasoning_effort` (reasoning.py)."""
        effort = self.reasoning_effort
        if effort is None:
            return self.chat_template_kwargs
        implied = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        return implied | (self.chat_template_kwargs or {})


# -- responses ----------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id (a string) ->
# its logprob, for the prompt's own token and the top-k.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the text (vLLM's extra field).
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra field
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM's)
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None  # with --reasoning-parser: the thinking (reasoning.py)


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's)


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra field
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM's)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk's, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "v1engine"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
