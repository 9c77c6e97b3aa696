"""POST /v1/chat/completions: messages -> the chat template -> n replies, whole or streamed."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from v1engine.engine.processor import Processor
from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.logprobs import (
    finite,
    prompt_logprobs_field,
    sampled_logprobs,
    token_name,
)
from v1engine.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from v1engine.entrypoints.openai.protocol_pooling import EmbeddingRequest
from v1engine.entrypoints.openai.protocol_tokenize import TokenizeRequest
from v1engine.entrypoints.openai.reasoning import (
    ReasoningStream,
    closes_thinking,
    opens_thinking,
    split_deltas,
    split_reasoning,
    think_end_token_id,
)
from v1engine.entrypoints.openai.serving_engine import EngineRun, OpenAIServing, client_request_id
from v1engine.entrypoints.openai.serving_outputs import (
    StreamTally,
    choice_usage,
    make_usage,
    stream_events,
    stream_steps,
)
from v1engine.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolMode,
    calls_finish_reason,
    decoded_tool_call,
    parse_tool_calls,
    template_tools,
    tool_mode,
    tool_stream_choices,
)
from v1engine.entrypoints.openai.tool_parsers import KEEPS_SPECIAL_TOKENS
from v1engine.outputs import CompletionOutput, Logprob
from v1engine.structured_outputs.params import StructuredOutputsParams


@dataclasses.dataclass
class ChatRun:
    """A chat request's engine run: what its replies are read back with."""

    request: ChatCompletionRequest
    request_id: str
    runs: list[EngineRun]
    mode: ToolMode | None  # how tool calls are read from the text; None: no tools
    opened: bool | None  # None: replies are not split into reasoning; else starts thinking


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """Raises APIError (400, 404, 503) before anything is generated."""
        run = await self.start(request, raw_request)
        if request.stream:
            return StreamingResponse(
                stream_events([r for r, _ in run.runs], self.stream_chunks(run), self.abort_all),
                media_type="text/event-stream",
            )
        response = await self.final_response(run, raw_request)
        return JSONResponse(response.model_dump())

    async def start(self, request: ChatCompletionRequest, raw_request: Request) -> ChatRun:
        """Checks the request, renders its messages and adds it to the engine (the Responses
        API runs its requests through here too).

        Raises:
            APIError: 400, 404 or 503, before anything is generated.
        """
        self.check_request(request)
        client_id = client_request_id(request, raw_request)
        if not request.include_reasoning and self.options.reasoning_parser is None:
            raise APIError(
                "include_reasoning: false needs a server started with --reasoning-parser "
                "(without one the thinking is part of the content)",
                param="include_reasoning",
            )
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        vocab_size = self.engine.client.info.vocab_size
        self.limits.check_num_logprobs(request.top_logprobs, "top_logprobs", vocab_size)
        mode = tool_mode(request, self.options) if request.tools or request.tool_choice else None
        if mode is not None and mode.parser in KEEPS_SPECIAL_TOKENS:
            request.skip_special_tokens = False  # the parser reads a special token (as vLLM's)
        constraint = await self.make_constraint(request, mode and mode.constraint)
        prompt, token_ids = await asyncio.to_thread(self._render, request)
        constraint, opened = self._plan_reasoning(prompt, constraint)
        inputs = [self.make_input(request, prompt, token_ids, constraint)]
        output_kind = "delta" if request.stream else "final"
        request_id, runs = await self.add_requests(
            "chatcmpl", client_id, inputs, output_kind, "messages"
        )
        return ChatRun(request, request_id, runs, mode, opened)

    async def final_response(
        self, run: ChatRun, raw_request: Request | None
    ) -> ChatCompletionResponse:
        """The whole reply of a request started with `stream: false` (`raw_request` None: no
        client to watch for a disconnect).

        Raises:
            APIError: 503 when the engine died, 400 when the request was aborted.
        """
        request = run.request
        (final,) = await self.wait_for_final_outputs(run.runs, raw_request)
        choices = [_choice(output, request, run.mode, run.opened) for output in final.outputs]
        usage = make_usage(final, sum(len(o.token_ids) for o in final.outputs))
        response = ChatCompletionResponse(
            id=run.request_id,
            model=self.models.response_model(request),
            choices=choices,
            usage=usage,
        )
        if final.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_field(final.prompt_logprobs)
        if request.return_token_ids:
            response.prompt_token_ids = final.prompt_token_ids
        return response

    def _plan_reasoning(
        self, prompt: str, constraint: StructuredOutputsParams | None
    ) -> tuple[StructuredOutputsParams | None, bool | None]:
        """The constraint (applied after the thinking where it can be, see reasoning.py), and
        None where replies are not split into reasoning and content (no --reasoning-parser, or
        a grammar that governs the whole output), else whether the output starts inside the
        thinking."""
        parser = self.options.reasoning_parser
        if parser is None:
            return constraint, None
        if constraint is None:
            return None, opens_thinking(parser, prompt)
        end_token_id = think_end_token_id(self.tokenizer)
        if end_token_id is None or closes_thinking(prompt):
            return constraint, None
        deferred = dataclasses.replace(constraint, _reasoning_end_token_id=end_token_id)
        return deferred, opens_thinking(parser, prompt)

    def _render(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        if not request.messages:
            raise APIError("messages must not be empty", param="messages")
        return render_messages(self.engine.processor, request, self.options.chat_template)

    async def stream_chunks(self, run: ChatRun) -> AsyncIterator[ChatCompletionChunk]:
        """The chunks of a request started with `stream: true`."""
        # As OpenAI: each choice opens with a role-only delta, then content deltas; the last
        # chunk of a choice carries its finish_reason. Tool calls go as `ToolCallStream` reads
        # them (forced ones as they are written). As vLLM, the role deltas go with the first
        # output, so that they can carry its usage (the prompt's, as the engine counted it).
        # With a reasoning parser, each delta's thinking goes in `reasoning` as it comes.
        request, request_id, mode, opened = run.request, run.request_id, run.mode, run.opened
        model = self.models.response_model(request)
        tally = StreamTally()
        tool_streams: dict[int, ToolCallStream] = {}
        streams: dict[int, ReasoningStream] = {}
        held = _HeldTokens(request, with_logprobs=mode is not None)
        roles_sent = False
        async for completions in stream_steps(run.runs[0][1], tally):
            if not roles_sent:
                roles_sent = True
                for chunk in self._role_chunks(run, tally):
                    yield chunk
            held.add(completions)
            reasoning: dict[int, str] = {}
            if opened is not None:
                completions, reasoning = split_deltas(completions, streams, opened)
                if not request.include_reasoning:
                    reasoning = {}
            if mode is None:
                choices = [_stream_choice(c, request, reasoning.get(c.index)) for c in completions]
            else:
                choices = [_thinking_choice(i, text) for i, text in reasoning.items() if text]
                choices += tool_stream_choices(completions, mode, tool_streams)
            for choice in choices:  # one choice per chunk, as OpenAI and vLLM send them
                held.attach(choice)
                usage = choice_usage(tally, choice.index, request.continuous_usage)
                yield ChatCompletionChunk(id=request_id, model=model, choices=[choice], usage=usage)
        if request.include_usage and tally.last is not None:
            usage = make_usage(tally.last, tally.num_completion_tokens)
            yield ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage)

    def _role_chunks(self, run: ChatRun, tally: StreamTally) -> list[ChatCompletionChunk]:
        """Each choice's role-only chunk; the first carries the prompt's token ids (with
        return_token_ids)."""
        request = run.request
        assert tally.last is not None
        usage = make_usage(tally.last, 0) if request.continuous_usage else None
        prompt_ids = tally.last.prompt_token_ids if request.return_token_ids else None
        chunks = []
        for index in range(request.n):
            role = ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content=""))
            chunk = ChatCompletionChunk(
                id=run.request_id,
                model=self.models.response_model(request),
                choices=[role],
                usage=usage,
            )
            if index == 0:
                chunk.prompt_token_ids = prompt_ids
            chunks.append(chunk)
        return chunks


def _choice(
    output: CompletionOutput,
    request: ChatCompletionRequest,
    mode: ToolMode | None,
    opened: bool | None,
) -> ChatChoice:
    reasoning, text = (
        (None, output.text) if opened is None else split_reasoning(output.text, opened)
    )
    parsed = None if mode is None else parse_tool_calls(mode, text)
    if parsed is None:
        content, calls, finish_reason = text, [], output.finish_reason
    else:
        (content, calls), finish_reason = parsed, calls_finish_reason(output)
    if reasoning is not None and not content:
        content = None  # as vLLM: a reply that only thought has no content
    if not request.include_reasoning:
        reasoning = None
    message = ChatResponseMessage(content=content, tool_calls=calls, reasoning=reasoning)
    return ChatChoice(
        index=output.index,
        message=message,
        logprobs=_chat_logprobs(output, request),
        finish_reason=finish_reason,
        stop_reason=output.stop_reason,
        token_ids=list(output.token_ids) if request.return_token_ids else None,
    )


@dataclasses.dataclass
class _HeldTokens:
    """A stream's token ids (with return_token_ids) and, under a tool mode, its logprobs, held
    until their choice's next chunk: each step's go with the first chunk it sends for the choice,
    or, if it sends none (a tool call held back until it ends), the next one."""

    request: ChatCompletionRequest
    with_logprobs: bool  # without tools, a chunk's logprobs are its own step's (_stream_choice)
    ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list[ChatTokenLogprob]] = dataclasses.field(default_factory=dict)

    def add(self, completions: list[CompletionOutput]) -> None:
        for completion in completions:
            if self.request.return_token_ids:
                self.ids.setdefault(completion.index, []).extend(completion.token_ids)
            logprobs = _chat_logprobs(completion, self.request) if self.with_logprobs else None
            if logprobs is not None:
                self.logprobs.setdefault(completion.index, []).extend(logprobs.content)

    def attach(self, choice: ChatStreamChoice) -> None:
        if self.ids.get(choice.index):
            choice.token_ids = self.ids.pop(choice.index)
        if self.logprobs.get(choice.index):
            choice.logprobs = ChatLogprobs(content=self.logprobs.pop(choice.index))


def _thinking_choice(index: int, reasoning: str) -> ChatStreamChoice:
    return ChatStreamChoice(index=index, delta=ChatDelta(reasoning=reasoning))


def render_messages(
    processor: Processor,
    request: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest,
    chat_template: str | None,
) -> tuple[str, list[int]]:
    """`(text, token ids)` of the request's messages through the chat template, with its
    template options: what the chat endpoint generates from, and what /tokenize counts.

    Raises:
        APIError: 400 naming `messages` when the template cannot render them.
    """
    messages = [
        _as_template_message(message, f"messages[{index}].content")
        for index, message in enumerate(request.messages or [])
    ]
    try:
        return processor.render_chat(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            add_special_tokens=bool(request.add_special_tokens),  # /tokenize's None: False
            # Chat's carry its reasoning_effort; /tokenize's and the embeddings' have none.
            chat_template_kwargs=request.template_variables()
            if isinstance(request, ChatCompletionRequest)
            else request.chat_template_kwargs,
            tools=None if request.tools is None else template_tools(request.tools),
            chat_template=chat_template,
        )
    except ValueError as e:
        raise APIError(str(e), param="messages") from e


# vLLM's text-like content parts, each with the field that holds its text.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def join_text_parts(parts: list[Any], where: str, param: str) -> str:
    """A message's content parts as one string, joined by newlines as vLLM renders them.

    Raises:
        APIError: 400 (`param`) naming the part at `where` that is not text (an image, audio).
    """
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        field = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None:
            raise APIError(
                f"{where}[{index}]: only text content parts ({', '.join(TEXT_PARTS)}) are "
                f"supported, got {kind!r}",
                param=param,
            )
        if not isinstance(part.get(field), str):
            message = f"{where}[{index}]: a {kind!r} part needs a string {field!r}"
            raise APIError(message, param=param)
        texts.append(part[field])
    return "\n".join(texts)


def _as_template_message(message: ChatMessage, where: str) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = join_text_parts(content, where, "messages")
    fields = {"role": message.role, "content": content or ""}
    thinking = message.reasoning if message.reasoning is not None else message.reasoning_content
    if thinking is not None:  # under both names: templates read `reasoning_content` (Qwen3's)
        fields.update(reasoning=thinking, reasoning_content=thinking)
    if message.tool_calls is not None:  # arguments decoded: templates iterate them as objects
        fields["tool_calls"] = [decoded_tool_call(call) for call in message.tool_calls]
    for name in ("tool_call_id", "name"):
        if getattr(message, name) is not None:
            fields[name] = getattr(message, name)
    return fields


def _stream_choice(
    output: CompletionOutput, request: ChatCompletionRequest, reasoning: str | None = None
) -> ChatStreamChoice:
    content = None if reasoning and not output.text else output.text
    return ChatStreamChoice(
        index=output.index,
        delta=ChatDelta(content=content, reasoning=reasoning or None),
        logprobs=_chat_logprobs(output, request),
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def _chat_logprobs(output: CompletionOutput, request: ChatCompletionRequest) -> ChatLogprobs | None:
    if output.logprobs is None:
        return None
    num_top = request.top_logprobs or 0
    num_top = None if num_top == -1 else num_top  # vLLM's -1: every token's
    as_ids = request.return_tokens_as_token_ids
    content = []
    for sampled, ranked in sampled_logprobs(output.token_ids, output.logprobs):
        top = [_top_logprob(token_id, lp, as_ids) for token_id, lp in ranked[:num_top]]
        token = _top_logprob(*sampled, as_ids)
        content.append(ChatTokenLogprob(**token.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_logprob(token_id: int, logprob: Logprob, as_ids: bool) -> TopLogprob:
    token = token_name(token_id, logprob.decoded_token, as_ids)
    return TopLogprob(token=token, logprob=finite(logprob.logprob), bytes=list(token.encode()))
