"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages through the chat
template as /v1/chat/completions renders them) and `POST /detokenize` (token ids -> text).

Neither touches the engine. Tokenizing and rendering run in a thread, as on the completion path:
a megabyte prompt takes seconds, and the event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from v1engine.entrypoints.openai.serving_chat import render_messages
from v1engine.entrypoints.openai.serving_engine import OpenAIServing, require_one_form


class OpenAIServingTokenization(OpenAIServing):
    async def create_tokenize(self, request: TokenizeRequest) -> JSONResponse:
        """Raises APIError: 404 for an unknown model, 400 for a body that is neither form or a
        chat the template cannot render."""
        self.models.check(request.model)
        token_ids, token_strs = await asyncio.to_thread(self._tokenize_with_strs, request)
        response = TokenizeResponse(
            count=len(token_ids),
            max_model_len=self.max_model_len,
            tokens=token_ids,
            token_strs=token_strs,
        )
        return JSONResponse(response.model_dump())

    async def create_detokenize(self, request: DetokenizeRequest) -> JSONResponse:
        """Raises APIError: 404 for an unknown model, 400 for ids outside the vocabulary."""
        self.models.check(request.model)
        text = await asyncio.to_thread(self._detokenize, request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    def _detokenize(self, token_ids: list[int]) -> str:
        vocab_size = self.engine.client.info.vocab_size
        # min and max first: listing the bad ids is the slow path.
        if (
            vocab_size is not None
            and token_ids
            and not 0 <= min(token_ids) <= max(token_ids) < vocab_size
        ):
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            raise APIError(
                f"tokens {bad[:5]} are outside the vocabulary; this model's ids are in "
                f"[0, {vocab_size})",
                param="tokens",
            )
        return self.tokenizer.decode(token_ids)

    def _tokenize_with_strs(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        token_ids = self._tokenize(request)
        if not request.return_token_strs:
            return token_ids, None
        return token_ids, self.tokenizer.convert_ids_to_tokens(token_ids)

    def _tokenize(self, request: TokenizeRequest) -> list[int]:
        require_one_form(request, "prompt", "text", "tokenize")
        if request.prompt is not None:
            add_special_tokens = request.add_special_tokens is not False
            return self.tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)
        _, token_ids = render_messages(self.engine.processor, request, self.options.chat_template)
        return token_ids
