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

With `log_stats` (vLLM's `disable_log_stats=False`) it records the server's Prometheus metrics
(engine/metrics.py), read with `get_metrics()`, and logs the server's stats line every
V1ENGINE_LOG_STATS_INTERVAL seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from v1engine.engine.core_client import EngineCoreClient, EngineDeadError
from v1engine.engine.metrics import ServerMetrics
from v1engine.engine.metrics_reader import Metric, get_metrics_snapshot
from v1engine.engine.output_processor import OutputKind, OutputProcessor
from v1engine.engine.processor import Processor, PromptType, as_parent_error
from v1engine.engine.stat_logger import LoggingStatLogger, log_stats_interval_s
from v1engine.engine_args import EngineArgs
from v1engine.lora.request import LoRARequest
from v1engine.pooling_params import PoolingParams
from v1engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from v1engine.config import EngineConfig
    from v1engine.core.engine_core import EngineCore
    from v1engine.outputs import PoolingRequestOutput, RequestOutput
    from v1engine.request import EngineCoreOutputs, EngineCoreRequest


class LLMEngine:
    """The engine core in this process (its workers are processes), fed and read step by step.
    `skip_tokenizer_init`: no tokenizer; prompts must be token ids. `log_stats`: record metrics
    and log the stats line."""

    def __init__(
        self, config: EngineConfig, skip_tokenizer_init: bool = False, log_stats: bool = False
    ) -> None:
        self.config = config
        self.client, self.tokenizer = EngineCoreClient.start_with_tokenizer(
            config, multiprocess=False, skip_tokenizer=skip_tokenizer_init
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.processor = Processor(config, self.tokenizer, self.output_processor, self.client.info)
        self.metrics: ServerMetrics | None = None
        if log_stats:
            model_config = config.model_config
            self.metrics = ServerMetrics(model_config.model, model_config.max_model_len)
            self.metrics.set_engine_info(config.cache_config, self.client.info)
            self._stat_logger = LoggingStatLogger(self.metrics)
            self._log_interval_s = log_stats_interval_s()
            self._next_log_s = time.monotonic() + self._log_interval_s

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, skip_tokenizer_init: bool = False
    ) -> LLMEngine:
        config = engine_args.create_engine_config()
        return cls(config, skip_tokenizer_init, log_stats=not engine_args.disable_log_stats)

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
        max_tokens = getattr(params, "max_tokens", None)  # as asked (a pooling request: None)
        self.add_core_requests(request_id, requests, max_tokens)
        if self.metrics is not None and isinstance(params, SamplingParams):
            self.metrics.observe_new_request(params.n)

    def add_core_requests(
        self, request_id: str, requests: list[EngineCoreRequest], max_tokens: int | None = None
    ) -> None:
        """Sends the core requests the processor made for front-end request `request_id` (its
        n children, or itself); if the core refuses one, the whole request is aborted.
        `max_tokens`: the request's, as asked, for the metrics."""
        try:
            for request in requests:
                if self.metrics is not None:
                    num_prompt_tokens = len(request.prompt_token_ids)
                    self.metrics.add_request(request.request_id, num_prompt_tokens, max_tokens)
                try:
                    self.client.add_request(request)
                except ValueError as e:
                    raise as_parent_error(e, request.request_id, request_id) from e
        except BaseException as e:
            # A refused request is forgotten uncounted; one cut by Ctrl-C counts as aborted.
            self._abort([request_id], None if isinstance(e, ValueError) else "abort")
            raise

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Runs one engine step; returns an output for each request it advanced (none when
        no request is unfinished). A request a stop string ended is aborted in the core here."""
        if not self.output_processor.has_unfinished_requests():
            return []
        outputs = self.client.get_output()
        request_outputs, to_abort = self.output_processor.process_outputs(outputs.outputs)
        if to_abort:  # stopped by a stop string while the core was still running it
            self.client.abort_requests(to_abort)
        if self.metrics is not None:
            self._record(outputs, to_abort)
        return request_outputs

    def _record(self, outputs: EngineCoreOutputs, stopped_ids: list[str]) -> None:
        self.metrics.record_step(outputs, stopped_ids)
        if time.monotonic() >= self._next_log_s:
            self._stat_logger.log()
            self._next_log_s = time.monotonic() + self._log_interval_s

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of every metric (engine/metrics_reader.py).

        Raises:
            RuntimeError: the engine records none (started with disable_log_stats=True).
        """
        if self.metrics is None:
            raise RuntimeError(
                "this engine records no metrics: start it with disable_log_stats=False "
                "(LLM(..., disable_log_stats=False)) to read them with get_metrics()"
            )
        return get_metrics_snapshot(self.metrics.registry)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Forgets these requests (and their n children): no further outputs come for them."""
        self._abort([request_ids] if isinstance(request_ids, str) else list(request_ids), "abort")

    def _abort(self, request_ids: list[str], outcome: str | None) -> None:
        core_ids = self.processor.abort(request_ids)
        if self.metrics is not None:
            for core_id in core_ids:
                self.metrics.finish_request(core_id, outcome)
        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to abort
            self.client.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (`EngineCore.sleep`; needs enable_sleep_mode)."""
        self.client.call_utility("sleep", level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.client.call_utility("wake_up", tags=tags)

    def is_sleeping(self) -> bool:
        return self.client.call_utility("is_sleeping")

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer prompts go through (None with `skip_tokenizer_init`)."""
        return self.tokenizer

    def shutdown(self) -> None:
        self.client.shutdown()
