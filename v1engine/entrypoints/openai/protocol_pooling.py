"""Bodies of the pooling endpoints, `POST /v1/embeddings` (OpenAI's field names and vLLM's extra
fields, so that OpenAI's and vLLM's clients work unchanged) and vLLM's `POST /classify` and
`POST /pooling`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from v1engine.entrypoints.openai.protocol import (
    ChatMessage,
    Int64,
    UsageInfo,
    _NotesIgnoredFields,
    _now,
)
from v1engine.entrypoints.openai.protocol_structured import ChatTool


class PoolingRequest(_NotesIgnoredFields):
    """What every pooling body takes: `input`, or vLLM's chat form (`messages`, rendered
    through the chat template as /v1/chat/completions renders them, into one result)."""

    model: str | None = None
    # One text, one token-id list, or a batch of either (one result each, in order).
    input: str | list[str] | list[Int64] | list[list[Int64]] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    # vLLM's.
    truncate_prompt_tokens: Int64 | None = None
    # None: True for `input`, False for `messages` (the template writes its special tokens).
    add_special_tokens: bool | None = None
    priority: Int64 = 0
    request_id: str | None = None
    # The chat form's (vLLM's defaults: the conversation as it stands, no assistant turn).
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class EmbeddingRequest(PoolingRequest):
    # "base64": each vector's float32 bytes, little-endian (OpenAI's client asks for it).
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ClassificationRequest(PoolingRequest):
    """vLLM's /classify body."""

    # False: the class logits instead of the model's activation of them.
    use_activation: bool | None = None


class ClassificationData(BaseModel):
    index: int
    label: str  # the highest-scoring class's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class PoolingEndpointRequest(EmbeddingRequest):
    """vLLM's /pooling body: an embedding's fields, a classifier's, and the task."""

    task: str | None = None  # "embed" or "classify"; None: the model's
    use_activation: bool | None = None


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str  # the embedding or the class scores (base64: float32 bytes)


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[PoolingData]
    usage: UsageInfo
