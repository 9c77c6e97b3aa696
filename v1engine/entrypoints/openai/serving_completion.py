"""POST /v1/completions: one prompt or a batch (text or token ids) -> n completions each, whole or
streamed.

A batch runs as one engine request per prompt, added together; its choices are indexed
prompt-major (prompt i's j-th completion is choice i * n + j), streams interleave, usage sums.
`echo` puts the prompt (and with `logprobs`, its tokens' logprobs) before each completion, as
OpenAI's legacy completions do; `echo` with `max_tokens: 0` scores the prompt only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.logprobs import (
    LogprobRow,
    completion_logprobs,
    generated_rows,
    prompt_logprobs_field,
    prompt_rows,
)
from v1engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Prompt,
)
from v1engine.entrypoints.openai.serving_engine import (
    EngineRun,
    OpenAIServing,
    client_request_id,
)
from v1engine.entrypoints.openai.serving_outputs import (
    StreamTally,
    choice_usage,
    make_usage,
    merge_async_iterators,
    stream_events,
    stream_steps,
    sum_usage,
)
from v1engine.outputs import CompletionOutput, Logprob, RequestOutput


@dataclasses.dataclass
class _Echo:
    """What `echo` puts before a choice's completion: the prompt's text and logprob rows."""

    text: str
    rows: list[LogprobRow]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Raises APIError (400, 404, 503) before anything is generated."""
        self.check_request(request)
        client_id = client_request_id(request, raw_request)
        self._check_completion_fields(request)
        prompts = _split_prompts(request.prompt)
        # The limit on n counts completions: a batch asks for n per prompt.
        self.limits.check_n(len(prompts) * request.n)
        constraint = await self.make_constraint(request)
        tokenized = await asyncio.to_thread(self._tokenize, prompts)
        inputs = [
            self.make_input(request, text, token_ids, constraint) for text, token_ids in tokenized
        ]
        output_kind = "delta" if request.stream else "final"
        request_id, runs = await self.add_requests("cmpl", client_id, inputs, output_kind, "prompt")
        if request.stream:
            chunks = self._stream_chunks(request_id, runs, request)
            events = stream_events([r for r, _ in runs], chunks, self.abort_all)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await self.wait_for_final_outputs(runs, raw_request)
        return JSONResponse(self._response(request_id, finals, request).model_dump())

    def _check_completion_fields(self, request: CompletionRequest) -> None:
        if request.suffix is not None:
            raise APIError("suffix is not supported; send the prompt only", param="suffix")
        if request.max_tokens == 0 and not request.echo:
            raise APIError(
                "max_tokens must be >= 1, got 0; max_tokens 0 is only for echo=true (scoring "
                "the prompt)",
                param="max_tokens",
            )
        vocab_size = self.engine.client.info.vocab_size
        self.limits.check_num_logprobs(request.logprobs, "logprobs", vocab_size)
        if request.echo and request.use_beam_search:
            raise APIError(
                "echo is not supported with use_beam_search; drop one of them", param="echo"
            )

    def _tokenize(self, prompts: list[Prompt]) -> list[tuple[str | None, list[int]]]:
        return [
            (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, prompt)
            for prompt in prompts
        ]

    def _response(
        self, request_id: str, finals: list[RequestOutput], request: CompletionRequest
    ) -> CompletionResponse:
        choices, usages = [], []
        for prompt_index, final in enumerate(finals):
            echo = self._echo(final, final.prompt_logprobs, request)
            plp = final.prompt_logprobs
            plp = None if plp is None else prompt_logprobs_field(plp)
            for completion in final.outputs:
                choice = self._choice(completion, prompt_index, request, echo, 0)
                choice.prompt_logprobs = plp
                if request.return_token_ids:
                    choice.prompt_token_ids = final.prompt_token_ids
                choices.append(choice)
            num_tokens = sum(len(o.token_ids) for o in final.outputs)
            usages.append(make_usage(final, 0 if request.scores_prompt_only else num_tokens))
        return CompletionResponse(
            id=request_id,
            model=self.models.response_model(request),
            choices=choices,
            usage=sum_usage(usages),
        )

    async def _stream_chunks(
        self, request_id: str, runs: list[EngineRun], request: CompletionRequest
    ) -> AsyncIterator[CompletionResponse]:
        model = self.models.response_model(request)
        tallies = [StreamTally() for _ in runs]
        steps = [stream_steps(outputs, tally) for (_, outputs), tally in zip(runs, tallies)]
        text_offsets: dict[int, int] = {}  # choice index -> characters sent so far
        async for prompt_index, completions in merge_async_iterators(steps):
            tally = tallies[prompt_index]
            assert tally.last is not None
            for completion in completions:
                index = prompt_index * request.n + completion.index
                # The choice's first chunk carries the echoed prompt (as vLLM sends it).
                echo = None
                first = index not in text_offsets
                if first:
                    echo = self._echo(tally.last, tally.prompt_logprobs, request)
                offset = text_offsets.get(index, 0)
                choice = self._choice(completion, prompt_index, request, echo, offset)
                if first and request.return_token_ids:
                    choice.prompt_token_ids = tally.last.prompt_token_ids
                text_offsets[index] = offset + len(choice.text)
                usage = choice_usage(tally, completion.index, request.continuous_usage)
                if usage is not None and request.scores_prompt_only:
                    usage = make_usage(tally.last, 0)  # the one token generated is dropped
                # One choice per chunk, as OpenAI and vLLM send them: clients read choices[0].
                yield CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)
        if request.include_usage:
            usages = [
                make_usage(t.last, 0 if request.scores_prompt_only else t.num_completion_tokens)
                for t in tallies
                if t.last is not None
            ]
            usage = sum_usage(usages)
            yield CompletionResponse(id=request_id, model=model, choices=[], usage=usage)

    def _echo(
        self,
        output: RequestOutput,
        prompt_logprobs: list[dict[int, Logprob] | None] | None,
        request: CompletionRequest,
    ) -> _Echo | None:
        if not request.echo:
            return None
        text = output.prompt
        if text is None or request.truncate_prompt_tokens is not None:
            # Token ids, or a prompt the engine truncated: what the model saw, as text.
            text = self.tokenizer.decode(output.prompt_token_ids)
        rows = []
        if request.logprobs is not None:
            assert prompt_logprobs is not None, "echo with logprobs asks for prompt_logprobs"
            rows = prompt_rows(
                output.prompt_token_ids,
                prompt_logprobs,
                self._decode_token,
                request.return_tokens_as_token_ids,
            )
        return _Echo(text, rows)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _choice(
        self,
        completion: CompletionOutput,
        prompt_index: int,
        request: CompletionRequest,
        echo: _Echo | None,
        text_offset: int,
    ) -> CompletionChoice:
        if request.scores_prompt_only:
            completion = _without_generated(completion)
        text = completion.text
        as_ids = request.return_tokens_as_token_ids
        rows = [] if completion.logprobs is None else generated_rows(completion, as_ids)
        if echo is not None:
            text, rows = echo.text + text, echo.rows + rows
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(rows, text_offset)
        return CompletionChoice(
            index=prompt_index * request.n + completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            token_ids=list(completion.token_ids) if request.return_token_ids else None,
        )


def _split_prompts(prompt: Prompt | list[str] | list[list[int]]) -> list[Prompt]:
    """The request's prompts: one text, one token-id list, or a batch of either."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        return [prompt]  # type: ignore[list-item]  # an empty list: the engine says it is empty
    return list(prompt)  # type: ignore[arg-type]


def _without_generated(completion: CompletionOutput) -> CompletionOutput:
    """Scoring only (`max_tokens: 0`): the one token the engine had to generate, dropped."""
    finish_reason = completion.finish_reason
    if finish_reason in ("stop", "length"):
        finish_reason = "length"  # the 0 tokens asked for were all generated
    return dataclasses.replace(
        completion,
        text="",
        token_ids=[],
        logprobs=None if completion.logprobs is None else [],
        finish_reason=finish_reason,
        stop_reason=None,
    )
