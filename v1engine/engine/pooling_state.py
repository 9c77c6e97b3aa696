"""One pooling request as the front end tracks it (a pooling engine's `OutputProcessor` entry): it
waits for the core's one output, the prompt's last hidden state (or a classifier's class
logits), and applies the request's `PoolingParams` to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from v1engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from v1engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from v1engine.request import EngineCoreOutput

PooledOutput = EmbeddingRequestOutput | ClassificationRequestOutput


class PoolingState:
    parent = None  # never a child: pooling has no n > 1

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        activation: str | None = None,
    ) -> None:
        """`activation`: a classifier's ("softmax", "sigmoid", "none"); None: it embeds."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.activation = activation

    def make_output(self, output: EngineCoreOutput) -> PooledOutput | RequestOutput:
        """The request's embedding or class scores; or, when the core ended it without them
        (it refused it), a RequestOutput saying why in its finish_reason."""
        pooled = output.pooling_output
        if pooled is None:
            ended = CompletionOutput(0, "", [], None, None, str(output.finish_reason))
            return RequestOutput(self.request_id, None, self.prompt_token_ids, [ended], True)
        if self.activation is None:
            cls, result = EmbeddingRequestOutput, EmbeddingOutput(self.params.embed(pooled))
        else:
            probs = self.params.classify(pooled, self.activation)
            cls, result = ClassificationRequestOutput, ClassificationOutput(probs)
        return cls(
            request_id=self.request_id,
            outputs=result,
            prompt_token_ids=self.prompt_token_ids,
            num_cached_tokens=output.num_cached_tokens,
        )
