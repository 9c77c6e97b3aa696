"""LLMEngine: vLLM's step-by-step offline engine, the loop under `LLM`.

    engine = LLMEngine.from_engine_args(EngineArgs(model="path/to/hf_dir"))
    engine.add_request("0", "Hello, my name is", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for output in engine.step():   # RequestOutputs, cumulative, as vLLM's
            ...

It owns the in-process engine-core client (`client`: also `collective_rpc` and
`reset_prefix_cache`, which `LLM` offers), the processor (prompt -> core requests) and the
output processor (core outputs -> RequestOutputs). Each `step()` runs one engine step in this
thread and returns an output for every request it advanced. `LLM.generate` is this loop run to
the end; the API server uses `AsyncLLM` instead, whose core runs in its own process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from v1engine.engine.core_client import EngineCoreClient, EngineDeadError
from v1engine.engine.output_processor import OutputKind, OutputProcessor
from v1engine.engine.processor import Processor, PromptType, as_parent_error
from v1engine.engine_args import EngineArgs
from v1engine.lora.request import LoRARequest
from v1engine.pooling_params import PoolingParams
from v1engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from v1engine.config import EngineConfig
    from v1engine.core.engine_core import EngineCore
    from v1engine.outputs import PoolingRequestOutput, RequestOutput
    from v1engine.request import EngineCoreRequest


class LLMEngine:
    """The engine core in this process (its workers are processes), fed and read step by step.
    `skip_tokenizer_init`: no tokenizer; prompts must be token ids."""

    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool = False) -> None:
        self.config = config
        self.client, self.tokenizer = EngineCoreClient.start_with_tokenizer(
            config, multiprocess=False, skip_tokenizer=skip_tokenizer_init
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.processor = Processor(config, self.tokenizer, self.output_processor, self.client.info)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, skip_tokenizer_init: bool = False
    ) -> LLMEngine:
        return cls(engine_args.create_engine_config(), skip_tokenizer_init)

    @property
    def engine_core(self) -> EngineCore:
        return self.client.engine_core

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        output_kind: OutputKind = "cumulative",
    ) -> None:
        """Queues one prompt (text, token ids, or a dict with `prompt` / `prompt_token_ids` and
        vLLM's `cache_salt`). With SamplingParams each `step()` that advances it returns its
        output: all of it so far ("cumulative", vLLM's default), only what is new ("delta"),
        or nothing until it finishes ("final"), as `AsyncLLM.generate` takes it; with
        PoolingParams the engine's pooling task (embed or classify), one output when done.

        Raises:
            ValueError: the id is in use, or the prompt or params cannot be served; nothing
                of this request is left queued.
        """
        text, token_ids = self.processor.tokenize(prompt)
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request: pooling requests run the base model only")
            requests = [self.processor.process_pooling(request_id, token_ids, params, priority)]
        elif isinstance(params, SamplingParams):
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            requests = self.processor.process(
                request_id, text, token_ids, params, output_kind, priority, salt, lora_request
            )
        else:
            raise TypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        self.add_core_requests(request_id, requests)

    def add_core_requests(self, request_id: str, requests: list[EngineCoreRequest]) -> None:
        """Sends the core requests the processor made for front-end request `request_id` (its
        n children, or itself); if the core refuses one, the whole request is aborted."""
        try:
            for request in requests:
                try:
                    self.client.add_request(request)
                except ValueError as e:
                    raise as_parent_error(e, request.request_id, request_id) from e
        except BaseException:
            self.abort_request(request_id)
            raise

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Runs one engine step; returns an output for each request it advanced (none when
        no request is unfinished). A request a stop string ended is aborted in the core here."""
        if not self.output_processor.has_unfinished_requests():
            return []
        outputs = self.client.get_output().outputs
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:  # stopped by a stop string while the core was still running it
            self.client.abort_requests(to_abort)
        return request_outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Forgets these requests (and their n children): no further outputs come for them."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        core_ids = self.processor.abort(ids)
        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to abort
            self.client.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer prompts go through (None with `skip_tokenizer_init`)."""
        return self.tokenizer

    def shutdown(self) -> None:
        self.client.shutdown()
