"""Bodies of vLLM's `POST /score` and `POST /rerank` (also under /v1, and /v2/rerank, Jina's and
Cohere's shape), with vLLM's field names, so that clients written for vLLM's server work
unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from v1engine.entrypoints.openai.protocol import Int64, UsageInfo, _NotesIgnoredFields, _now


class ScoreRequest(_NotesIgnoredFields):
    model: str | None = None
    # One text against one, one against N, or N against N (see engine/scoring.py).
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int64 | None = None
    priority: Int64 = 0
    request_id: str | None = None
    # A cross-encoder's: False scores with its raw logit (embedding models refuse it).
    use_activation: bool | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(_NotesIgnoredFields):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0  # the best this many (0: all)
    truncate_prompt_tokens: Int64 | None = None
    priority: Int64 = 0
    request_id: str | None = None
    # A cross-encoder's: False scores with its raw logit (embedding models refuse it).
    use_activation: bool | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
