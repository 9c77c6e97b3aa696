"""`POST /classify`, and `/score` and `/rerank` with a cross-encoder, on a real `python -m
v1engine.serve` of a one-class sequence classifier (a tiny random `LlamaForSequenceClassification`
with SmolLM2's tokenizer; `--runner auto` pools it), over plain HTTP: each input's score is
transformers' sigmoid of the classifier's logit at its last token (a chat: the rendered one),
named by config.json's label; text pairs are scored as one input of the tokenizer's pair
encoding; the classifier refuses to embed, and bad input gets a 400 naming the field.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.entrypoints.openai.server_utils import make_tiny_checkpoint, serve_module
from tests.timeouts import scaled
from v1engine.entrypoints.openai.serving_classification import classification_data

MODEL = "judge"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "A b c d e f g h i j k l m n o"]
QUERY = "What is a cat?"
DOCUMENTS = ["A cat is a small feline.", "Stocks fell today.", "Cats purr."]


@pytest.fixture(scope="module")
def classifier_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("judge"))
    return make_tiny_checkpoint(path, classifier=True, id2label={0: "relevant"})


@pytest.fixture(scope="module")
def server(classifier_model, tmp_path_factory):
    args = ("--served-model-name", MODEL, "--dtype", "float32", "--max-num-batched-tokens", "16")
    yield from serve_module(classifier_model, tmp_path_factory, *args, tp=1)


@pytest.fixture(scope="module")
def hf_model(classifier_model):
    path = classifier_model
    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


def expected_logit(hf_model, token_ids: list[int]) -> float:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        return hf_model.score(hidden)[0].item()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=scaled(60))


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
def test_classify_scores_a_batch_with_the_models_activation(server, tokenizer, hf_model, path):
    response = _post(server, path, {"input": TEXTS})
    body = response.json()
    assert response.status_code == 200, body
    assert body["id"].startswith("classify-") and body["object"] == "list"
    token_ids = [tokenizer.encode(text) for text in TEXTS]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, ids in zip(body["data"], token_ids):
        assert item["label"] == "relevant" and item["num_classes"] == 1
        expected = torch.sigmoid(torch.tensor(expected_logit(hf_model, ids))).item()
        assert item["probs"] == pytest.approx([expected], abs=2e-5)
    num_tokens = sum(len(ids) for ids in token_ids)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == num_tokens


def test_token_ids_and_the_raw_logits(server, hf_model):
    ids = [5, 17, 300, 42]
    item = _post(server, "/classify", {"input": ids, "use_activation": False}).json()["data"][0]
    assert item["probs"] == pytest.approx([expected_logit(hf_model, ids)], abs=2e-5)


def test_the_pooling_endpoint_returns_the_class_scores(server):
    classified = _post(server, "/classify", {"input": TEXTS}).json()
    pooled = _post(server, "/pooling", {"input": TEXTS, "task": "classify"}).json()
    assert pooled["id"].startswith("pool-")
    for item, expected in zip(pooled["data"], classified["data"]):  # batches differ: 1e-6
        assert item["data"] == pytest.approx(expected["probs"], abs=1e-6)
    raw = _post(server, "/pooling", {"input": TEXTS[:1], "use_activation": False}).json()
    logits = _post(server, "/classify", {"input": TEXTS[:1], "use_activation": False}).json()
    assert raw["data"][0]["data"] == pytest.approx(logits["data"][0]["probs"], abs=1e-6)


def test_the_chat_form_classifies_the_rendered_conversation(server, tokenizer, hf_model):
    messages = [{"role": "user", "content": "Is a cat a feline?"}]
    body = _post(server, "/classify", {"messages": messages}).json()
    # vLLM's chat-form defaults: no assistant turn opened, no special tokens added.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(token_ids)
    expected = torch.sigmoid(torch.tensor(expected_logit(hf_model, token_ids))).item()
    assert body["data"][0]["probs"] == pytest.approx([expected], abs=2e-5)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_reads_each_pair_as_one_input(server, tokenizer, hf_model, path):
    body = _post(server, path, {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    for item, document in zip(body["data"], DOCUMENTS):
        ids = tokenizer(QUERY, text_pair=document)["input_ids"]
        expected = torch.sigmoid(torch.tensor(expected_logit(hf_model, ids))).item()
        assert item["score"] == pytest.approx(expected, abs=2e-5)
    pair_tokens = sum(len(tokenizer(QUERY, text_pair=d)["input_ids"]) for d in DOCUMENTS)
    assert body["usage"]["prompt_tokens"] == pair_tokens


def test_use_activation_false_scores_with_the_raw_logit(server, tokenizer, hf_model):
    body = {"text_1": QUERY, "text_2": DOCUMENTS[0], "use_activation": False}
    item = _post(server, "/score", body).json()["data"][0]
    ids = tokenizer(QUERY, text_pair=DOCUMENTS[0])["input_ids"]
    assert item["score"] == pytest.approx(expected_logit(hf_model, ids), abs=2e-5)


def test_rerank_orders_documents_by_the_cross_encoders_score(server, tokenizer, hf_model):
    body = _post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
    scores = [
        expected_logit(hf_model, tokenizer(QUERY, text_pair=d)["input_ids"]) for d in DOCUMENTS
    ]
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])[:2]
    assert [result["index"] for result in body["results"]] == best_first
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in best_first]


@pytest.mark.parametrize(
    ("path", "fields", "param", "words"),
    [
        ("/v1/embeddings", {"input": "hi"}, "model", "it classifies, it does not embed"),
        ("/classify", {"input": None}, "input", "got neither"),
        ("/classify", {"input": [49152]}, "input", "outside the vocabulary"),
        ("/classify", {"input": "hi", "priority": 3}, "priority", "--scheduling-policy"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(server, path, fields, param, words):
    response = _post(server, path, fields)
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param and words in error["message"], error


def test_the_label_is_the_highest_scoring_class():
    data = classification_data(4, [0.2, 0.7, 0.1], ["neg", "pos", "neutral"])
    assert (data.index, data.label, data.num_classes) == (4, "pos", 3)
    assert classification_data(0, [0.5, 0.5], ["a", "b"]).label == "a"  # the first of equals


def test_the_start_up_line_says_the_model_classifies(server):
    assert "runner=pooling (classify)" in server.log_text()
