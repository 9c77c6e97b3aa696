"""Test driver: runs a model through a paged KV cache the way the model runner will.

A tiny token-budget scheduler mixes chunked prefills and decodes of several requests in each
step, with hand-built `AttentionMetadata`, and greedy-samples from the logits. It records every
processed position's logits so tests can compare them row by row with transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from tests.model.paged_batch import BlockAllocator, build_metadata
from v1engine.model.forward_context import set_forward_context
from v1engine.model.layers.attention import get_attention_layers


def bind_kv_caches(model: nn.Module, num_blocks: int, block_size: int) -> None:
    """Gives every attention layer zeroed K and V caches of [num_blocks, block_size, kv, head]."""
    param = next(model.parameters())
    for layer in get_attention_layers(model).values():
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        layer.kv_cache = (
            torch.zeros(shape, dtype=param.dtype, device=param.device),
            torch.zeros(shape, dtype=param.dtype, device=param.device),
        )


@dataclass
class _Request:
    tokens: list[int]
    num_prompt_tokens: int
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens


def generate_paged(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    token_budget: int = 10,
    block_size: int = 4,
    num_blocks: int = 128,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation. Returns per request: the generated tokens, and the logits
    [num_prompt_tokens + max_new_tokens - 1, vocab_size] of every position it processed."""
    bind_kv_caches(model, num_blocks, block_size)
    allocator = BlockAllocator(num_blocks, block_size, seed=1)
    reqs = [_Request(list(p), len(p)) for p in prompts]
    while any(r.num_generated < max_new_tokens for r in reqs):
        steps, budget = [], token_budget
        for req_id, req in enumerate(reqs):
            num_new = min(len(req.tokens) - req.num_computed, budget)
            if req.num_generated >= max_new_tokens or num_new == 0:
                continue
            steps.append((req_id, req.num_computed, num_new))
            budget -= num_new
        _run_step(model, allocator, reqs, steps)
    outputs = [r.tokens[r.num_prompt_tokens :] for r in reqs]
    return outputs, [torch.cat(r.logits) for r in reqs]


def _run_step(model, allocator, reqs, steps) -> None:
    device = next(model.parameters()).device
    input_ids = torch.tensor([t for i, c, n in steps for t in reqs[i].tokens[c : c + n]])
    positions = torch.cat([torch.arange(c, c + n) for _, c, n in steps])
    metadata = build_metadata(allocator, steps)
    metadata = dataclasses.replace(
        metadata,
        **{
            f.name: getattr(metadata, f.name).to(device)
            for f in dataclasses.fields(metadata)
            if isinstance(getattr(metadata, f.name), torch.Tensor)
        },
    )
    with set_forward_context(metadata):
        hidden = model(input_ids.to(device), positions.to(device))  # [num_tokens, hidden_size]
    logits = model.compute_logits(hidden).cpu()  # [num_tokens, vocab_size]
    start = 0
    for req_id, _, num_new in steps:
        req = reqs[req_id]
        req.logits.append(logits[start : start + num_new])
        start += num_new
        req.num_computed += num_new
        if req.num_computed == len(req.tokens):
            req.tokens.append(int(logits[start - 1].argmax()))


def hf_reference(hf_model: nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits for every position the paged run processed: [len - 1, vocab]."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        return hf_model(ids).logits[0].float()
