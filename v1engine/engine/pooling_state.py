"""One embedding request as the front end tracks it (a pooling engine's `OutputProcessor`
entry): it waits for the core's one output, the prompt's last hidden state, and applies the
request's `PoolingParams` to it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from v1engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
)
from v1engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from v1engine.request import EngineCoreOutput


class PoolingState:
    parent = None  # never a child: pooling has no n > 1

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params

    def make_output(self, output: EngineCoreOutput) -> EmbeddingRequestOutput | RequestOutput:
        """The request's embedding; or, when the core ended it without one (it refused it),
        a RequestOutput saying why in its finish_reason."""
        if output.pooling_output is None:
            ended = CompletionOutput(0, "", [], None, None, str(output.finish_reason))
            return RequestOutput(self.request_id, None, self.prompt_token_ids, [ended], True)
        return EmbeddingRequestOutput(
            request_id=self.request_id,
            outputs=EmbeddingOutput(self.params.apply(output.pooling_output)),
            prompt_token_ids=self.prompt_token_ids,
            num_cached_tokens=output.num_cached_tokens,
        )
