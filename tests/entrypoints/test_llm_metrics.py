"""LLM.get_metrics() (vLLM's, with disable_log_stats=False): the server's Prometheus metrics
recorded offline, read as Counter / Gauge / Histogram objects that add up to what ran; the
stats line; and the error of an engine that records none (LLM's default)."""

from __future__ import annotations

import logging

import pytest

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, make_llm
from v1engine.engine import stat_logger
from v1engine.engine.metrics_reader import Counter, Gauge, Histogram
from v1engine.sampling_params import SamplingParams


def _by_name(metrics, kind, name: str, **labels):
    found = [
        m
        for m in metrics
        if isinstance(m, kind) and m.name == name and labels.items() <= m.labels.items()
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    llm = make_llm(llama_checkpoint, disable_log_stats=False)
    yield llm
    llm.shutdown()


def test_the_metrics_add_up_to_the_requests_that_ran(llm):
    before = llm.get_metrics()
    prompt_tokens = _by_name(before, Counter, "vllm:prompt_tokens").value
    lengths = _by_name(before, Counter, "vllm:request_success", finished_reason="length").value
    params = [GREEDY] * (len(PROMPTS) - 1) + [SamplingParams(n=2, max_tokens=3, seed=1)]
    llm.generate(PROMPTS, params, use_tqdm=False)

    metrics = llm.get_metrics()
    engine_requests = len(PROMPTS) + 1  # n=2: two engine requests
    new_prompt_tokens = sum(map(len, PROMPTS)) + len(PROMPTS[-1])
    assert _by_name(metrics, Counter, "vllm:prompt_tokens").value - prompt_tokens == (
        new_prompt_tokens
    )
    done = _by_name(metrics, Counter, "vllm:request_success", finished_reason="length").value
    assert done - lengths == engine_requests
    ttft = _by_name(metrics, Histogram, "vllm:time_to_first_token_seconds")
    assert ttft.count >= engine_requests and ttft.sum > 0
    buckets = list(ttft.buckets.values())
    assert buckets == sorted(buckets) and ttft.buckets["+Inf"] == ttft.count  # cumulative
    n = _by_name(metrics, Histogram, "vllm:request_params_n")
    assert n.buckets["1.0"] >= len(PROMPTS) - 1 and n.count - n.buckets["1.0"] >= 1
    assert _by_name(metrics, Gauge, "vllm:num_requests_running").value == 0  # all done
    info = _by_name(metrics, Gauge, "vllm:cache_config_info")
    assert info.value == 1 and int(info.labels["num_gpu_blocks"]) > 0
    assert all(m.labels.get("model_name") for m in metrics if m.name != "vllm:cache_config_info")


def test_a_stop_and_an_abort_are_counted_by_their_reason(llm):
    def count(reason: str) -> int:
        metrics = llm.get_metrics()
        return _by_name(metrics, Counter, "vllm:request_success", finished_reason=reason).value

    stops, aborts = count("stop"), count("abort")
    (first,) = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:1]
    stop_at_first = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[first])
    (output,) = llm.generate([[1, 2, 3]], stop_at_first, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop"
    engine = llm.llm_engine
    engine.add_request("left", [4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort_request("left")
    assert (count("stop"), count("abort")) == (stops + 1, aborts + 1)
    # Nothing in flight after the abort: the gauges say so without another step.
    assert _by_name(llm.get_metrics(), Gauge, "vllm:num_requests_running").value == 0


def test_the_stats_line_is_logged_every_interval(llama_checkpoint, monkeypatch, caplog):
    monkeypatch.setenv("V1ENGINE_LOG_STATS_INTERVAL", "0.001")
    llm = make_llm(llama_checkpoint, disable_log_stats=False)
    try:
        with caplog.at_level(logging.INFO, logger=stat_logger.__name__):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == stat_logger.__name__]
    assert any("Avg generation throughput" in line for line in lines)


def test_an_llm_records_no_metrics_by_default_and_says_how_to(llama_checkpoint):
    llm = make_llm(llama_checkpoint)
    try:
        with pytest.raises(RuntimeError, match="disable_log_stats=False"):
            llm.get_metrics()
    finally:
        llm.shutdown()
