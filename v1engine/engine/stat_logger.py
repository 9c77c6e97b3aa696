"""vLLM's periodic stats line in the server's log, e.g.

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4
    reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 25.0%

every `log_stats_interval_s()` seconds (V1ENGINE_LOG_STATS_INTERVAL, default 10, as vLLM's
VLLM_LOG_STATS_INTERVAL) unless the server runs with --disable-log-stats. Throughputs and the hit
rate are over the interval, read from the server's Prometheus metrics (engine/metrics.py); an
idle server logs at DEBUG, so the log shows one line for the interval that went idle, then none.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from v1engine.logger import init_logger

if TYPE_CHECKING:  # the server's start-up reads the interval before it imports the metrics
    from v1engine.engine.metrics import ServerMetrics

logger = init_logger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0


def log_stats_interval_s() -> float:
    """The interval from V1ENGINE_LOG_STATS_INTERVAL (seconds, > 0).

    Raises:
        ValueError: the variable is set but not a positive number.
    """
    value = os.environ.get("V1ENGINE_LOG_STATS_INTERVAL")
    if value is None:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        interval_s = float(value)
    except ValueError:
        interval_s = 0.0
    if not interval_s > 0:
        raise ValueError(
            f"V1ENGINE_LOG_STATS_INTERVAL must be a number of seconds > 0 (e.g. 10), got {value!r}"
        )
    return interval_s


@dataclass(frozen=True)
class _Totals:
    time_s: float
    prompt_tokens: float
    generation_tokens: float
    prefix_cache_queries: float
    prefix_cache_hits: float
    spec_drafts: float
    spec_draft_tokens: float
    spec_accepted_tokens: float


class LoggingStatLogger:
    """Logs what the server did since the last `log()` (the first covers the time since this
    object was made)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._last = self._totals()
        self._last_was_idle = True

    def _totals(self) -> _Totals:
        value = self.metrics.value
        return _Totals(
            time.monotonic(),
            value("vllm:prompt_tokens_total"),
            value("vllm:generation_tokens_total"),
            value("vllm:prefix_cache_queries_total"),
            value("vllm:prefix_cache_hits_total"),
            value("vllm:spec_decode_num_drafts_total"),
            value("vllm:spec_decode_num_draft_tokens_total"),
            value("vllm:spec_decode_num_accepted_tokens_total"),
        )

    def log(self) -> None:
        now, last = self._totals(), self._last
        self._last = now
        elapsed_s = max(now.time_s - last.time_s, 1e-9)
        prompt_rate = (now.prompt_tokens - last.prompt_tokens) / elapsed_s
        generation_rate = (now.generation_tokens - last.generation_tokens) / elapsed_s
        queries = now.prefix_cache_queries - last.prefix_cache_queries
        hits = now.prefix_cache_hits - last.prefix_cache_hits
        idle = prompt_rate == 0 and generation_rate == 0
        log = logger.debug if idle and self._last_was_idle else logger.info
        self._last_was_idle = idle
        value = self.metrics.value
        log(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            prompt_rate,
            generation_rate,
            value("vllm:num_requests_running"),
            value("vllm:num_requests_waiting"),
            100 * value("vllm:kv_cache_usage_perc"),
            100 * hits / queries if queries > 0 else 0.0,
        )
        if now.spec_drafts > last.spec_drafts:
            self._log_spec_decoding(now, last)

    @staticmethod
    def _log_spec_decoding(now: _Totals, last: _Totals) -> None:
        """vLLM's line: a step's acceptance length counts the token after the drafts too."""
        drafts = now.spec_drafts - last.spec_drafts
        drafted = now.spec_draft_tokens - last.spec_draft_tokens
        accepted = now.spec_accepted_tokens - last.spec_accepted_tokens
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
            "tokens, Draft acceptance rate: %.1f%%",
            1 + accepted / drafts,
            accepted,
            drafted,
            100 * accepted / drafted if drafted > 0 else 0.0,
        )

    async def run(self, interval_s: float) -> None:
        """Logs every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.log()
