"""POST /score and /rerank (vLLM's, also under /v1, and /v2/rerank): text pairs scored by a
pooling model (`--runner pooling`).

A score is the cosine similarity of the two texts' embeddings, or a cross-encoder's score of the
pair (`engine/scoring.PairScorer`, shared with `LLM.score`); each input is one engine request,
added together. /rerank scores the query
against each document and returns them best first, the first `top_n` (0: all). Usage counts
both texts' tokens per pair, as vLLM does.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from v1engine.engine.scoring import PairScorer, score_pairs
from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol import UsageInfo
from v1engine.entrypoints.openai.protocol_score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from v1engine.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from v1engine.outputs import ScoringRequestOutput


class OpenAIServingScore(OpenAIServingEmbedding):
    async def create_score(self, request: ScoreRequest, raw_request: Request) -> JSONResponse:
        """Raises APIError (400, 404, 503) before anything is computed."""
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as e:
            raise APIError(str(e), param="text_1") from e
        request_id, scored = await self._score(request, raw_request, "score", pairs)
        data = [ScoreData(index=i, score=output.outputs.score) for i, output in enumerate(scored)]
        num_tokens = sum(len(output.prompt_token_ids) for output in scored)
        usage = UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens)
        response = ScoreResponse(id=request_id, model=self.model_name, data=data, usage=usage)
        return JSONResponse(response.model_dump())

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> JSONResponse:
        """Raises APIError (400, 404, 503) before anything is computed."""
        if not request.documents:
            raise APIError("documents must not be empty; send at least one", param="documents")
        if request.top_n < 0:
            raise APIError(f"top_n must be >= 0 (0: all), got {request.top_n}", param="top_n")
        pairs = score_pairs(request.query, request.documents)
        request_id, scored = await self._score(request, raw_request, "rerank", pairs)
        results = [
            RerankResult(
                index=index,
                document=RerankDocument(text=document),
                relevance_score=output.outputs.score,
            )
            for index, (document, output) in enumerate(zip(request.documents, scored))
        ]
        results.sort(key=lambda result: result.relevance_score, reverse=True)
        num_tokens = sum(len(output.prompt_token_ids) for output in scored)
        response = RerankResponse(
            id=request_id,
            model=self.model_name,
            usage=RerankUsage(total_tokens=num_tokens),
            results=results[: request.top_n or None],
        )
        return JSONResponse(response.model_dump())

    async def _score(
        self,
        request: ScoreRequest | RerankRequest,
        raw_request: Request,
        prefix: str,
        pairs: list[tuple[str, str]],
    ) -> tuple[str, list[ScoringRequestOutput]]:
        """Returns the request's id and each pair's score (see `PairScorer`)."""
        hf_config = self.engine.config.model_config.hf_config
        pooling_task = self.engine.processor.pooling_task
        try:
            scorer = PairScorer(pairs, pooling_task, hf_config, self.tokenizer)
        except ValueError as e:
            raise APIError(str(e), param="model") from e
        request_id, pooled = await self.pool(
            request, raw_request, prefix, scorer.task, scorer.token_ids, "text"
        )
        return request_id, scorer.scores(pooled)
