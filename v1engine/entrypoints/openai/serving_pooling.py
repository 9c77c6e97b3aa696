"""POST /pooling (vLLM's generic pooling endpoint): what /v1/embeddings or /classify computes
for the same input, by `task` ("embed" or "classify"; absent: the model's own), each result
under `data` as a list of floats (or base64 float32 bytes with `encoding_format: "base64"`).
vLLM's token-level tasks ("token_embed", "token_classify") are a 400: the workers pool each
prompt's last token only.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from v1engine.entrypoints.openai.protocol_pooling import (
    PoolingData,
    PoolingEndpointRequest,
    PoolingResponse,
)
from v1engine.entrypoints.openai.serving_embedding import (
    OpenAIServingEmbedding,
    encode_vector,
    prompt_usage,
)
from v1engine.outputs import ClassificationOutput, EmbeddingOutput


class OpenAIServingPooling(OpenAIServingEmbedding):
    async def create_pooling(
        self, request: PoolingEndpointRequest, raw_request: Request
    ) -> JSONResponse:
        """Raises APIError (400, 404, 503) before anything is computed."""
        task = request.task or self.engine.processor.pooling_task or "embed"
        request_id, pooled = await self.pool(request, raw_request, "pool", task)
        encoding = request.encoding_format
        data = [
            PoolingData(index=index, data=encode_vector(_values(output.outputs), encoding))
            for index, output in enumerate(pooled)
        ]
        response = PoolingResponse(
            id=request_id, model=self.model_name, data=data, usage=prompt_usage(pooled)
        )
        return JSONResponse(response.model_dump())


def _values(result: EmbeddingOutput | ClassificationOutput) -> list[float]:
    return result.probs if isinstance(result, ClassificationOutput) else result.embedding
