"""AsyncLLM: the asyncio front of an engine core process (vLLM's name), the API server's and,
through `from_engine_args` and `generate`, any asyncio program's. It owns the `AsyncMPClient`,
the `Processor` (prompt -> core requests), the `OutputProcessor` (detokenizer, stop strings,
n > 1 fan-in) and one output loop task, the client's only reader:

    while True:
        outputs = await client.get_output()          # one engine step
        request_outputs, to_abort = output_processor.process_outputs(outputs.outputs)
        abort `to_abort` in the core (a stop string ended them there)
        put each RequestOutput on its request's asyncio.Queue

Each HTTP handler adds its request (`add_request`, which raises ValueError for bad input before
anything is sent) and iterates the outputs it returns (one asyncio.Queue per request); leaving
that iteration early (client gone, handler cancelled) aborts the request in the core. When the
engine dies, every queue gets the EngineDeadError, later calls raise it, and `on_dead` runs once
(the server then exits). When the server stops, `end_requests` does the same with a
ServerShutdownError for whatever its grace period did not let finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from v1engine.config import EngineConfig
from v1engine.engine.async_control import AsyncEngineControl
from v1engine.engine.beam_search import AsyncBeamSearch
from v1engine.engine.core_process import (
    EngineDeadError,
    EngineSleepingError,
    RequestAbortedError,
    ServerShutdownError,
    summarize_dead_reason,
)
from v1engine.engine.metrics import ServerMetrics
from v1engine.engine.output_processor import OutputKind, OutputProcessor
from v1engine.engine.pooling_state import PooledOutput
from v1engine.engine.processor import Processor, PromptType, as_parent_error
from v1engine.logger import init_logger
from v1engine.lora.request import LoRARequest
from v1engine.outputs import RequestOutput
from v1engine.pooling_params import PoolingParams
from v1engine.request import EngineCoreOutputs, EngineCoreRequest
from v1engine.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from v1engine.engine.core_client import AsyncMPClient
    from v1engine.engine_args import EngineArgs

logger = init_logger(__name__)


class AsyncLLM(AsyncEngineControl):
    """Engine-wide calls (prefix cache, profiler, sleep mode, collective_rpc): async_control.py.

    Args:
    client: an `AsyncMPClient` (or anything with its async add/abort/get_output methods).
    tokenizer: the model's tokenizer, for the detokenizer and stop strings.
    config: the engine configuration the client was built from.
    metrics: where request counts and latencies go (it tracks each engine request from its
        send to its finish).
    """

    def __init__(
        self, client: AsyncMPClient, tokenizer: Any, config: EngineConfig, metrics: ServerMetrics
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        metrics.set_engine_info(config.cache_config, client.info)
        self.output_processor = OutputProcessor(tokenizer)
        self.processor = Processor(config, tokenizer, self.output_processor, client.info)
        self.dead_reason: str | None = None
        self._closed = False  # new requests are refused: the engine died or the server stops
        self._stopped = False  # the output loop is gone: nothing is sent to the core any more
        self._queues: dict[str, asyncio.Queue] = {}
        self._background: set[asyncio.Task] = set()  # abort sends, kept alive until done
        self._beam_searches: dict[str, asyncio.Task] = {}  # request id -> its search's steps
        self._generate_ids: dict[str, str] = {}  # `generate`'s request id -> its engine id
        self._output_loop: asyncio.Task | None = None
        self._on_dead: Callable[[], None] | None = None

    # -- lifetime ------------------------------------------------------------------------------
    def start(self, on_dead: Callable[[], None] | None = None) -> None:
        """Starts the output loop on the running event loop; `on_dead` runs if the engine dies."""
        self._on_dead = on_dead
        self._output_loop = asyncio.get_running_loop().create_task(self._run_output_loop())

    def end_requests(self) -> None:
        """Ends every request in flight with a ServerShutdownError (its response then ends
        with a 503 rather than being cancelled) and refuses new ones: the server's grace
        period for running requests is over. What still runs in the core is aborted there."""
        self._fail_all(ServerShutdownError("the server is shutting down"), outcome="abort")

    async def stop(self) -> None:
        """Ends what is still in flight, then stops the output loop (the server is going away)."""
        if not self._closed:
            self.end_requests()
        self._stopped = True
        for search in self._beam_searches.values():
            search.cancel()
        await asyncio.gather(*self._beam_searches.values(), return_exceptions=True)
        if self._output_loop is not None:
            self._output_loop.cancel()
            await asyncio.gather(self._output_loop, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # -- vLLM's API for asyncio code --------------------------------------------------------------
    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        """Starts an engine for asyncio code (the default model when `model` is None): the
        loop of its first `generate` drives it; `shutdown()`, or leaving `async with`, stops it.
        Raises ValueError / RuntimeError for bad arguments or an engine that cannot start."""
        from v1engine.engine.core_client import EngineCoreClient
        from v1engine.model.hf_config import default_model_path

        if engine_args.model is None:
            engine_args = dataclasses.replace(engine_args, model=default_model_path())
        config = engine_args.create_engine_config()
        client, tokenizer = EngineCoreClient.start_with_tokenizer(config, multiprocess=True)
        max_model_len = config.scheduler_config.max_model_len
        return cls(client, tokenizer, config, ServerMetrics(engine_args.model, max_model_len))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        output_kind: OutputKind = "cumulative",
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine steps: all of its output so far ("cumulative"),
        what is new ("delta") or the last only ("final"); `sampling_params` None: the model's
        defaults. Closing it early (`aclose()`) aborts it. Raises ValueError for a request that
        cannot be served, EngineDeadError when the engine died before or while it ran."""
        if self._output_loop is None:
            self.start()
        params = sampling_params or SamplingParams(**self.config.model_config.sampling_defaults)
        text, token_ids = await asyncio.to_thread(self.processor.tokenize, prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        # A unique engine id: an id reused right after an abort would get the aborted
        # request's last outputs, still on their way (vLLM suffixes its ids alike).
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        outputs = await self.add_request(
            engine_id, text, token_ids, params, output_kind, priority, salt, lora_request
        )
        self._generate_ids[request_id] = engine_id
        try:
            async for output in outputs:
                output.request_id = request_id  # a new object each step: the caller's id
                yield output
        finally:
            if self._generate_ids.get(request_id) == engine_id:  # not a later call's, same id
                del self._generate_ids[request_id]
            await outputs.aclose()  # aborts the request if it still runs

    def shutdown(self) -> None:
        """Stops the engine core and its workers (idempotent; on the engine loop's thread or once
        that loop ended); requests still running end with an EngineDeadError."""
        if not self._closed:
            self._fail_all(EngineDeadError("the engine was shut down"), outcome="abort")
        self._stopped = True
        if self._output_loop is not None:
            self._output_loop.cancel()
        self.client.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
        await self.stop()  # waits for the tasks the shutdown cancelled

    async def check_health(self) -> None:
        if self._closed:  # dead, or shut down (or shutting down)
            raise EngineDeadError(self.dead_reason or "the engine was shut down")

    # -- requests ------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Sends the request's n engine requests; returns its outputs, to iterate until it
        finishes (outputs that arrive before the iteration starts wait in its queue). The
        other arguments: see `Processor.process`.

        Raises:
            ValueError: the request cannot be served (prompt too long, bad sampling values);
                nothing of it stays in the engine.
            EngineDeadError: the engine is dead.
        """
        fields = {"priority": priority, "cache_salt": cache_salt, "lora_request": lora_request}
        process = partial(self.processor.process, request_id, prompt, prompt_token_ids, params)
        outputs = await self._send(
            request_id, lambda: process(output_kind, **fields), params.max_tokens
        )
        self.metrics.observe_new_request(params.n)
        return outputs

    async def encode(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
        task: str | None = None,
    ) -> AsyncIterator[PooledOutput]:
        """Sends a pooling request (`task`: "embed" or "classify"; None: the model's); returns
        its one output to iterate, as `add_request` does (and raises as it does)."""
        process = self.processor.process_pooling
        return await self._send(
            request_id,
            lambda: [process(request_id, prompt_token_ids, params, priority, task)],
            max_tokens=None,
        )

    async def _send(
        self,
        request_id: str,
        process: Callable[[], list[EngineCoreRequest]],
        max_tokens: int | None,
    ) -> AsyncIterator[Any]:
        """Registers the request (`process` returns its core requests), sends them, and returns
        its outputs; on any error nothing of it stays in the engine."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise ServerShutdownError("the server is shutting down")
        if self.sleeping:
            raise EngineSleepingError("the engine is asleep (sleep mode); wake it up first")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        sent: list[str] = []  # a send cancelled half-way may have reached the core: counted
        try:
            for request in process():
                self.metrics.add_request(
                    request.request_id, len(request.prompt_token_ids), max_tokens
                )
                sent.append(request.request_id)
                try:
                    await self.client.add_request(request)
                except ValueError as e:
                    sent.pop()  # refused before anything was sent
                    raise as_parent_error(e, request.request_id, request_id) from e
        except BaseException as e:
            # Cancelled (the client left while its request was being added): an abort.
            self._forget(request_id, "abort" if isinstance(e, asyncio.CancelledError) else None)
            self._abort_in_core(sent)
            raise
        return self._stream_outputs(request_id, queue)

    async def beam_search(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        output_kind: OutputKind,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Starts a beam search (one-token steps sent as requests f"{request_id}-beam{step}-{i}",
        see engine/beam_search.py, with `lora_request`'s adapter); returns its outputs, as
        `add_request` does: here one RequestOutput once the search is done, its completions the
        best sequences first (whole, whatever `output_kind`).

        Raises:
            ValueError: the prompt cannot be served (its first step is sent before this returns).
            EngineDeadError: the engine is dead.
        """
        del output_kind  # one output, which is both the whole result and all that is new
        task, queue = await AsyncBeamSearch.start(
            self, request_id, prompt, prompt_token_ids, params, lora_request
        )
        self._queues[request_id] = queue
        self._beam_searches[request_id] = task
        task.add_done_callback(lambda _: self._beam_searches.pop(request_id, None))
        return self._stream_outputs(request_id, queue)

    async def _stream_outputs(
        self, request_id: str, queue: asyncio.Queue
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; leaving early aborts it.

        Raises:
            EngineDeadError: the engine died before the request finished.
            RequestAbortedError: `abort(request_id)` was called meanwhile.
        """
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(request_id)

    def abort(self, request_id: str, outcome: str | None = "abort") -> None:
        """Forgets the request (a `generate` request by its caller's id) and aborts what of it
        still runs in the core; its reader gets a RequestAbortedError. Synchronous (the send
        goes on in a task), so it works inside a cancelled task or a closing generator."""
        request_id = self._generate_ids.get(request_id, request_id)
        self._abort_in_core(self._forget(request_id, outcome))

    def _forget(self, request_id: str, outcome: str | None) -> list[str]:
        """Drops the request's front-end state; returns its engine requests still running."""
        search = self._beam_searches.pop(request_id, None)
        if search is not None:
            search.cancel()
        queue = self._queues.pop(request_id, None)
        if queue is not None:  # wakes a reader still waiting for the request's outputs
            queue.put_nowait(RequestAbortedError(f"request {request_id!r} was aborted"))
        core_ids = self.processor.abort([request_id])
        for core_id in core_ids:
            self.metrics.finish_request(core_id, outcome)
        return core_ids

    def _abort_in_core(self, core_ids: list[str]) -> None:
        if core_ids and self.dead_reason is None and not self._stopped:
            task = asyncio.get_running_loop().create_task(self._send_abort(core_ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_abort(self, core_ids: list[str]) -> None:
        try:
            await self.client.abort_requests(core_ids)
        except EngineDeadError:
            pass  # the output loop reports the death

    # -- the output loop -------------------------------------------------------------------------
    async def _run_output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output()
                await self._process(outputs)
        except EngineDeadError as e:
            self._set_dead(str(e))
        except Exception as e:
            # A bug here would leave every request waiting forever: treat it as fatal.
            logger.exception("the engine output loop failed")
            self._set_dead(f"the engine output loop failed: {type(e).__name__}: {e}")

    async def _process(self, outputs: EngineCoreOutputs) -> None:
        request_outputs, to_abort = self.output_processor.process_outputs(outputs.outputs)
        self.metrics.record_step(outputs, to_abort)
        for request_output in request_outputs:
            queue = self._queues.get(request_output.request_id)
            if queue is not None:
                queue.put_nowait(request_output)
            if request_output.finished:
                self._queues.pop(request_output.request_id, None)
        if to_abort:
            await self.client.abort_requests(to_abort)

    # -- death -----------------------------------------------------------------------------------
    def _set_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        # Once: the engine core logged the whole reason, tracebacks included, when it sent it.
        logger.error("engine is dead: %s", summarize_dead_reason(reason))
        self.dead_reason = reason
        self._fail_all(EngineDeadError(reason), outcome="error")
        if self._on_dead is not None:
            self._on_dead()

    def _fail_all(self, error: EngineDeadError, outcome: str) -> None:
        self._closed = True
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(error)
        self.metrics.finish_all(outcome)
