"""`LLM.classify` and cross-encoder `LLM.score` with sequence classifiers (transformers'
`LlamaForSequenceClassification`, random weights), against transformers: the class scores are
the model's activation of the `score` head's logits at the prompt's last token, whatever the
chunking or the tensor-parallel size; a one-class classifier scores text pairs read as one input;
each model does its own task only, with errors that say which to use."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.entrypoints.llm_utils import PROMPTS, all_blocks_free, make_llm
from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from tests.model.checkpoints import make_checkpoint
from v1engine import EngineArgs, PoolingParams
from v1engine.model.hf_config import classifier_activation, classifier_labels

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """The classifier's logits at the prompt's last token (transformers pools the last one)."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        return model.score(hidden)


def assert_close(values: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(values), expected, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def classifier_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    return make_checkpoint(path, "llama", classifier=True, id2label=LABELS)


@pytest.fixture(scope="module")
def hf_classifier(classifier_checkpoint):
    return AutoModelForSequenceClassification.from_pretrained(
        classifier_checkpoint, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def classifier(classifier_checkpoint):
    # runner "auto" pools a classifier; a 16-token budget chunks the 37-token prompt; TP=2
    # gives each rank the whole (replicated) score head.
    with make_llm(classifier_checkpoint, tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        yield llm


def test_class_scores_are_the_softmax_of_transformers_logits(classifier, hf_classifier):
    assert classifier.config.model_config.runner_type == "pooling"
    outputs = classifier.classify(PROMPTS, use_tqdm=False)
    raw = classifier.classify(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, output, logits in zip(PROMPTS, outputs, raw):
        expected = hf_logits(hf_classifier, prompt)
        assert output.outputs.num_classes == 3 and output.finished
        assert_close(logits.outputs.probs, expected)
        assert_close(output.outputs.probs, torch.softmax(expected, dim=-1))
    assert all_blocks_free(classifier)


def test_encode_classifies_with_a_classifier(classifier, hf_classifier):
    (output,) = classifier.encode(PROMPTS[:1], use_tqdm=False)
    expected = torch.softmax(hf_logits(hf_classifier, PROMPTS[0]), dim=-1)
    torch.testing.assert_close(output.outputs.data, expected, atol=2e-5, rtol=1e-4)


def test_a_classifier_only_classifies(classifier):
    with pytest.raises(ValueError, match="is a sequence classifier: it classifies, it does not"):
        classifier.embed(PROMPTS[:1])
    with pytest.raises(ValueError, match="has 3 classes: use classify instead"):
        classifier.score("a", "b")
    with pytest.raises(ValueError, match="PoolingParams.normalize shapes embeddings, but"):
        classifier.classify(PROMPTS[:1], PoolingParams(normalize=True))
    with pytest.raises(ValueError, match="needs an engine started with runner='generate'"):
        classifier.generate(PROMPTS[:1])
    assert classifier.classify(PROMPTS[:1], use_tqdm=False)[0].outputs.probs  # still serving


def test_a_classifier_cannot_be_run_to_generate(classifier_checkpoint):
    args = EngineArgs(model=classifier_checkpoint, runner="generate")
    with pytest.raises(ValueError, match="has no LM head: it can classify, not generate"):
        args.create_engine_config()


def test_a_one_class_classifier_scores_pairs_as_a_cross_encoder(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path), classifier=True, id2label={0: "relevant"})
    hf_model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    pairs = [("What is a cat?", "A cat is a small feline."), ("What is a cat?", "Stocks fell.")]
    with make_llm(path, skip_tokenizer_init=False) as llm:
        tokenizer = llm.get_tokenizer()
        scored = llm.score(pairs[0][0], [second for _, second in pairs], use_tqdm=False)
        classified = llm.classify(["A cat sleeps."], use_tqdm=False)[0]
    for (first, second), output in zip(pairs, scored):
        ids = tokenizer(first, text_pair=second)["input_ids"]
        assert output.prompt_token_ids == ids
        expected = torch.sigmoid(hf_logits(hf_model.eval(), ids))[0]
        assert math.isclose(output.outputs.score, expected.item(), abs_tol=2e-5)
    # One class: its score goes through a sigmoid, not a softmax (which would always be 1).
    ids = tokenizer("A cat sleeps.")["input_ids"]
    assert_close(classified.outputs.probs, torch.sigmoid(hf_logits(hf_model, ids)))


def test_activation_follows_the_models_problem_type():
    def config(**fields):
        return type("HFConfig", (), fields)

    assert classifier_activation(config(id2label=LABELS)) == "softmax"
    assert classifier_activation(config(id2label={0: "yes"})) == "sigmoid"
    multi = config(id2label=LABELS, problem_type="multi_label_classification")
    assert classifier_activation(multi) == "sigmoid"
    assert classifier_activation(config(id2label=LABELS, problem_type="regression")) == "none"
    # JSON keys are strings: index order is numeric, and no id2label means transformers' two.
    labels = {str(i): f"c{i}" for i in range(12)}
    assert classifier_labels(config(id2label=labels)) == [f"c{i}" for i in range(12)]
    assert classifier_labels(config()) == ["LABEL_0", "LABEL_1"]


def test_activations_are_exact_and_never_overflow():
    params = PoolingParams()
    probs = params.classify([1000.0, 0.0, -1000.0], "softmax")
    assert probs == [1.0, 0.0, 0.0]
    assert params.classify([-1000.0, 0.0, 1000.0], "sigmoid") == [0.0, 0.5, 1.0]
    assert math.isclose(math.fsum(params.classify([0.3, -1.2, 2.5], "softmax")), 1.0)
    assert params.classify([0.3, -1.2], "none") == [0.3, -1.2]
    assert PoolingParams(use_activation=False).classify([0.3, -1.2], "softmax") == [0.3, -1.2]


def test_a_qwen3_classifier_matches_transformers(tmp_path):
    # Another family (q/k norms, tied embeddings): the same score head on its causal class.
    path = make_checkpoint(tmp_path, "qwen3", classifier=True, id2label=LABELS)
    hf_model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    prompt = list(range(3, 30))
    with make_llm(path) as llm:
        probs = llm.classify([prompt], use_tqdm=False)[0].outputs.probs
    assert_close(probs, torch.softmax(hf_logits(hf_model.eval(), prompt), dim=-1))
