"""Bodies of `POST /v1/embeddings`, with OpenAI's field names and vLLM's extra fields, so that
OpenAI's and vLLM's clients work unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from v1engine.entrypoints.openai.protocol import Int64, UsageInfo, _NotesIgnoredFields, _now


class EmbeddingRequest(_NotesIgnoredFields):
    model: str | None = None
    # One text, one token-id list, or a batch of either (one embedding each, in order).
    input: str | list[str] | list[Int64] | list[list[Int64]]
    # "base64": each vector's float32 bytes, little-endian (OpenAI's client asks for it).
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's.
    truncate_prompt_tokens: Int64 | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: Int64 = 0
    request_id: str | None = None


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
