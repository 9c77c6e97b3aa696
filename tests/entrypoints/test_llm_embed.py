"""`LLM.embed` and `LLM.score` on a pooling engine (`runner="pooling"`), against transformers:
each embedding is the prompt's last token's final hidden state (L2-normalized unless asked not
to), whatever the batch, the chunking of a long prompt, the prefix cache or the tensor-parallel
size, and a score the cosine similarity of two texts' embeddings; PoolingParams cut matryoshka
models and refuse the others; a pooling engine refuses to generate and a generating one to embed,
with errors naming the runner."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoTokenizer

from tests.entrypoints.llm_utils import PROMPTS, all_blocks_free, make_llm
from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from tests.model.checkpoints import load_hf_model, make_checkpoint
from v1engine import PoolingParams, SamplingParams
from v1engine.engine.scoring import cosine_similarity, distinct_texts, score_pairs


def hf_last_hidden(model, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the last norm) at the prompt's last token."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0, -1]


def assert_close(embedding: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(embedding), expected, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def hf_model(llama_checkpoint):
    return load_hf_model(llama_checkpoint)


@pytest.fixture(scope="module")
def embedder(llama_checkpoint):
    # A 16-token budget chunks the 37-token prompt over three steps.
    with make_llm(llama_checkpoint, runner="pooling", max_num_batched_tokens=16) as llm:
        yield llm


def test_embeddings_equal_transformers_last_hidden_state(embedder, hf_model):
    outputs = embedder.embed(PROMPTS, use_tqdm=False)
    raw = embedder.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, output, unnormalized in zip(PROMPTS, outputs, raw):
        hidden = hf_last_hidden(hf_model, prompt)
        assert_close(unnormalized.outputs.embedding, hidden)
        assert_close(output.outputs.embedding, torch.nn.functional.normalize(hidden, dim=-1))
        assert output.finished
    assert all_blocks_free(embedder)


def test_encode_is_vllms_generic_pooling_call(embedder, hf_model):
    (default,) = embedder.encode(PROMPTS[:1], use_tqdm=False)  # the model's task: embed
    (named,) = embedder.encode(PROMPTS[:1], pooling_task="embed", use_tqdm=False)
    expected = torch.nn.functional.normalize(hf_last_hidden(hf_model, PROMPTS[0]), dim=-1)
    for output in (default, named):
        assert output.outputs.data.dtype == torch.float32
        torch.testing.assert_close(output.outputs.data, expected, atol=2e-5, rtol=1e-4)
    for task, words in [
        ("token_embed", "not served (the workers pool each prompt's last token only)"),
        ("reward", "is unknown; this engine serves ('embed', 'classify')"),
        ("classify", "embeds: classification needs"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            embedder.encode(PROMPTS[:1], pooling_task=task, use_tqdm=False)
    assert all_blocks_free(embedder)


def test_a_prefix_cache_hit_gives_the_same_embedding(embedder, hf_model):
    prompt = list(range(3, 40))  # two full 16-token blocks cached by the first call
    first = embedder.embed([prompt], PoolingParams(normalize=False), use_tqdm=False)[0]
    second = embedder.embed([prompt], PoolingParams(normalize=False), use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert_close(second.outputs.embedding, hf_last_hidden(hf_model, prompt))
    assert embedder.reset_prefix_cache()


def test_truncate_prompt_tokens_embeds_the_prompts_end(embedder, hf_model):
    prompt = list(range(10, 60))
    cut = embedder.embed(prompt, truncate_prompt_tokens=7, use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:]
    expected = torch.nn.functional.normalize(hf_last_hidden(hf_model, prompt[-7:]), dim=-1)
    assert_close(cut.outputs.embedding, expected)


def test_per_prompt_params_and_tensor_parallel(llama_checkpoint, hf_model):
    params = [PoolingParams(normalize=False), PoolingParams()]
    with make_llm(llama_checkpoint, runner="pooling", tensor_parallel_size=2) as llm:
        outputs = llm.embed(PROMPTS[:2], params, use_tqdm=False)
        with pytest.raises(ValueError, match="got 1 pooling params for 2 prompts"):
            llm.embed(PROMPTS[:2], params[:1])
    hidden = [hf_last_hidden(hf_model, prompt) for prompt in PROMPTS[:2]]
    assert_close(outputs[0].outputs.embedding, hidden[0])
    assert_close(outputs[1].outputs.embedding, torch.nn.functional.normalize(hidden[1], dim=-1))


def test_bad_embedding_requests_name_what_is_wrong(embedder):
    with pytest.raises(ValueError, match="does not support matryoshka"):
        embedder.embed([[1, 2, 3]], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="PoolingParams.dimensions must be an int >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="PoolingParams.truncate_prompt_tokens must be"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="embeds at most max_model_len - 1 = 127"):
        embedder.embed([[5] * 128])
    with pytest.raises(ValueError, match="the prompt is empty"):
        embedder.embed([[]])
    with pytest.raises(ValueError, match="needs an engine started with runner='generate'"):
        embedder.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    # None of them left anything in the engine.
    assert not embedder.llm_engine.has_unfinished_requests()
    assert not embedder.engine_core.scheduler.has_unfinished_requests()
    assert all_blocks_free(embedder)


def test_a_generating_engine_refuses_to_embed(llama_checkpoint):
    with make_llm(llama_checkpoint) as llm:
        with pytest.raises(ValueError, match="--runner pooling"):
            llm.embed([[1, 2, 3]])
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="runner must be one of"):
        make_llm(llama_checkpoint, runner="embed")


@pytest.mark.parametrize(
    "config, dimensions, refused, error",
    [
        ({"is_matryoshka": True}, 16, 65, "hidden size 64"),
        ({"matryoshka_dimensions": [16, 32]}, 32, 8, r"supports matryoshka dimensions \[16, 32\]"),
    ],
)
def test_matryoshka_models_cut_then_normalize(tmp_path, config, dimensions, refused, error):
    path = make_checkpoint(tmp_path, "llama", **config)
    prompt = [1, 5, 9, 22, 7]
    hidden = hf_last_hidden(load_hf_model(path), prompt)
    with make_llm(path, runner="pooling") as llm:
        with pytest.raises(ValueError, match=error):
            llm.embed([prompt], PoolingParams(dimensions=refused))
        output = llm.embed([prompt], PoolingParams(dimensions=dimensions), use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(hidden[:dimensions], dim=-1)
    assert_close(output.outputs.embedding, expected)


def test_score_pairs_texts_as_vllm_does():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    assert distinct_texts([("q", "a"), ("q", "b"), ("a", "q")]) == ["q", "a", "b"]
    with pytest.raises(ValueError, match="cannot pair 2 texts with 3"):
        score_pairs(["x", "y"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="nothing to score"):
        score_pairs([], "a")
    assert cosine_similarity([1.0, 0.0], [0.0, 2.0]) == 0.0
    assert cosine_similarity([0.0, 0.0], [1.0, 1.0]) == 0.0  # a zero vector scores 0


def test_llm_score_is_the_cosine_similarity_of_embeddings(tmp_path):
    path = make_tiny_checkpoint(str(tmp_path))  # a tiny llama with SmolLM2's tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    query, documents = "A fox", ["The quick brown fox.", "Stock markets fell.", "A fox"]
    with make_llm(path, runner="pooling", skip_tokenizer_init=False) as llm:
        one_to_n = llm.score(query, documents, use_tqdm=False)
        pairwise = llm.score(documents[:2], documents[1:], use_tqdm=False)
    model = load_hf_model(path)
    hidden = {text: hf_last_hidden(model, tokenizer.encode(text)) for text in [query, *documents]}

    def expected(a: str, b: str) -> float:
        return torch.cosine_similarity(hidden[a], hidden[b], dim=0).item()

    for output, document in zip(one_to_n, documents):
        assert abs(output.outputs.score - expected(query, document)) < 1e-5
        assert output.prompt_token_ids == tokenizer.encode(query) + tokenizer.encode(document)
    assert abs(one_to_n[2].outputs.score - 1.0) < 1e-5  # the query against itself
    for output, (a, b) in zip(pairwise, zip(documents[:2], documents[1:])):
        assert abs(output.outputs.score - expected(a, b)) < 1e-5


@pytest.mark.parametrize("preset, tp", [("llama", 2), ("qwen3", 1)])
def test_a_base_model_checkpoint_embeds_by_default(tmp_path, preset, tp):
    # transformers' AutoModel checkpoints (LlamaModel, Qwen3Model: no LM head, tensors without
    # "model."), as embedding models ship: runner "auto" pools them.
    path = make_checkpoint(tmp_path, preset, base_model=True)
    model = load_hf_base_model(path)
    with make_llm(path, tensor_parallel_size=tp) as llm:
        assert llm.config.model_config.runner_type == "pooling"
        outputs = llm.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).last_hidden_state[0, -1]
        assert_close(output.outputs.embedding, expected)


def test_a_base_model_cannot_generate(tmp_path):
    path = make_checkpoint(tmp_path, "llama", base_model=True)
    with pytest.raises(ValueError, match="LlamaModel has no LM head: it can embed, not generate"):
        make_llm(path, runner="generate")


def load_hf_base_model(path: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def lm_head_copies(worker) -> tuple[bool, bool, bool]:
    """(the LM head has a packed copy for the CPU gemm, the first projection has one, the
    runner has a greedy screen)."""
    runner = worker.model_runner
    projection = runner.model.model.layers[0].mlp.down_proj
    return (
        runner.model.lm_head.packed_weight is not None,
        projection.packed_weight is not None,
        runner.derived.greedy_screen is not None,
    )


def test_a_pooling_engine_keeps_no_copies_of_the_lm_head(llama_checkpoint, embedder):
    # The LM head only samples; an engine that never samples holds it once (the profile run
    # reads the plain weight).
    ((head_packed, _, screen),) = embedder.collective_rpc(lm_head_copies)
    assert not head_packed and not screen
    with make_llm(llama_checkpoint) as generating:
        ((head_packed, projection_packed, _),) = generating.collective_rpc(lm_head_copies)
    assert head_packed == projection_packed  # a generating engine packs both, or neither


def test_an_embedding_model_only_embeds(embedder):
    with pytest.raises(ValueError, match=r"embeds: classification needs a \*ForSequence"):
        embedder.classify(PROMPTS[:1])
    with pytest.raises(ValueError, match="PoolingParams.use_activation is for classifiers"):
        embedder.embed(PROMPTS[:1], PoolingParams(use_activation=True))
    assert embedder.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding  # still serving
