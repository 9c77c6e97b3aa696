"""Test driver: runs a model through a paged KV cache with the engine's own pieces.

The real `Scheduler` mixes chunked prefills and decodes of several requests under a token budget
and allocates their blocks; the worker's `kv_cache` allocates and binds the caches, its
`InputBatch` and `build_model_inputs` lay out each step, and the default attention backend builds
the per-group metadata. Unlike `GPUModelRunner` (which computes logits only where it samples) it
records every processed position's logits, so tests can compare them row by row with
transformers, and it samples greedily. The batch is rebuilt each step from the scheduler's own
requests, so no copy of the workers' diff protocol lives here.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from v1engine.config import CacheConfig, SchedulerConfig
from v1engine.core.kv_cache_utils import get_kv_cache_configs
from v1engine.core.scheduler import Scheduler
from v1engine.kv_cache_interface import KVCacheConfig
from v1engine.model.layers.attention import get_attention_layers
from v1engine.model.layers.attention_backend import (
    get_default_attention_backend,
    set_forward_context,
)
from v1engine.outputs import ModelRunnerOutput, SchedulerOutput
from v1engine.request import Request
from v1engine.sampling_params import SamplingParams
from v1engine.worker.kv_cache import allocate_kv_caches, bind_kv_caches, kv_cache_group_specs
from v1engine.worker.model_inputs import build_model_inputs
from v1engine.worker.request_states import CachedRequestState, InputBatch


class _PagedModel:
    """The model with its bound caches and backend, and every processed position's logits."""

    def __init__(
        self, model: nn.Module, scheduler: Scheduler, kv_cache_config: KVCacheConfig
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.device = next(model.parameters()).device
        self.backend = get_default_attention_backend(self.device.type)
        self.group_specs = kv_cache_group_specs(kv_cache_config)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def step(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        batch = self._input_batch(scheduler_output, requests)
        scheduled = scheduler_output.num_scheduled_tokens
        query_lens = np.array([scheduled[r] for r in batch.req_ids], dtype=np.int64)
        inputs = build_model_inputs(batch, query_lens, self.backend, self.group_specs, self.device)
        with set_forward_context(inputs.query_start_loc, self.backend, inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [num_tokens, hidden_size]
        logits = self.model.compute_logits(hidden).cpu()  # [num_tokens, vocab_size]
        bounds = inputs.query_start_loc.tolist()
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        for row, req_id in enumerate(batch.req_ids):
            rows = logits[bounds[row] : bounds[row + 1]]
            self.logits.setdefault(req_id, []).append(rows)
            if row in inputs.sampling_rows:
                sampled[row] = [int(rows[-1].argmax())]
        self.scheduler.update_from_output(
            scheduler_output, ModelRunnerOutput(list(batch.req_ids), sampled)
        )

    def _input_batch(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> InputBatch:
        """This step's requests as the scheduler holds them, in its order."""
        block_sizes = [spec.block_size for spec in self.group_specs]
        scheduler = self.scheduler
        batch = InputBatch(scheduler.max_num_seqs, scheduler.max_model_len, block_sizes)
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            # The scheduler counts this step's tokens as computed once it scheduled them.
            num_computed_tokens = request.num_computed_tokens - num_scheduled
            state = CachedRequestState(
                req_id=req_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                generator=None,
                block_ids=list(scheduler.kv_cache_manager.get_block_ids(req_id)),
                num_computed_tokens=num_computed_tokens,
                output_token_ids=list(request.output_token_ids),
            )
            batch.add_request(state)
        return batch


def _bind_kv_caches(
    model: nn.Module, cache_config: CacheConfig, scheduler_config: SchedulerConfig
) -> KVCacheConfig:
    """Sizes the caches as the engine does (`num_gpu_blocks_override` blocks) and binds them."""
    param = next(model.parameters())
    layers = get_attention_layers(model)
    specs = {
        name: layer.get_kv_cache_spec(cache_config.block_size, param.dtype)
        for name, layer in layers.items()
    }
    [kv_cache_config] = get_kv_cache_configs(cache_config, scheduler_config, [specs], [0])
    bind_kv_caches(layers, allocate_kv_caches(kv_cache_config, param.device), kv_cache_config)
    return kv_cache_config


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
    max_model_len = max(map(len, prompts)) + max_new_tokens
    cache_config = CacheConfig(
        block_size=block_size, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False
    )
    scheduler_config = SchedulerConfig(max_model_len, token_budget, max_num_seqs=len(prompts))
    kv_cache_config = _bind_kv_caches(model, cache_config, scheduler_config)
    scheduler = Scheduler(scheduler_config, cache_config, kv_cache_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    requests = {
        str(i): Request(str(i), prompt, params, None, max_model_len)
        for i, prompt in enumerate(prompts)
    }
    for request in requests.values():
        scheduler.add_request(request)
    runner = _PagedModel(model, scheduler, kv_cache_config)
    while scheduler.has_unfinished_requests():
        runner.step(scheduler.schedule(), requests)
    outputs = [request.output_token_ids for request in requests.values()]
    return outputs, [torch.cat(runner.logits[req_id]) for req_id in requests]


def hf_reference(hf_model: nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' logits for every position the paged run processed: [len - 1, vocab]."""
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        return hf_model(ids).logits[0].float()
