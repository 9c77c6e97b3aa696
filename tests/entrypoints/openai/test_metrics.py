"""`/metrics` of a real server under vLLM's names, each series labelled with `model_name`, and
its values moving as requests run, finish and abort: token counters by the usage numbers,
request_success by finished_reason, prefix cache hits by the cached tokens, preemptions once the
KV cache (24 blocks here) runs out.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.server_utils import RemoteServer, serve_module
from tests.timeouts import scaled

MODEL = "tiny"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = [
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
]
# Observed once per finished engine request.
PER_REQUEST_HISTOGRAMS = [
    "time_to_first_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_time_per_output_token_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
]
HISTOGRAMS = [*PER_REQUEST_HISTOGRAMS, "inter_token_latency_seconds", "iteration_tokens_total"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    args = ("--served-model-name", MODEL, "--num-gpu-blocks-override", "24")
    yield from serve_module(tiny_model, tmp_path_factory, *args, tp=1)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


class Scrape:
    """One read of /metrics: `value(sample name, **labels)`, model_name="tiny" implied."""

    def __init__(self, server: RemoteServer) -> None:
        text = httpx.get(server.url + "/metrics").text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in self.families.values()
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        key = (f"vllm:{name}", frozenset({"model_name": MODEL, **labels}.items()))
        assert key in self.samples, f"{key} not in /metrics"
        return self.samples[key]


def _moved(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


def test_every_family_is_there_with_model_name(server):
    scrape = Scrape(server)
    expected = {f"vllm:{name}": "gauge" for name in [*GAUGES, "cache_config_info"]}
    expected.update({f"vllm:{name}": "counter" for name in COUNTERS})
    expected.update({f"vllm:{name}": "histogram" for name in HISTOGRAMS})
    for name, kind in expected.items():
        family = scrape.families.get(name)
        assert family is not None and family.type == kind, f"{name} missing or not a {kind}"
        assert family.samples and all(s.labels["model_name"] == MODEL for s in family.samples)
    info = scrape.families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "24"
    reasons = {s.labels["finished_reason"] for s in scrape.families["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons


def test_a_finished_request_moves_the_counters_by_its_usage(server, client):
    before = Scrape(server)
    out = client.completions.create(model=MODEL, prompt="The fox", max_tokens=5, **GREEDY)
    after = Scrape(server)
    usage = out.usage
    assert _moved(before, after, "prompt_tokens_total") == usage.prompt_tokens
    assert _moved(before, after, "generation_tokens_total") == usage.completion_tokens == 5
    assert _moved(before, after, "request_success_total", finished_reason="length") == 1
    assert _moved(before, after, "request_success_total", finished_reason="stop") == 0
    for name in PER_REQUEST_HISTOGRAMS:
        assert _moved(before, after, f"{name}_count") == 1, name
    assert _moved(before, after, "request_prompt_tokens_sum") == usage.prompt_tokens
    assert _moved(before, after, "request_generation_tokens_sum") == 5
    assert _moved(before, after, "request_params_max_tokens_sum") == 5
    assert _moved(before, after, "inter_token_latency_seconds_count") == 4
    assert _moved(before, after, "iteration_tokens_total_sum") == usage.prompt_tokens + 5
    assert after.value("num_requests_running") == 0
    assert after.value("kv_cache_usage_perc") == 0


def test_a_stop_string_counts_as_stop(server, client):
    base = client.completions.create(model=MODEL, prompt="A story", max_tokens=12, **GREEDY)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    before = Scrape(server)
    cut = client.completions.create(
        model=MODEL, prompt="A story", max_tokens=12, stop=[stop], **GREEDY
    )
    assert cut.choices[0].finish_reason == "stop"
    after = Scrape(server)
    assert _moved(before, after, "request_success_total", finished_reason="stop") == 1
    assert _moved(before, after, "request_success_total", finished_reason="length") == 0


def test_an_aborted_stream_counts_as_abort(server):
    # 8 choices of 250 tokens need ~128 blocks of the 23: the request runs for many steps, so
    # it is still running when the client hangs up after its first chunk.
    before = Scrape(server)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 250, "n": 8, "stream": True}
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json={**body, "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                # One chunk arrived: the request is running. Read /metrics now: leaving the
                # loop drops the line iterator, which closes the connection.
                running = Scrape(server)
                break
    assert running.value("num_requests_running") >= 1
    assert running.value("kv_cache_usage_perc") > 0
    deadline = time.monotonic() + scaled(20)
    while _finished(before, Scrape(server)) < 8:
        assert time.monotonic() < deadline, "the hung-up stream was never counted as aborted"
        time.sleep(0.1)
    after = Scrape(server)
    assert _moved(before, after, "request_success_total", finished_reason="abort") >= 1
    assert after.value("num_requests_running") == 0


def _finished(before: Scrape, after: Scrape) -> float:
    reasons = ("stop", "length", "abort")
    return sum(_moved(before, after, "request_success_total", finished_reason=r) for r in reasons)


def test_the_same_prompt_twice_hits_the_prefix_cache(server, client):
    prompt = "Once upon a time in a forest there lived a fox. " * 8
    first_before = Scrape(server)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    first_after = Scrape(server)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second_after = Scrape(server)
    num_prompt_tokens = first.usage.prompt_tokens
    assert _moved(first_before, first_after, "prefix_cache_queries_total") == num_prompt_tokens
    assert _moved(first_before, first_after, "prefix_cache_hits_total") == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16  # at least one full block
    assert _moved(first_after, second_after, "prefix_cache_queries_total") == num_prompt_tokens
    assert _moved(first_after, second_after, "prefix_cache_hits_total") == cached


def test_running_out_of_kv_cache_preempts(server):
    # Three requests of 200+ tokens each need ~13 blocks each; the cache has 23 usable.
    before = Scrape(server)
    usages = asyncio.run(_complete_all(server, [f"Request {i} says" for i in range(3)]))
    after = Scrape(server)
    assert _moved(before, after, "num_preemptions_total") >= 1
    assert _moved(before, after, "request_success_total", finished_reason="length") == 3
    num_generated = sum(u.completion_tokens for u in usages)
    assert _moved(before, after, "generation_tokens_total") == num_generated == 600


async def _complete_all(server: RemoteServer, prompts: list[str]) -> list:
    async with openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300
    ) as client:

        async def one(prompt: str):
            out = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=200, **GREEDY
            )
            return out.usage

        return await asyncio.gather(*(one(p) for p in prompts))
