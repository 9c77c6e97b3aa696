"""GPUModelRunner: owns the model, the KV caches and the persistent batch; runs one step.

A step (`execute_model`):
1. `RequestStates.update` applies the SchedulerOutput diffs to the request states and the
   persistent batch, so rows 0 .. num_reqs - 1 are exactly this step's requests (the contract is
   written out in `request_states.py`).
2. `build_model_inputs`: flat input ids and positions, the index of each sampling request's
   last token, and per KV cache group the attention metadata, which the attention backend (chosen
   once, in `load_model`) builds from the group's slot mapping and block table.
3. forward inside `set_forward_context`, then logits only at the prompt positions whose
   prompt logprobs are asked for (`prompt_logprobs.py`) and at those last tokens (every rank:
   the LM head gathers over the tensor-parallel group); the driver alone samples
   (`step_sampler.py`), and every rank appends the driver's tokens to its request states (the
   next step may already be scheduled on top of them). A pooling engine (`runner="pooling"`)
   samples nothing: the driver returns those last tokens' hidden states instead.
4. With speculative decoding, the LM head also reads each draft the step verifies, and the
   driver proposes the drafts of each request's next step (`spec_decode.py`).

The class runs on CPU or CUDA alike; its name follows vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from v1engine.config import EngineConfig
from v1engine.kv_cache_interface import AttentionSpec, KVCacheConfig
from v1engine.logger import info_once, init_logger
from v1engine.lora.layers import LoRAMapping
from v1engine.lora.manager import LoRAModelManager
from v1engine.model.derived_weights import DerivedWeights
from v1engine.model.hf_config import resolve_dtype
from v1engine.model.layers.attention import Attention, get_attention_layers
from v1engine.model.layers.attention_backend import (
    AttentionBackend,
    get_default_attention_backend,
    set_forward_context,
)
from v1engine.model.layers.sampler import Sampler
from v1engine.model.loader import load_model
from v1engine.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from v1engine.utils import GiB_bytes
from v1engine.worker.cuda_graphs import DecodeCudaGraphs
from v1engine.worker.kv_cache import (
    allocate_kv_caches,
    bind_kv_caches,
    kv_cache_group_specs,
    unbind_kv_caches,
)
from v1engine.worker.model_inputs import (
    ModelInputs,
    build_dummy_model_inputs,
    build_model_inputs,
    dummy_sampling_metadata,
    profile_query_lens,
)
from v1engine.worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from v1engine.worker.request_states import InputBatch, RequestStates
from v1engine.worker.spec_decode import propose_drafts
from v1engine.worker.step_sampler import StepSampler

logger = init_logger(__name__)


# Requests in the warm-up batch: one prefill-sized chunk and a few decodes.
_WARM_UP_NUM_DECODES = 4


class GPUModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: Any, device: torch.device, is_driver: bool
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.is_driver = is_driver
        self.tp_size = config.parallel_config.world_size
        model_config, cache_config = config.model_config, config.cache_config
        self.dtype = resolve_dtype(hf_config, model_config.dtype, device.type)
        cache_dtype = cache_config.cache_dtype
        self.kv_cache_dtype = self.dtype if cache_dtype == "auto" else getattr(torch, cache_dtype)
        scheduler_config = config.scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        self.vocab_size: int = hf_config.vocab_size
        # A pooling engine returns prompts' last hidden states instead of sampling.
        self.pooling = model_config.runner_type == "pooling"
        self.model: torch.nn.Module | None = None
        self.attn_layers: dict[str, Attention] = {}
        self.attn_backend: AttentionBackend | None = None
        self.weights_bytes = 0
        self.sampler = Sampler(model_config.logprobs_mode)
        self.step_sampler: StepSampler | None = None  # with the model
        # Drafts proposed for each request's next step (spec_decode.py); None: none.
        self.speculative_config = config.speculative_config
        # The weights' packed copies and the greedy screen (derived_weights.py).
        self.derived: DerivedWeights | None = None
        # The request states and the persistent batch; built with the KV cache.
        self.states: RequestStates | None = None
        # Per KV cache group, the spec its attention metadata is built for.
        self.kv_cache_group_specs: list[AttentionSpec] = []
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Captured by capture_cuda_graphs (CUDA only); decode-only steps replay them.
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.lora: LoRAModelManager | None = None  # with LoRA enabled

    # -- start-up -------------------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        config = self.config.model_config
        self.model = load_model(
            config.model, self.hf_config, self.dtype, self.device, self.pooling, config.load_format
        )
        self.attn_layers = get_attention_layers(self.model)
        self.attn_backend = get_default_attention_backend(self.device.type)
        # A pooling engine never samples: no bfloat16 copy of the LM head either.
        self.derived = DerivedWeights(self.model, with_greedy_screen=not self.pooling)
        self.step_sampler = StepSampler(
            self.model, self.sampler, self.derived, self.vocab_size, self.is_driver, self.tp_size
        )
        # parameters() yields a tied weight once; the derived copies are not parameters.
        self.weights_bytes = self.derived.nbytes + sum(
            p.numel() * p.element_size() for p in self.model.parameters()
        )
        if self.config.lora_config is not None:
            lora_config = self.config.lora_config
            self.lora = LoRAModelManager(
                self.model, self.hf_config, lora_config, self.dtype, self.device
            )
            self.weights_bytes += self.lora.nbytes
        info_once(
            logger,
            "Loaded %s (%s, %s attention) in %.2f s: %.3f GiB of weights per rank",
            type(self.model).__name__,
            self.dtype,
            self.attn_backend.name,
            time.perf_counter() - start,
            self.weights_bytes / GiB_bytes,
        )

    def get_kv_cache_spec(self) -> dict[str, AttentionSpec]:
        """Layer name -> spec, with this rank's KV heads and the cache dtype."""
        block_size = self.config.cache_config.block_size
        return {
            name: layer.get_kv_cache_spec(block_size, self.kv_cache_dtype)
            for name, layer in self.attn_layers.items()
        }

    def profile_run(
        self,
        token_limit: int | None = None,
        after_stage: Callable[[float], None] | None = None,
    ) -> None:
        """The largest step the scheduler may send, without KV cache: a forward over
        `max_num_batched_tokens` tokens in `max_num_seqs` requests, then the sampler with every
        stage on over one row per request. With `token_limit`, a smaller step stands in for it:
        at most that many tokens, in requests of at least `PROFILE_MIN_QUERY_LEN` tokens (each
        request costs the forward an attention call and the sampler a [vocab] row).
        `after_stage(scale)` is called after the forward, then after the sampler, with how many
        times more tokens, then rows, the largest step has (1.0 when it ran whole)."""
        query_lens, run_lens = profile_query_lens(
            self.max_num_tokens, self.max_num_reqs, self.max_model_len, token_limit
        )
        token_scale = sum(query_lens) / sum(run_lens)
        row_scale = len(query_lens) / len(run_lens)
        # Speculative decoding: the LM head and the sampler read a row per draft too.
        spec = self.speculative_config
        rows = 1 if spec is None else min(1 + spec.num_speculative_tokens, min(run_lens))
        if after_stage is None:
            self._dummy_run(run_lens, rows_per_request=rows)
        else:
            self._dummy_run(run_lens, lambda: after_stage(token_scale), rows)
            after_stage(row_scale)

    @torch.inference_mode()
    def _dummy_run(
        self,
        query_lens: list[int],
        after_forward: Callable[[], None] | None = None,
        rows_per_request: int = 1,
    ) -> None:
        inputs = build_dummy_model_inputs(
            query_lens, self.attn_backend, self.kv_cache_group_specs, self.device
        )
        hidden = self._forward(inputs, self._output_rows(inputs))  # as a real step's
        if after_forward is not None:
            after_forward()
        if rows_per_request > 1:
            hidden = hidden.repeat_interleave(rows_per_request, dim=0)
        logits = self.model.compute_logits(hidden)  # [num_reqs * rows_per_request, vocab]
        max_logprobs = self.config.model_config.max_logprobs
        sampling = dummy_sampling_metadata(
            len(hidden), self.vocab_size, max(query_lens), max_logprobs, self.device
        )
        self.sampler(logits, sampling)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        start = time.perf_counter()
        self.kv_cache_config = kv_cache_config
        self.kv_caches = allocate_kv_caches(kv_cache_config, self.device)
        bind_kv_caches(self.attn_layers, self.kv_caches, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        self.kv_cache_group_specs = kv_cache_group_specs(kv_cache_config)
        block_sizes = [group.kv_cache_spec.block_size for group in groups]
        input_batch = InputBatch(self.max_num_reqs, self.max_model_len, block_sizes)
        self.states = RequestStates(input_batch, generator_device=self.device)
        num_bytes = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
        info_once(
            logger,
            "KV cache: %d blocks in %d group(s), %d tensor(s), %.3f GiB per rank, "
            "allocated in %.2f s",
            kv_cache_config.num_blocks,
            len(groups),
            len(kv_cache_config.kv_cache_tensors),
            num_bytes / GiB_bytes,
            time.perf_counter() - start,
        )

    def warm_up(self) -> None:
        """One small mixed step over the bound caches (writes nothing into them): a chunk of
        up to 16 tokens and a few single-token requests, with the sampler."""
        prefill_len = min(16, self.max_model_len, self.max_num_tokens)
        num_decodes = min(_WARM_UP_NUM_DECODES, self.max_num_reqs - 1, self.max_num_tokens - 1)
        self._dummy_run([prefill_len] + [1] * max(0, num_decodes))

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        """Captures the decode forward at fixed batch sizes (`cuda_graphs.py`); after
        `initialize_kv_cache`, since the graphs hold the caches' addresses."""
        if self.states is None:
            raise RuntimeError("capture_cuda_graphs needs the KV cache: run initialize_kv_cache")
        if not self.attn_backend.supports_cuda_graphs:
            info_once(
                logger,
                "The %s attention backend cannot run in a CUDA graph; running eagerly",
                self.attn_backend.name,
            )
            return
        graphs = DecodeCudaGraphs(
            self.model,
            self.attn_backend,
            self.kv_cache_group_specs,
            min(self.max_num_reqs, self.max_num_tokens),  # the largest decode-only step
            self.max_model_len,
            self.device,
        )
        graphs.capture()
        self.cuda_graphs = graphs

    def release_kv_cache(self) -> None:
        """Drops the KV cache, the persistent batch and the CUDA graphs (they hold the caches'
        addresses); `initialize_kv_cache(self.kv_cache_config)` builds them again."""
        self.cuda_graphs = None
        unbind_kv_caches(self.attn_layers)
        self.kv_caches = {}
        self.states = None
        self.kv_cache_group_specs = []

    shutdown = release_kv_cache

    # -- one step --------------------------------------------------------------------------------
    def _forward(
        self,
        inputs: ModelInputs,
        output_rows: torch.Tensor | None = None,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """The model over the step's tokens: the hidden states of `output_rows` of them (all
        when None), [rows, hidden_size]; `lora`: the tokens' adapters."""
        if self.cuda_graphs is not None and lora is None and self.cuda_graphs.fits(inputs):
            hidden = self.cuda_graphs.replay(inputs)  # decodes: every row samples
            return hidden if output_rows is None else hidden[output_rows]
        lora_mapping = None if lora is None else lora.with_output_rows(output_rows)
        metadata = inputs.attn_metadata
        with set_forward_context(inputs.query_start_loc, self.attn_backend, metadata, lora_mapping):
            return self.model(inputs.input_ids, inputs.positions, output_rows)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs one scheduled step. Returns: the sampled tokens on the driver, None elsewhere."""
        self._update_states(scheduler_output)
        if self.model.weights_version != self.derived.version:  # weights loaded again
            self.derived.refresh()
        batch = self.states.input_batch
        req_ids = list(batch.req_ids)
        query_lens = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64
        )
        if int(query_lens.sum()) != scheduler_output.total_num_scheduled_tokens:
            raise RuntimeError(
                f"total_num_scheduled_tokens={scheduler_output.total_num_scheduled_tokens} but "
                f"num_scheduled_tokens sums to {int(query_lens.sum())}"
            )
        if not req_ids:
            return ModelRunnerOutput(req_ids, []) if self.is_driver else None
        num_drafts = None
        if scheduler_output.scheduled_spec_decode_tokens:
            drafts = scheduler_output.scheduled_spec_decode_tokens
            num_drafts = np.array([len(drafts.get(r, ())) for r in req_ids], dtype=np.int64)
        inputs = build_model_inputs(
            batch, query_lens, self.attn_backend, self.kv_cache_group_specs, self.device, num_drafts
        )
        lora = None
        if self.lora is not None:
            row_loras = [self.states.requests[r].lora_request for r in req_ids]
            lora = self.lora.step_mapping(row_loras, query_lens)
        # Every rank, in this order: each LM-head call all-gathers the vocabulary shards.
        hidden, prompt_logprobs = self._run_model(inputs, query_lens, lora)
        if self.pooling:
            return self._pool(hidden, inputs, req_ids)
        sampled, logprobs = self.step_sampler.sample(
            hidden, inputs, req_ids, self.states, scheduler_output
        )
        self.states.append_sampled(req_ids, sampled)
        if not self.is_driver:
            return None
        output = ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs)
        if self.speculative_config is not None:
            output.spec_token_ids = propose_drafts(
                self.speculative_config, batch, len(req_ids), inputs.sampling_rows
            )
        return output

    def _run_model(
        self, inputs: ModelInputs, query_lens: np.ndarray, lora: LoRAMapping | None
    ) -> tuple[torch.Tensor, dict[str, LogprobsLists]]:
        """The forward: the hidden states of the rows that sample ([num_sampling, hidden_size]),
        and the prompt logprobs of the requests that asked for them. Only the sampling rows
        leave the model unless prompt logprobs read every row."""
        plan = None
        if self.states.prompt_logprobs:  # some request still scores its prompt
            plan = plan_prompt_logprobs(
                self.states.prompt_logprobs, self.states.input_batch, query_lens, self.device
            )
        if plan is None:
            return self._forward(inputs, self._output_rows(inputs), lora), {}
        hidden = self._forward(inputs, None, lora)
        as_logits = self.sampler.as_logits
        prompt_logprobs = compute_prompt_logprobs(
            self.model.compute_logits, hidden, plan, self.is_driver, as_logits=as_logits
        )
        return hidden[inputs.logits_indices], prompt_logprobs

    @staticmethod
    def _output_rows(inputs: ModelInputs) -> torch.Tensor | None:
        """The rows the LM head reads, or None where it reads them all (decodes only)."""
        every_row = inputs.logits_indices.shape[0] == inputs.input_ids.shape[0]
        return None if every_row else inputs.logits_indices

    def _pool(
        self, hidden: torch.Tensor, inputs: ModelInputs, req_ids: list[str]
    ) -> ModelRunnerOutput | None:
        """A pooling engine's step: each request whose prompt ended here gets its last token's
        final hidden state (a row of `hidden`), or a classifier's class logits of it, and
        nothing is sampled. Every rank holds the whole hidden state; the driver replies."""
        if not self.is_driver:
            return None
        score = getattr(self.model, "score", None)  # a sequence classifier's head
        if score is not None:
            hidden = score(hidden)
        vectors = hidden.float().cpu().tolist()
        pooled = {req_ids[row]: vector for row, vector in zip(inputs.sampling_rows, vectors)}
        return ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=pooled)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        if self.states is None:
            raise RuntimeError(
                "execute_model before initialize_from_config: the KV cache must be allocated "
                "first (run the start-up handshake)"
            )
        self.states.update(scheduler_output)
