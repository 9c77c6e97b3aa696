"""POST /classify (vLLM's, also under /v1): one input or a batch (text or token ids), or a chat
(`messages`) -> each input's class scores and the top class's name, in order.

Served by an engine that pools a sequence classifier (a `*ForSequenceClassification`
checkpoint; `--runner auto` picks pooling for it). The scores are the model's activation of its
class logits (softmax; sigmoid for one class or multi-label; see
`hf_config.classifier_activation`), or the logits with `use_activation: false`; the label is
config.json's `id2label` name of the highest one.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from v1engine.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from v1engine.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, prompt_usage
from v1engine.model.hf_config import classifier_labels


class OpenAIServingClassification(OpenAIServingEmbedding):
    async def create_classification(
        self, request: ClassificationRequest, raw_request: Request
    ) -> JSONResponse:
        """Raises APIError (400, 404, 503) before anything is computed."""
        request_id, classified = await self.pool(request, raw_request, "classify", "classify")
        labels = classifier_labels(self.engine.config.model_config.hf_config)
        data = [
            classification_data(index, output.outputs.probs, labels)
            for index, output in enumerate(classified)
        ]
        usage = prompt_usage(classified)
        response = ClassificationResponse(
            id=request_id, model=self.model_name, data=data, usage=usage
        )
        return JSONResponse(response.model_dump())


def classification_data(index: int, probs: list[float], labels: list[str]) -> ClassificationData:
    """One input's entry: its scores and the name of the highest (the first of equals)."""
    top = max(range(len(probs)), key=probs.__getitem__)
    return ClassificationData(index=index, label=labels[top], probs=probs, num_classes=len(probs))
