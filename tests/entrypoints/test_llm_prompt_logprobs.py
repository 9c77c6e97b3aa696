"""`LLM.generate(..., SamplingParams(prompt_logprobs=k))` end to end against transformers'
log_softmax at every prompt position (float32, CPU): TP=1 and TP=2, chunked prefill with
preemption, a prefix cached by an earlier request, n > 1, and the default model."""

from __future__ import annotations

import random

import pytest
import torch

from tests.entrypoints.llm_utils import PROMPTS, all_blocks_free, make_llm
from tests.model.checkpoints import load_hf_model, make_checkpoint
from v1engine.entrypoints.llm import LLM
from v1engine.sampling_params import SamplingParams

ATOL = 1e-4


def _params(k: int | None, **kwargs) -> SamplingParams:
    args = dict(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    return SamplingParams(**{**args, **kwargs})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """A tiny random llama checkpoint and its transformers model."""
    path = make_checkpoint(tmp_path_factory.mktemp("prompt_logprobs"), "llama")
    return path, load_hf_model(path)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row p is log_softmax of the logits predicting token p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(output, reference: torch.Tensor, k: int) -> None:
    """One entry per prompt token, None first; each holds the prompt token (its logprob and
    rank) and the top k (ids, logprobs and ranks 1..k as torch.topk orders them)."""
    prompt = output.prompt_token_ids
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row, token = reference[p], prompt[p + 1]
        top = row.topk(k)
        assert set(entry) == {token, *top.indices.tolist()}
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        for rank, (token_id, logprob) in enumerate(zip(top.indices.tolist(), top.values), 1):
            assert entry[token_id].rank == rank
            assert entry[token_id].logprob == pytest.approx(logprob.item(), abs=ATOL)


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_equal_transformers(llama, tp):
    checkpoint, hf_model = llama
    # Mixed k, a request without prompt logprobs and a two-token prompt, in one batch.
    ks = [0, 3, 5, None, 1]
    with make_llm(checkpoint, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(PROMPTS, [_params(k) for k in ks], use_tqdm=False)
        assert all_blocks_free(llm)
    for output, prompt, k in zip(outputs, PROMPTS, ks):
        if k is None:
            assert output.prompt_logprobs is None
        else:
            check_prompt_logprobs(output, hf_prompt_logprobs(hf_model, prompt), k)


def test_chunked_prefill_and_preemption_score_every_position_once(llama):
    checkpoint, hf_model = llama
    # A 12-token budget chunks the longer prompts; 7 usable blocks of 8 tokens cannot hold
    # every request, so requests are preempted and recomputed: positions scored before a
    # preemption must not come back.
    prompts = PROMPTS + [list(range(60, 100))]
    limits = dict(block_size=8, num_gpu_blocks_override=8, max_model_len=56)
    with make_llm(checkpoint, tensor_parallel_size=2, max_num_batched_tokens=12, **limits) as llm:
        outputs = llm.generate(prompts, _params(4, max_tokens=8), use_tqdm=False)
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
        assert all_blocks_free(llm)
    for output, prompt in zip(outputs, prompts):
        check_prompt_logprobs(output, hf_prompt_logprobs(hf_model, prompt), 4)


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(llama):
    checkpoint, hf_model = llama
    prefix = [random.Random(0).randrange(3, 130) for _ in range(64)]
    with make_llm(checkpoint, tensor_parallel_size=1) as llm:
        llm.generate([prefix + [5]], _params(None), use_tqdm=False)
        scored = llm.generate([prefix + [6, 7]], _params(2), use_tqdm=False)[0]
        # It took nothing from the cache, yet its blocks serve the next request.
        assert scored.num_cached_tokens == 0
        assert llm.engine_core.reset_prefix_cache()
        llm.generate([prefix + [8]], _params(2), use_tqdm=False)
        plain = llm.generate([prefix + [9]], _params(None), use_tqdm=False)[0]
        assert plain.num_cached_tokens == 64
    check_prompt_logprobs(scored, hf_prompt_logprobs(hf_model, prefix + [6, 7]), 2)


def test_n_children_share_one_set_of_prompt_logprobs(llama):
    checkpoint, hf_model = llama
    prompt = PROMPTS[2]
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, prompt_logprobs=2)
    with make_llm(checkpoint, tensor_parallel_size=1) as llm:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(output.outputs) == 3
    check_prompt_logprobs(output, hf_prompt_logprobs(hf_model, prompt), 2)


@pytest.mark.slow
def test_default_model_prompt_logprobs_equal_transformers():
    from v1engine.model.hf_config import default_model_path, prepare_checkpoint

    hf_model = load_hf_model(prepare_checkpoint(default_model_path()))
    text = "The capital of France is Paris. The capital of Italy is"
    with LLM(
        device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=32 << 20
    ) as llm:
        (output,) = llm.generate([text], _params(5), use_tqdm=False)
        tokenizer = llm.tokenizer
    check_prompt_logprobs(output, hf_prompt_logprobs(hf_model, output.prompt_token_ids), 5)
    for token_id, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert entry[token_id].decoded_token == tokenizer.decode([token_id])


def test_minus_one_is_every_tokens_logprob_within_max_logprobs(llama):
    """vLLM's -1: the whole vocabulary, for sample and prompt logprobs; an engine's
    max_logprobs (default 20, as vLLM's; -1: no limit) bounds what a request may ask."""
    checkpoint, hf_model = llama
    every = _params(-1, logprobs=-1)
    with make_llm(checkpoint) as llm:
        with pytest.raises(ValueError, match="max_logprobs is 20"):
            llm.generate([PROMPTS[0]], every, use_tqdm=False)
        with pytest.raises(ValueError, match="SamplingParams.logprobs asks for 21"):
            llm.generate([PROMPTS[0]], _params(None, logprobs=21), use_tqdm=False)
        assert all_blocks_free(llm)
    with make_llm(checkpoint, max_logprobs=-1) as llm:
        (output,) = llm.generate([PROMPTS[2]], every, use_tqdm=False)
    vocab_size = hf_model.config.vocab_size
    completion = output.outputs[0]
    tokens = output.prompt_token_ids + completion.token_ids
    reference = hf_prompt_logprobs(hf_model, tokens)
    prompt_len = len(output.prompt_token_ids)
    check_prompt_logprobs(output, reference[:prompt_len], vocab_size)
    assert len(completion.logprobs) == len(completion.token_ids) == 3
    for step, entry in enumerate(completion.logprobs):
        row = reference[prompt_len - 1 + step]
        assert sorted(entry) == list(range(vocab_size))
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token_id].item(), abs=ATOL)


def test_logprobs_modes_against_transformers(llama):
    """vLLM's logprobs_mode end to end: "raw_logits" gives the model's logits for the prompt
    and the samples; "processed_logprobs" the log_softmax of what the draw used (temperature,
    top_k), -inf outside the top k."""
    checkpoint, hf_model = llama
    prompt = PROMPTS[2]
    sampled = SamplingParams(
        max_tokens=4, temperature=0.5, top_k=3, seed=1, logprobs=5, prompt_logprobs=2
    )
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0].float()
    raw_llm = make_llm(checkpoint, logprobs_mode="raw_logits")
    try:
        (raw,) = raw_llm.generate([prompt], sampled, use_tqdm=False)
    finally:
        raw_llm.shutdown()
    for p, entry in enumerate(raw.prompt_logprobs[1:]):
        token = prompt[p + 1]
        assert entry[token].logprob == pytest.approx(reference[p, token].item(), abs=ATOL)
    processed_llm = make_llm(checkpoint, logprobs_mode="processed_logprobs")
    try:
        (processed,) = processed_llm.generate([prompt], sampled, use_tqdm=False)
    finally:
        processed_llm.shutdown()
    # The same seed draws the same tokens whatever the logprobs hold.
    tokens = processed.outputs[0].token_ids
    assert tokens == raw.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :].float()
    first = raw.outputs[0].logprobs[0]  # raw logits: the model's, at every listed token
    for token_id, logprob in first.items():
        assert logprob.logprob == pytest.approx(logits[0, token_id].item(), abs=ATOL)
    for step, entry in enumerate(processed.outputs[0].logprobs):
        scaled = logits[step] / 0.5
        scaled[scaled < scaled.topk(3).values[-1]] = float("-inf")
        expected = torch.log_softmax(scaled, dim=-1)
        assert len(entry) == 5 and entry[tokens[step]].logprob <= 0.0
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[token_id].item(), abs=ATOL)
