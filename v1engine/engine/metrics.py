"""Prometheus metrics of one server under vLLM's names, labels and buckets (so a vLLM dashboard
or alert rule reads them unchanged), in a private registry (two servers in one process, as in
tests, must not collide in the global one). Every series carries `model_name`, the first served
model name.

Where each comes from, as in vLLM:
- running, waiting, KV cache usage, preemptions, prefix-cache queries and hits, and speculative
  decoding's drafts, draft tokens and accepted tokens: the scheduler stats the engine core sends
  with each step's outputs (the counts there are cumulative, so the counters add what changed
  since the last stats);
- per engine request (an n > 1 request counts n times), tracked here from its outputs
  (`RequestStats`): time to first token and end-to-end latency from its arrival in this process;
  inter-token latency, queue, prefill, decode and inference times on the engine core's clock
  (`EngineCoreOutputs.timestamp`, and the queued and first-scheduled times sent with a request's
  first output); prompt tokens once its prefill is done, generated tokens as they come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from v1engine.core_protocol import EngineCoreInfo
from v1engine.request import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

# Finished requests are counted by vLLM's finished_reason: "stop" (EOS, stop token or string),
# "length" (max_tokens or the context), "abort" (the client went away or the server shut down)
# or "error" (the engine died while the request ran).
FINISHED_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets.
_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class RequestStats:
    """One engine request as the front end saw it: `arrival_s` on this process's monotonic
    clock; the `*_ts` on the engine core's (0.0: not yet), compared only with each other."""

    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int | None
    num_generation_tokens: int = 0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0


class ServerMetrics:
    """Args:
    model_name: the `model_name` label (the first served model name).
    max_model_len: the context length; the token-count histograms' buckets reach it.
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests: dict[str, RequestStats] = {}  # by engine (child) request id
        self._last_stats = SchedulerStats()
        self.lora_info: Gauge | None = None  # with LoRA (set_engine_info)
        self._add_gauges_and_counters()
        self._add_spec_decode_counters()
        self._add_latency_histograms()
        self._add_count_histograms(build_1_2_5_buckets(max_model_len))

    def _labelled(self, kind: type, name: str, documentation: str, **kwargs: Any) -> Any:
        metric = kind(name, documentation, ["model_name"], registry=self.registry, **kwargs)
        return metric.labels(self.model_name)

    def _add_spec_decode_counters(self) -> None:
        add = self._labelled
        self.spec_decode = [  # (counter, the SchedulerStats field it follows)
            (add(Counter, name, help_text), field)
            for name, help_text, field in (
                (
                    "vllm:spec_decode_num_drafts",
                    "Number of spec decoding drafts.",
                    "num_spec_drafts",
                ),
                (
                    "vllm:spec_decode_num_draft_tokens",
                    "Number of draft tokens.",
                    "num_spec_draft_tokens",
                ),
                (
                    "vllm:spec_decode_num_accepted_tokens",
                    "Number of accepted tokens.",
                    "num_spec_accepted_tokens",
                ),
            )
        ]

    def _add_gauges_and_counters(self) -> None:
        add = self._labelled
        self.num_requests_running = add(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = add(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = add(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # prometheus_client appends `_total` to a counter's name.
        self.prompt_tokens = add(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = add(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.num_preemptions = add(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_cache_queries = add(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = add(
            Counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # Every series exists from the start, at zero.
        self.request_success = {r: success.labels(self.model_name, r) for r in FINISHED_REASONS}

    def _histogram(self, name: str, documentation: str, buckets: Any) -> Any:
        return self._labelled(Histogram, name, documentation, buckets=buckets)

    def _add_latency_histograms(self) -> None:
        add = self._histogram
        self.time_to_first_token = add(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS_S,
        )
        self.inter_token_latency = add(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _TOKEN_LATENCY_BUCKETS_S,
        )
        self.request_time_per_output_token = add(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TOKEN_LATENCY_BUCKETS_S,
        )
        self.e2e_request_latency = add(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_queue_time = add(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_inference_time = add(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_prefill_time = add(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_decode_time = add(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS_S,
        )

    def _add_count_histograms(self, token_buckets: list[int]) -> None:
        add = self._histogram
        self.request_prompt_tokens = add(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = add(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_params_n = add(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.request_params_max_tokens = add(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.iteration_tokens = add(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKENS_BUCKETS,
        )

    def set_engine_info(self, cache_config: Any, engine: EngineCoreInfo) -> None:
        """vLLM's info gauges: vllm:cache_config_info, the cache configuration as labels of a
        series set to 1; with LoRA, vllm:lora_requests_info (see update_scheduler_stats)."""
        info = {f.name: str(getattr(cache_config, f.name)) for f in fields(cache_config)}
        info.update(model_name=self.model_name, num_gpu_blocks=str(engine.num_blocks))
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            list(info),
            registry=self.registry,
        )
        gauge.labels(**info).set(1)
        if engine.max_loras:
            self._add_lora_info(engine.max_loras)

    def _add_lora_info(self, max_loras: int) -> None:
        """vllm:lora_requests_info: the adapters running and waiting (names, comma-separated)
        as labels of a series set to the time they were last seen so."""
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self.max_loras = max_loras

    # -- recording ---------------------------------------------------------------------------
    def record_step(self, outputs: EngineCoreOutputs, stopped_ids: list[str]) -> None:
        """One engine step: its scheduler stats and outputs; `stopped_ids` are the requests
        the front end finished by a stop string (which only it sees)."""
        if outputs.scheduler_stats is not None:
            self.update_scheduler_stats(outputs.scheduler_stats)
        self.observe_outputs(outputs)
        for core_id in stopped_ids:
            self.finish_request(core_id, "stop")
        self._reset_if_idle()  # stats of a step run for requests aborted since

    def update_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if self.lora_info is not None:
            self.lora_info.labels(
                str(self.max_loras),
                ",".join(stats.waiting_lora_adapters),
                ",".join(stats.running_lora_adapters),
            ).set_to_current_time()
        last, self._last_stats = self._last_stats, stats
        self.num_preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        queries = stats.num_prefix_cache_query_tokens - last.num_prefix_cache_query_tokens
        hits = stats.num_prefix_cache_hit_tokens - last.num_prefix_cache_hit_tokens
        self.prefix_cache_queries.inc(max(queries, 0))
        self.prefix_cache_hits.inc(max(hits, 0))
        if stats.num_spec_drafts != last.num_spec_drafts:  # an engine that speculates
            for counter, field in self.spec_decode:
                counter.inc(max(getattr(stats, field) - getattr(last, field), 0))

    def reset_idle_gauges(self) -> None:
        self.num_requests_running.set(0)
        self.num_requests_waiting.set(0)
        self.kv_cache_usage.set(0)

    def _reset_if_idle(self) -> None:
        # The core sends stats only with outputs, so once no tracked request is in flight (the
        # last one finished or was aborted) its last stats would stay: nothing runs or waits.
        if not self.requests:
            self.reset_idle_gauges()

    def add_request(self, core_id: str, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Starts tracking one engine request, as it is sent."""
        stats = RequestStats(time.monotonic(), num_prompt_tokens, max_tokens)
        self.requests[core_id] = stats

    def observe_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Records one engine step's outputs of the tracked requests (the others were aborted
        or stopped by a stop string: no longer counted)."""
        num_step_tokens = 0
        for output in outputs.outputs:
            stats = self.requests.get(output.request_id)
            if stats is None:
                continue
            if output.new_token_ids:
                num_step_tokens += self._observe_tokens(stats, output, outputs.timestamp)
            elif output.pooling_output is not None:  # an embedding: its prompt, and no tokens
                self.prompt_tokens.inc(stats.num_prompt_tokens)
                num_step_tokens += stats.num_prompt_tokens
            if output.finished:
                self.finish_request(output.request_id, str(output.finish_reason))
        if num_step_tokens:
            self.iteration_tokens.observe(num_step_tokens)

    def _observe_tokens(
        self, stats: RequestStats, output: EngineCoreOutput, timestamp: float
    ) -> int:
        """Returns the tokens the step processed for the request: its prompt's with its first
        token (its prefill finished), and the new ones."""
        num_new = len(output.new_token_ids)
        self.generation_tokens.inc(num_new)
        stats.num_generation_tokens += num_new
        num_step_tokens = num_new
        if stats.first_token_ts == 0.0:
            self.time_to_first_token.observe(time.monotonic() - stats.arrival_s)
            self.prompt_tokens.inc(stats.num_prompt_tokens)
            num_step_tokens += stats.num_prompt_tokens
            # Sent with the first output only; a preempted request's later schedules do not
            # move them (vLLM's intervals ignore preemptions too).
            stats.scheduled_ts = output.scheduled_ts
            self.request_queue_time.observe(max(output.scheduled_ts - output.queued_ts, 0.0))
            self.request_prefill_time.observe(max(timestamp - output.scheduled_ts, 0.0))
            stats.first_token_ts = timestamp
        else:
            self.inter_token_latency.observe(timestamp - stats.last_token_ts)
        stats.last_token_ts = timestamp
        return num_step_tokens

    def observe_new_request(self, n: int) -> None:
        self.request_params_n.observe(n)

    def finish_request(self, core_id: str, finished_reason: str | None) -> None:
        """Counts the request by `finished_reason` and records its histograms; None forgets it
        uncounted (the engine refused it). An untracked id (already counted) is ignored."""
        stats = self.requests.pop(core_id, None)
        self._reset_if_idle()
        if stats is None or finished_reason is None:
            return
        self.request_success[finished_reason].inc()
        self.e2e_request_latency.observe(time.monotonic() - stats.arrival_s)
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        if stats.max_tokens is not None:
            self.request_params_max_tokens.observe(stats.max_tokens)
        if stats.first_token_ts == 0.0:
            return  # never ran to a first token: no engine-side intervals
        decode_s = stats.last_token_ts - stats.first_token_ts
        self.request_decode_time.observe(decode_s)
        self.request_inference_time.observe(stats.last_token_ts - stats.scheduled_ts)
        if stats.num_generation_tokens > 1:
            self.request_time_per_output_token.observe(decode_s / (stats.num_generation_tokens - 1))

    def finish_all(self, finished_reason: str) -> None:
        for core_id in list(self.requests):
            self.finish_request(core_id, finished_reason)

    def value(self, name: str) -> float:
        """A series' current value by its exposition name (e.g. "vllm:prompt_tokens_total");
        for series labelled by the model name only."""
        value = self.registry.get_sample_value(name, {"model_name": self.model_name})
        if value is None:
            raise KeyError(f"no series {name!r} in the server's metrics")
        return value

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
