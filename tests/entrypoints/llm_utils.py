"""What the LLM end-to-end tests share: prompts, greedy parameters, an LLM on a tiny checkpoint,
and transformers' greedy tokens to compare with."""

from __future__ import annotations

import torch

from v1engine.entrypoints.llm import LLM
from v1engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 22, 7], [3, 4], list(range(10, 47)), [8] * 20, [2, 60, 61, 62, 63, 64, 65]]


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


# 14 usable blocks of 4 tokens cannot hold the five PROMPTS at once, so the scheduler must preempt
# and recompute; a 16-token budget chunks the 37-token prompt.
PREEMPTING = dict(
    block_size=4, num_gpu_blocks_override=15, max_model_len=56, max_num_batched_tokens=16
)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)


def preempted_greedy(llm: LLM) -> list[list[int]]:
    """PROMPTS' greedy tokens on an engine made with PREEMPTING, checking that it preempted and
    freed every block."""
    got = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
    assert all_blocks_free(llm)
    return got


def seeded_alone_and_in_batch(llm: LLM) -> tuple[list[int], list[int]]:
    """PROMPTS[0]'s SEEDED tokens alone, and in a batch of other seeded requests."""
    other = SamplingParams(max_tokens=7, temperature=0.8, seed=7, ignore_eos=True)
    alone = token_ids(llm.generate([PROMPTS[0]], SEEDED, use_tqdm=False))[0]
    batch = llm.generate(PROMPTS[2:] + [PROMPTS[0]], [other] * 3 + [SEEDED], use_tqdm=False)
    return alone, token_ids(batch)[-1]


def make_llm(checkpoint: str, **kwargs) -> LLM:
    args = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    args.update(kwargs)
    return LLM(checkpoint, **{"skip_tokenizer_init": True, **args})


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def all_blocks_free(llm: LLM) -> bool:
    pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_usable_blocks


def hf_beam_search(
    model, prompt: list[int], width: int, max_tokens: int
) -> list[tuple[list[int], float]]:
    """vLLM's beam search without EOS, spelled out over transformers' logits: each step extends
    every beam by its 2 * width most likely tokens and keeps the `width` best by cumulative
    logprob (all beams have one length, so length_penalty cannot reorder them). Returns the
    final beams' (output tokens, cumulative logprob), best first."""
    beams = [(list(prompt), 0.0)]
    for _ in range(max_tokens):
        extended = []
        for tokens, cum_logprob in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), dim=-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                extended.append((tokens + [token], cum_logprob + logprob))
        beams = sorted(extended, key=lambda beam: beam[1], reverse=True)[:width]
    return [(tokens[len(prompt) :], cum_logprob) for tokens, cum_logprob in beams]
