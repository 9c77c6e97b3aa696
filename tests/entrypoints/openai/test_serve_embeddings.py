"""`POST /v1/embeddings`, `/score` and `/rerank` on a real `python -m v1engine.serve --runner
pooling` (tiny random llama with SmolLM2's tokenizer, TP=2, float32), through the real `openai`
client and plain HTTP: each embedding is transformers' final hidden state at the input's last
token, L2-normalized; base64 and float encodings carry the same values; batches keep their order
and sum their usage; vLLM's /pooling returns the same vectors; scores are the cosine similarities
of those embeddings, reranked best first; bad input gets a 400 naming the field; a pooling server
refuses to generate, and a generating one to embed or score.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.entrypoints.openai.server_utils import metric, openai_client, serve_module
from tests.model.checkpoints import load_hf_model
from tests.timeouts import scaled

MODEL = "tiny"
PROMPT_TOKENS = 'vllm:prompt_tokens_total{model_name="tiny"}'
FINISHED = 'vllm:request_success_total{finished_reason="stop",model_name="tiny"}'
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "A b c d e f g h i j k l m n o"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    args = ("--served-model-name", MODEL, "--runner", "pooling", "--dtype", "float32")
    # A 16-token budget chunks the longer inputs.
    args += ("--max-num-batched-tokens", "16")
    yield from serve_module(tiny_model, tmp_path_factory, *args, tp=2)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return load_hf_model(tiny_model)


def expected_embedding(hf_model, token_ids: list[int], normalize: bool = True) -> np.ndarray:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    if normalize:
        hidden = torch.nn.functional.normalize(hidden, dim=-1)
    return hidden.numpy()


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=scaled(60))


def test_openai_client_embeds_a_batch_of_texts(server, client, tokenizer, hf_model):
    prompt_tokens_before = metric(server, PROMPT_TOKENS)
    finished_before = metric(server, FINISHED)
    response = client.embeddings.create(model=MODEL, input=TEXTS)  # base64 on the wire
    assert response.model == MODEL and response.object == "list"
    assert response.id.startswith("embd-")
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    assert [item.index for item in response.data] == [0, 1, 2]
    for item, ids in zip(response.data, token_ids):
        np.testing.assert_allclose(item.embedding, expected_embedding(hf_model, ids), atol=2e-5)
        assert abs(np.linalg.norm(item.embedding) - 1.0) < 1e-5
    num_tokens = sum(len(ids) for ids in token_ids)
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)
    assert metric(server, PROMPT_TOKENS) - prompt_tokens_before == num_tokens
    assert metric(server, FINISHED) - finished_before == len(TEXTS)


def test_float_and_base64_encodings_carry_the_same_values(server):
    body = {"model": MODEL, "input": TEXTS[0]}
    floats = _post(server, {**body, "encoding_format": "float"}).json()
    encoded = _post(server, {**body, "encoding_format": "base64"}).json()
    vector = floats["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(vector, dtype=np.float32))
    assert floats["usage"] == encoded["usage"]


def test_the_pooling_endpoint_returns_the_embeddings(server, tokenizer):
    body = {"model": MODEL, "input": TEXTS[:2]}
    embedded = _post(server, body).json()
    pooled = httpx.post(server.url + "/pooling", json=body, timeout=scaled(60)).json()
    assert pooled["id"].startswith("pool-") and pooled["object"] == "list"
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    for item, embedding in zip(pooled["data"], embedded["data"]):
        np.testing.assert_allclose(item["data"], embedding["embedding"], atol=1e-6)
    assert pooled["usage"] == embedded["usage"]
    encoded = httpx.post(
        server.url + "/pooling",
        json={**body, "task": "embed", "encoding_format": "base64"},
        timeout=scaled(60),
    ).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(decoded, pooled["data"][0]["data"], atol=1e-6)
    for task, words in [
        ("token_embed", "not served (the workers pool each prompt's last token only)"),
        ("reward", "is unknown"),
        ("classify", "embeds: classification needs"),
    ]:
        response = httpx.post(server.url + "/pooling", json={**body, "task": task})
        assert response.status_code == 400 and words in response.json()["error"]["message"]


def test_token_id_inputs_and_vllm_fields(server, client, hf_model):
    ids = [[5, 9, 22, 7, 100], [300, 301]]
    response = client.embeddings.create(
        model=MODEL, input=ids, extra_body={"normalize": False, "truncate_prompt_tokens": 4}
    )
    for item, prompt in zip(response.data, ids):
        expected = expected_embedding(hf_model, prompt[-4:], normalize=False)
        np.testing.assert_allclose(item.embedding, expected, atol=5e-5, rtol=1e-4)
    assert response.usage.prompt_tokens == 4 + 2
    one = client.embeddings.create(model=MODEL, input=ids[1])
    expected = expected_embedding(hf_model, ids[1])
    np.testing.assert_allclose(one.data[0].embedding, expected, atol=2e-5)


def test_the_chat_form_embeds_the_rendered_conversation(server, tokenizer, hf_model):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Tell me about foxes."},
    ]
    response = _post(server, {"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    # vLLM's chat-form defaults: no assistant turn opened, no special tokens added.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(token_ids)
    expected = expected_embedding(hf_model, token_ids)
    np.testing.assert_allclose(body["data"][0]["embedding"], expected, atol=2e-5)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"dimensions": 8}, "dimensions", "does not support matryoshka"),
        ({"dimensions": 0}, "dimensions", "must be an int >= 1"),
        ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens", "must be >= 1 or -1"),
        ({"input": ""}, "input", "the prompt is empty"),
        ({"input": ["a", ""]}, "input", "prompt 1 of the batch"),
        ({"input": [7] * 300}, "input", "embeds at most max_model_len - 1 = 255"),
        ({"input": [49152]}, "input", "outside the vocabulary"),
        ({"encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"priority": 3}, "priority", "--scheduling-policy priority"),
        ({"messages": [{"role": "user", "content": "x"}]}, "input", "got both"),
        ({"input": None}, "input", "got neither"),
        ({"add_generation_prompt": True}, "add_generation_prompt", "`messages` only"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "`messages` only"),
    ],
)
def test_bad_embedding_requests_get_a_400_naming_the_field(server, fields, param, words):
    response = _post(server, {"model": MODEL, "input": "hi", **fields})
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param and words in error["message"], error


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_similarity_of_the_embeddings(server, tokenizer, hf_model, path):
    query, documents = TEXTS[0], TEXTS[1:]
    response = httpx.post(
        server.url + path,
        json={"model": MODEL, "text_1": query, "text_2": documents},
        timeout=scaled(60),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    q = expected_embedding(hf_model, tokenizer.encode(query))
    for index, (item, document) in enumerate(zip(body["data"], documents)):
        d = expected_embedding(hf_model, tokenizer.encode(document))
        assert item["index"] == index and abs(item["score"] - _cosine(q, d)) < 1e-5
    num_tokens = sum(len(tokenizer.encode(query) + tokenizer.encode(d)) for d in documents)
    assert body["usage"]["prompt_tokens"] == num_tokens


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_returns_the_documents_best_first(server, tokenizer, hf_model, path):
    query, documents = "A fox", [TEXTS[0], TEXTS[1], TEXTS[2], "A fox"]
    body = {"model": MODEL, "query": query, "documents": documents, "top_n": 3}
    response = httpx.post(server.url + path, json=body, timeout=scaled(60))
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    q = expected_embedding(hf_model, tokenizer.encode(query))
    scores = [_cosine(q, expected_embedding(hf_model, tokenizer.encode(d))) for d in documents]
    best_first = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)[:3]
    assert [r["index"] for r in results] == best_first
    assert (
        results[0]["document"]["text"] == "A fox" and abs(results[0]["relevance_score"] - 1) < 1e-5
    )
    for result in results:
        assert abs(result["relevance_score"] - scores[result["index"]]) < 1e-5


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "cannot pair 2"),
        ("/score", {"text_1": [], "text_2": "c"}, "text_1", "nothing to score"),
        ("/score", {"text_1": "a", "text_2": [""]}, "text", "the prompt is empty"),
        ("/rerank", {"query": "a", "documents": []}, "documents", "must not be empty"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "top_n must be"),
        (
            "/score",
            {"text_1": "a", "text_2": "b", "use_activation": False},
            "use_activation",
            "is for classifiers",
        ),
    ],
)
def test_bad_score_requests_get_a_400_naming_the_field(server, path, body, param, words):
    response = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=scaled(60))
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param and words in error["message"], error


def test_a_pooling_server_refuses_to_generate(server, client):
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="for /v1/embeddings, /classify, /score"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert client.embeddings.create(model=MODEL, input="still serving").data


def test_an_embedding_model_does_not_classify(server):
    response = httpx.post(
        server.url + "/classify", json={"model": MODEL, "input": "hi"}, timeout=scaled(60)
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "model", error
    assert "embeds: classification needs a *ForSequenceClassification" in error["message"]


def test_a_generating_server_refuses_to_embed(tiny_model, tmp_path_factory):
    for remote in serve_module(tiny_model, tmp_path_factory, "--served-model-name", MODEL, tp=1):
        client = openai_client(remote)
        with pytest.raises(openai.BadRequestError, match="restart it with --runner pooling"):
            client.embeddings.create(model=MODEL, input="hi")
        for path, body in [
            ("/rerank", {"model": MODEL, "query": "a", "documents": ["b"]}),
            ("/classify", {"model": MODEL, "input": "a"}),
        ]:
            refused = httpx.post(remote.url + path, json=body, timeout=scaled(60))
            assert refused.status_code == 400 and "--runner pooling" in refused.text
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices
