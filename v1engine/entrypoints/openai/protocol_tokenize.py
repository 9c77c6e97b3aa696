"""Bodies of vLLM's tokenizer endpoints, `POST /tokenize` and `POST /detokenize`, with vLLM's
field names and defaults, so that clients written for vLLM's server work unchanged."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from v1engine.entrypoints.openai.protocol import ChatMessage, Int64, _Request
from v1engine.entrypoints.openai.protocol_structured import ChatTool


class TokenizeRequest(_Request):
    """vLLM's two forms in one body: `prompt` (a completion's text) or `messages` (a chat,
    rendered with the chat template as /v1/chat/completions renders it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's default for the form, True for a prompt and False for messages (the chat
    # template already writes the special tokens it wants: BOS, role markers).
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # The chat form's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(BaseModel):
    prompt: str
