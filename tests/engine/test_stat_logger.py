"""The server's periodic stats line (engine/stat_logger.py) over real ServerMetrics fed as the
output loop feeds them: the interval's throughputs and prefix-cache hit rate, the scheduler's
gauges, one INFO line when the server goes idle and DEBUG after, and the interval's variable."""

from __future__ import annotations

import logging

import pytest

from v1engine.engine import stat_logger
from v1engine.engine.metrics import ServerMetrics
from v1engine.engine.stat_logger import LoggingStatLogger, log_stats_interval_s
from v1engine.request import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(stat_logger, "time", clock)  # this module's clock only
    return clock


def _step(metrics: ServerMetrics, stats: SchedulerStats, tokens: dict[str, int]) -> None:
    outputs = [EngineCoreOutput(request_id, [7] * n) for request_id, n in tokens.items()]
    metrics.observe_outputs(EngineCoreOutputs(outputs, stats))
    metrics.update_scheduler_stats(stats)


def _lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == stat_logger.__name__]


def test_a_line_reports_the_interval(clock, caplog):
    caplog.set_level(logging.DEBUG, logger=stat_logger.__name__)
    metrics = ServerMetrics("m", 2048)
    logger = LoggingStatLogger(metrics)
    metrics.add_request("a", num_prompt_tokens=30, max_tokens=None)
    metrics.add_request("b", num_prompt_tokens=50, max_tokens=None)
    stats = SchedulerStats(
        2, 1, 0.25, num_prefix_cache_query_tokens=80, num_prefix_cache_hit_tokens=16
    )
    _step(metrics, stats, {"a": 1, "b": 1})  # both prefills done: 80 prompt tokens
    _step(metrics, stats, {"a": 1, "b": 1})
    clock.now += 2.0
    logger.log()
    assert _lines(caplog) == [
        (
            logging.INFO,
            "Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
            "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
            "Prefix cache hit rate: 20.0%",
        )
    ]
    # The next interval counts only what came after: 4 tokens in 4 s, no new cache queries.
    caplog.clear()
    _step(metrics, stats, {"a": 2, "b": 2})
    clock.now += 4.0
    logger.log()
    assert (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1.0 tokens/s"
        in (_lines(caplog)[0][1])
    )
    assert _lines(caplog)[0][1].endswith("Prefix cache hit rate: 0.0%")


def test_going_idle_is_logged_once_then_quietly(clock, caplog):
    caplog.set_level(logging.DEBUG, logger=stat_logger.__name__)
    metrics = ServerMetrics("m", 2048)
    logger = LoggingStatLogger(metrics)
    clock.now += 10
    logger.log()  # idle from the start: nothing at INFO
    metrics.add_request("a", num_prompt_tokens=4, max_tokens=None)
    _step(metrics, SchedulerStats(1), {"a": 1})
    for _ in range(3):  # busy, then idle, then idle
        clock.now += 10
        logger.log()
        metrics.reset_idle_gauges()
    levels = [level for level, _ in _lines(caplog)]
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO, logging.DEBUG]


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("V1ENGINE_LOG_STATS_INTERVAL", raising=False)
    assert log_stats_interval_s() == 10.0
    monkeypatch.setenv("V1ENGINE_LOG_STATS_INTERVAL", "2.5")
    assert log_stats_interval_s() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("V1ENGINE_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match=rf"V1ENGINE_LOG_STATS_INTERVAL.*> 0.*{bad!r}"):
            log_stats_interval_s()
