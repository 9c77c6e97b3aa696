"""POST /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id}, and
POST /v1/responses/{id}/cancel for background responses (responses_background.py).

A response is a chat completion underneath (`responses_input.py` turns the request into one, and
`OpenAIServingChat` runs it), read back as output items (`responses_output.py`). Finished
responses with `store` (the default) are kept in memory, the last `--max-stored-responses`, for
retrieval and for `previous_response_id`, which continues a stored response's conversation
(its input and output, without its instructions, as OpenAI does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from functools import partial
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from v1engine.entrypoints.openai.errors import APIError
from v1engine.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from v1engine.entrypoints.openai.responses_background import BackgroundResponses, not_continuable
from v1engine.entrypoints.openai.responses_input import (
    Message,
    chat_request,
    in_responses_terms,
    input_messages,
)
from v1engine.entrypoints.openai.responses_output import ResponseBuilder, assistant_turn
from v1engine.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from v1engine.entrypoints.openai.serving_outputs import stream_events


class ResponseStore:
    """The last `capacity` stored responses, each with its conversation (the chat messages
    after the instructions, its reply included; None until a background response has its
    reply), least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[ResponsesResponse, list | None]] = OrderedDict()

    def put(self, response: ResponsesResponse, conversation: list[Message] | None) -> None:
        if self.capacity == 0:
            return
        self._entries[response.id] = (response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(
        self, response_id: str, param: str | None = None
    ) -> tuple[ResponsesResponse, list | None]:
        """Raises APIError 404 (naming `param`) for an id not stored (never, or dropped)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(
                f"no stored response has the id {response_id!r}: responses are kept in memory, "
                f"the last {self.capacity} with store=true (--max-stored-responses)",
                HTTPStatus.NOT_FOUND,
                param=param,
            )
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        """Raises APIError 404 for an id not stored."""
        self.get(response_id)
        del self._entries[response_id]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, max_stored_responses: int) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored_responses)
        self.background = BackgroundResponses()

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """Raises APIError (400, 404, 503) before anything is generated."""
        conversation = self._conversation(request)
        try:
            run = await self.chat.start(chat_request(request, conversation), raw_request)
        except APIError as e:
            raise in_responses_terms(e) from e
        skeleton = self._skeleton(request, run)
        builder = ResponseBuilder(skeleton, request.stream, request.wants_logprobs)
        if request.stream:
            events = self._stream(run, builder, request.store, conversation)
            engine_ids = [engine_id for engine_id, _ in run.runs]
            return StreamingResponse(
                stream_events(engine_ids, events, self.chat.abort_all, sse=str, done=None),
                media_type="text/event-stream",
            )
        if request.background:
            self.store.put(skeleton, None)
            reply = partial(self._reply, run, builder, True, conversation)
            self.background.start(skeleton, reply)
            return JSONResponse(skeleton.model_dump(mode="json", by_alias=True))
        response = await self._reply(run, builder, request.store, conversation, raw_request)
        return JSONResponse(response.model_dump(mode="json", by_alias=True))

    def _conversation(self, request: ResponsesRequest) -> list[Message]:
        """The chat messages to run: the previous response's conversation, then the input.
        Raises APIError 400 / 404 for settings not served or a previous response not stored."""
        if request.background and (request.stream or not request.store or not self.store.capacity):
            raise APIError(
                "background: true needs store: true on a server that stores responses (its "
                "reply is read back with GET /v1/responses/{id}; --max-stored-responses) and no "
                "stream (stream it without background instead)",
                param="background",
            )
        if request.truncation != "disabled":
            raise APIError(
                'truncation "auto" is not supported: a conversation over the context is a 400; '
                'send truncation: "disabled"',
                param="truncation",
            )
        history: list[Message] = []
        if request.previous_response_id is not None:
            previous, history = self.store.get(request.previous_response_id, "previous_response_id")
            if history is None:
                raise not_continuable(previous)
        return history + input_messages(request.input)

    async def _reply(
        self,
        run: ChatRun,
        builder: ResponseBuilder,
        store: bool,
        conversation: list[Message],
        raw_request: Request | None = None,
    ) -> ResponsesResponse:
        """The whole reply (`raw_request` None: no client waits for it, as for a background
        response)."""
        reply = await self.chat.final_response(run, raw_request)
        (choice,) = reply.choices
        builder.add_choice(choice)
        response = builder.finish(choice.finish_reason, reply.usage)
        self._remember(response, store, conversation)
        return response

    def retrieve(self, response_id: str) -> JSONResponse:
        """Raises APIError 404 for an id not stored."""
        response, _ = self.store.get(response_id)
        return JSONResponse(response.model_dump(mode="json", by_alias=True))

    async def cancel(self, response_id: str) -> JSONResponse:
        """Raises APIError 404 for an id not stored, 400 for one not running in the background."""
        response, _ = self.store.get(response_id)
        await self.background.cancel(response)
        return JSONResponse(response.model_dump(mode="json", by_alias=True))

    def delete(self, response_id: str) -> JSONResponse:
        """Raises APIError 404 for an id not stored; a running background response stops."""
        self.store.delete(response_id)
        self.background.forget(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _stream(
        self, run: ChatRun, builder: ResponseBuilder, store: bool, conversation: list[Message]
    ) -> AsyncIterator[str]:
        builder.start()
        finish_reason, usage = None, None
        async for chunk in self.chat.stream_chunks(run):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                builder.add_stream_choice(choice)
                finish_reason = choice.finish_reason or finish_reason
            for event in builder.take_events():
                yield event
        response = builder.finish(finish_reason, usage)
        self._remember(response, store, conversation)
        for event in builder.take_events():
            yield event

    def _remember(
        self, response: ResponsesResponse, store: bool, conversation: list[Message]
    ) -> None:
        if store:
            self.store.put(response, conversation + [assistant_turn(response)])

    def _skeleton(self, request: ResponsesRequest, run: ChatRun) -> ResponsesResponse:
        """The response before its output: its id and the request's settings, echoed."""
        echoed: dict[str, Any] = {
            name: getattr(request, name)
            for name in (
                "instructions",
                "previous_response_id",
                "max_output_tokens",
                "temperature",
                "top_p",
                "top_logprobs",
                "parallel_tool_calls",
                "metadata",
                "store",
                "background",
                "truncation",
                "user",
            )
        }
        echoed["tools"] = request.tools or []
        echoed["tool_choice"] = request.tool_choice or ("auto" if request.tools else "none")
        if request.text is not None:
            echoed["text"] = request.text
        return ResponsesResponse(
            id="resp_" + run.request_id.removeprefix("chatcmpl-"),
            model=self.chat.models.response_model(request),
            status="in_progress",
            **echoed,
        )
