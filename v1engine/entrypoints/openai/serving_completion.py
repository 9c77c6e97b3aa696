"""POST /v1/completions: one prompt (text or token ids) -> n completions, whole or streamed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Prompt,
)
from v1engine.entrypoints.openai.serving_engine import (
    OpenAIServing,
    StreamTally,
    make_usage,
    sampled_logprobs,
    stream_steps,
)
from v1engine.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Raises APIError (400, 404, 503) before anything is generated."""
        self.check_request(request)
        if request.echo:
            raise APIError("echo is not supported", param="echo")
        if request.best_of not in (None, 1):
            raise APIError("best_of is not supported; use n", param="best_of")
        self.limits.check_num_logprobs(request.logprobs, "logprobs")
        text, token_ids = await asyncio.to_thread(self._tokenize, request.prompt)
        params = self.make_sampling_params(request, len(token_ids))
        output_kind = "delta" if request.stream else "final"
        request_id, outputs = await self.add_request("cmpl", text, token_ids, params, output_kind)
        if request.stream:
            chunks = self._stream_chunks(request_id, outputs, request)
            events = self.stream_events(request_id, chunks)
            return StreamingResponse(events, media_type="text/event-stream")
        final = await self.wait_for_final_output(request_id, outputs, raw_request)
        choices = [self._choice(output, 0) for output in final.outputs]
        response = CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=make_usage(final, sum(len(o.token_ids) for o in final.outputs)),
        )
        return JSONResponse(response.model_dump())

    def _tokenize(self, prompt: Prompt | list[str] | list[list[int]]) -> tuple[str | None, list]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if all(isinstance(t, int) for t in prompt):
            return None, list(prompt)  # empty: the engine's check says so
        if len(prompt) == 1:
            return self._tokenize(prompt[0])
        raise APIError(
            "send one prompt per request (text or a list of token ids); batched prompts are "
            f"not supported, got {len(prompt)}",
            param="prompt",
        )

    async def _stream_chunks(
        self, request_id: str, outputs: AsyncIterator[RequestOutput], request: CompletionRequest
    ) -> AsyncIterator[CompletionResponse]:
        tally = StreamTally()
        text_offsets: dict[int, int] = {}  # choice index -> characters sent so far
        async for completions in stream_steps(outputs, tally):
            choices = []
            for completion in completions:
                offset = text_offsets.get(completion.index, 0)
                choices.append(self._choice(completion, offset))
                text_offsets[completion.index] = offset + len(completion.text)
            yield CompletionResponse(id=request_id, model=self.model_name, choices=choices)
        if request.include_usage and tally.last is not None:
            usage = tally.usage()
            yield CompletionResponse(id=request_id, model=self.model_name, choices=[], usage=usage)

    def _choice(self, output: CompletionOutput, text_offset: int) -> CompletionChoice:
        logprobs = None
        if output.logprobs is not None:
            logprobs = _completion_logprobs(output, text_offset)
        return CompletionChoice(
            index=output.index,
            text=output.text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )


def _completion_logprobs(output: CompletionOutput, text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, offset, logprob and the candidates'."""
    assert output.logprobs is not None
    result = CompletionLogprobs()
    for sampled, ranked in sampled_logprobs(output.token_ids, output.logprobs):
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({lp.decoded_token or "": lp.logprob for lp in ranked})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result
