"""LoRA adapters on a real `python -m v1engine.serve` (tiny random llama with SmolLM2's
tokenizer, TP=1, fp32) through the official `openai` client: `--lora-modules` serves each adapter
under its name (completions, chat, the Responses API), whose greedy tokens (and beam search) are
transformers' with the adapter merged into the weights (the base model's stay the base model's,
also when the three run at once); /v1/models lists the adapters and /metrics vLLM's
vllm:lora_requests_info; with V1ENGINE_ALLOW_RUNTIME_LORA_UPDATING=1 adapters are added and
removed while the server runs; bad adapters and flags fail with messages that name the fix."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys

import httpx
import openai
import pytest
from transformers import AutoConfig

from tests.entrypoints.llm_utils import hf_beam_search, hf_greedy
from tests.entrypoints.openai.server_utils import ROOT, serve_module
from tests.lora.adapters import make_adapter, merged_hf_model
from tests.model.checkpoints import load_hf_model
from tests.timeouts import scaled

PROMPT = [1, 500, 600, 700]
GREEDY = {
    "max_tokens": 6,
    "temperature": 0.0,
    "extra_body": {"return_token_ids": True, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    config = AutoConfig.from_pretrained(tiny_model)
    return {
        "full": make_adapter(tmp / "full", config, seed=1),
        "partial": make_adapter(
            tmp / "partial", config, seed=2, rank=2, targets=("q_proj", "down_proj")
        ),
    }


@pytest.fixture(scope="module")
def models(tiny_model, adapters):
    """Each served name's transformers model (an adapter's merged into the base's weights)."""
    models = {"tiny": load_hf_model(tiny_model)}
    models.update({name: merged_hf_model(tiny_model, path) for name, path in adapters.items()})
    return models


@pytest.fixture(scope="module")
def expected(models):
    """Each served name's greedy tokens for PROMPT."""
    tokens = {name: hf_greedy(model, [PROMPT], 6)[0] for name, model in models.items()}
    assert len({tuple(t) for t in tokens.values()}) == 3  # each adapter changes the tokens
    return tokens


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tmp_path_factory):
    partial = f'{{"name": "partial", "path": "{adapters["partial"]}", "base_model_name": "tiny"}}'
    yield from serve_module(
        tiny_model,
        tmp_path_factory,
        "--served-model-name",
        "tiny",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"full={adapters['full']}",
        partial,
        tp=1,
        env={"V1ENGINE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )


def _tokens(client: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    out = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    return out.model, out.choices[0].token_ids


def test_each_adapter_answers_under_its_name_as_its_merged_weights_would(server, client, expected):
    for name in ("tiny", "full", "partial"):
        assert _tokens(client, name) == (name, expected[name])
    # All three at once, in the same steps: each keeps its own tokens.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        names = ["full", "tiny", "partial"] * 2
        results = list(pool.map(lambda name: _tokens(client, name), names))
    assert results == [(name, expected[name]) for name in names]
    # vLLM's vllm:lora_requests_info saw each adapter running.
    metrics = httpx.get(server.url + "/metrics").text
    running = re.findall(
        r'vllm:lora_requests_info\{max_lora="2",[^}]*running_lora_adapters="([^"]*)"', metrics
    )
    assert {"full", "partial"} <= {name for names in running for name in names.split(",")}


def test_a_chat_stream_names_its_adapter(client):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = dict(model="partial", messages=messages, max_tokens=5, temperature=0.0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert whole.model == "partial" and {c.model for c in chunks} == {"partial"}
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )


def test_a_response_runs_its_adapter_as_the_chat_completion_does(client):
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="full", messages=messages, max_tokens=5, temperature=0.0
    )
    response = client.responses.create(
        model="full", input=messages, max_output_tokens=5, temperature=0.0
    )
    assert response.model == "full"
    assert response.output_text == chat.choices[0].message.content


def test_models_lists_the_adapters_with_their_base(client, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == ["tiny", "full", "partial"]
    for name, path in adapters.items():
        assert (cards[name].root, cards[name].parent) == (path, "tiny")
    assert client.models.retrieve("full").root == adapters["full"]


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist.*'full', 'partial'"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_a_beam_search_runs_with_its_adapter(client, models, tokenizer):
    beam = {"use_beam_search": True, "ignore_eos": True}
    out = client.completions.create(model="full", prompt=PROMPT, max_tokens=4, n=2, extra_body=beam)
    searched = hf_beam_search(models["full"], PROMPT, width=2, max_tokens=4)
    assert [c.text for c in out.choices] == [
        tokenizer.decode(tokens, skip_special_tokens=True) for tokens, _ in searched
    ]
    assert out.model == "full"


def test_adapters_are_added_and_removed_at_runtime(server, client, adapters, expected):
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    added = httpx.post(load, json={"lora_name": "late", "lora_path": adapters["full"]})
    assert (added.status_code, added.text) == (
        200,
        "Success: LoRA adapter 'late' added successfully.",
    )
    assert _tokens(client, "late") == ("late", expected["full"])
    again = httpx.post(load, json={"lora_name": "late", "lora_path": adapters["full"]})
    assert (
        again.status_code == 400 and "'late' is already served" in again.json()["error"]["message"]
    )
    bad = httpx.post(load, json={"lora_name": "bad", "lora_path": "/nowhere"})
    assert (
        bad.status_code == 400 and "no adapter_config.json there" in bad.json()["error"]["message"]
    )
    removed = httpx.post(unload, json={"lora_name": "late"})
    assert (removed.status_code, removed.text) == (
        200,
        "Success: LoRA adapter 'late' removed successfully.",
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    assert httpx.post(unload, json={"lora_name": "late"}).status_code == 404
    assert [c.id for c in client.models.list().data] == ["tiny", "full", "partial"]


def test_runtime_updates_refuse_fields_they_would_ignore(server, adapters):
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    inplace = {"lora_name": "x", "lora_path": adapters["full"], "load_inplace": True}
    refused = httpx.post(load, json=inplace)
    assert refused.status_code == 400 and "load_inplace" in refused.text
    wrong_id = httpx.post(unload, json={"lora_name": "full", "lora_int_id": 99})
    assert wrong_id.status_code == 400 and "has lora_int_id 1, not 99" in wrong_id.text
    assert "full" in [card["id"] for card in httpx.get(server.url + "/v1/models").json()["data"]]


def test_an_adapter_the_model_cannot_serve_stops_the_server_before_the_engine(tiny_model):
    flags = ["--enable-lora", "--lora-modules", "a=/nowhere"]
    args = [
        sys.executable,
        "-m",
        "v1engine.serve",
        "--model",
        tiny_model,
        "--device",
        "cpu",
        *flags,
    ]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=scaled(120))
    assert done.returncode != 0
    assert "LoRA adapter '/nowhere': no adapter_config.json there" in done.stderr + done.stdout
