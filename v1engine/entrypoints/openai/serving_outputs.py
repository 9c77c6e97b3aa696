"""Engine outputs on their way to a response: usage, the steps worth a streamed chunk, the
merging of a batch's streams (one engine request per prompt) into one, and server-sent events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from pydantic import BaseModel

from v1engine.engine.core_process import EngineDeadError
from v1engine.entrypoints.openai.errors import APIError, internal_error
from v1engine.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from v1engine.logger import init_logger
from v1engine.outputs import CompletionOutput, Logprob, RequestOutput

logger = init_logger(__name__)

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


class StreamTally:
    """What one engine request's stream has sent so far, for the usage chunks."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None
        self.tokens_by_choice: dict[int, int] = {}  # choice (completion) index -> its tokens
        # Only the first delta carries them; a choice that starts later still needs them.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_completion_tokens(self) -> int:
        """The tokens all choices have generated so far."""
        return sum(self.tokens_by_choice.values())


async def stream_steps(
    outputs: AsyncIterator[RequestOutput], tally: StreamTally
) -> AsyncIterator[list[CompletionOutput]]:
    """Per engine step, the choices worth a chunk (new text, new tokens or a finish); both
    endpoints stream through this, so they send and count alike."""
    async for output in outputs:
        tally.last = output
        if output.prompt_logprobs is not None:
            tally.prompt_logprobs = output.prompt_logprobs
        sendable = []
        for completion in output.outputs:
            count = tally.tokens_by_choice.get(completion.index, 0) + len(completion.token_ids)
            tally.tokens_by_choice[completion.index] = count
            if completion.text or completion.finished() or completion.token_ids:
                sendable.append(completion)
        if sendable:
            yield sendable


async def merge_async_iterators(
    iterators: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """The items of all iterators as they come, each with its iterator's index. The first
    error ends the merge; closing the merge cancels what is still being awaited."""
    pending = {asyncio.ensure_future(anext(it)): index for index, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()


def make_usage(output: RequestOutput, num_completion_tokens: int) -> UsageInfo:
    num_prompt_tokens = len(output.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


def choice_usage(tally: StreamTally, index: int, continuous: bool) -> UsageInfo | None:
    """A streamed chunk's usage: with vLLM's `continuous_usage_stats` (`continuous`), its
    choice's so far (the prompt, and the tokens that choice has generated); else none."""
    if not continuous or tally.last is None:
        return None
    return make_usage(tally.last, tally.tokens_by_choice.get(index, 0))


def sum_usage(usages: list[UsageInfo]) -> UsageInfo:
    """A batch's usage: its prompts' usages added up."""
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    return UsageInfo(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        total_tokens=sum(u.total_tokens for u in usages),
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def data_event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def stream_events(
    request_ids: list[str],
    chunks: AsyncIterator[T],
    abort: Callable[[list[str]], None],
    sse: Callable[[T], str] = data_event,
    done: str | None = SSE_DONE,
) -> AsyncIterator[str]:
    """Server-sent events of `chunks` (`sse` writes one), an engine death as an error event,
    then `done` ([DONE] as OpenAI ends a completion stream; None: nothing).

    The client disconnecting cancels this generator (Starlette does), which aborts the
    request's engine requests (`abort(request_ids)`, as when it ends).
    """
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except EngineDeadError as e:
        logger.debug("stream %s ended: %s", request_ids[0], e)
        yield APIError.unavailable(e).to_sse()
    except Exception:
        logger.exception("stream %s failed", request_ids[0])
        yield internal_error().to_sse()
    finally:
        abort(request_ids)
    if done is not None:
        yield done
