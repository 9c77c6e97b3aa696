"""`LLM`'s pooling methods (vLLM keeps them in a mixin too): `embed`, `classify`, `score` and
`encode`, for an engine started with `runner="pooling"`. Each prompt is one pooling request,
run to its end by `LLM._run` with the others of the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from v1engine.engine.processor import PromptType
from v1engine.engine.scoring import PairScorer, score_pairs
from v1engine.entrypoints.offline_inputs import UseTqdm, as_prompt_list, per_prompt
from v1engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from v1engine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from v1engine.config import EngineConfig
    from v1engine.engine.llm_engine import LLMEngine
    from v1engine.engine.processor import Processor


class PoolingMixin:
    """Mixed into `LLM`, whose engine, processor, tokenizer and `_run` it uses."""

    config: EngineConfig
    llm_engine: LLMEngine
    processor: Processor
    tokenizer: Any
    _run: Callable[..., list[Any]]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: `pooling_task` "embed" or "classify" (None: the
        model's own) runs as `embed` or `classify` and returns their outputs, whose
        `outputs.data` is the result as a tensor (as vLLM's).

        Raises:
            ValueError: as `embed` / `classify`, or a task this engine does not serve (vLLM's
                token-level "token_embed" and "token_classify" among them).
        """
        task = pooling_task or self.processor.pooling_task or "embed"
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, task)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embeds every prompt (`outputs.embedding`: the last token's final hidden state, cut
        and L2-normalized as `pooling_params` say); needs `runner="pooling"`.
        `truncate_prompt_tokens` (vLLM's) overrides the params' own.

        Raises:
            ValueError: not a pooling engine, a classifier, a bad prompt or params; no request
                of this call is left running.
        """
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "embed")

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[ClassificationRequestOutput]:
        """Classifies every prompt with a sequence classifier (a `*ForSequenceClassification`
        checkpoint, which pools): `outputs.probs` holds one score per class, the model's
        activation of its class logits (softmax; sigmoid for one class or multi-label), or the
        logits themselves with `PoolingParams(use_activation=False)`.

        Raises:
            ValueError: not a pooling engine, a model that embeds, a bad prompt or params; no
                request of this call is left running.
        """
        return self._pool(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, "classify")

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        truncate_prompt_tokens: int | None,
        use_tqdm: UseTqdm,
        task: str,
    ) -> list[Any]:
        prompts = as_prompt_list(prompts)
        params = per_prompt(
            pooling_params or PoolingParams(), PoolingParams, len(prompts), "pooling params"
        )
        if truncate_prompt_tokens is not None:
            params = [
                dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params
            ]

        def add(request_id: str, index: int) -> None:
            # Not LLMEngine.add_request, which pools with the model's own task: embed() and
            # classify() name the task they ask for, which the processor checks against it.
            token_ids = self.processor.tokenize(prompts[index])[1]
            request = self.processor.process_pooling(
                request_id, token_ids, params[index], task=task
            )
            self.llm_engine.add_core_requests(request_id, [request])

        desc = "Classifying" if task == "classify" else "Embedding"
        return [_pooled(output) for output in self._run(len(prompts), add, use_tqdm, desc)]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
    ) -> list[ScoringRequestOutput]:
        """Scores text pairs (one against one, one against N, or N against N) as vLLM does:
        with an embedding model `outputs.score` is the cosine similarity of the two texts'
        embeddings (each distinct text embedded once); with a cross-encoder (a classifier of
        one class) the classifier's score of the pair. Needs `runner="pooling"`.

        Raises:
            ValueError: texts that do not pair, a classifier of several classes, or as `embed`.
        """
        hf_config = self.config.model_config.hf_config
        pairs = score_pairs(data_1, data_2)
        scorer = PairScorer(pairs, self.processor.pooling_task, hf_config, self.tokenizer)
        prompts = [{"prompt_token_ids": ids} for ids in scorer.token_ids()]
        pooled = self._pool(prompts, None, truncate_prompt_tokens, use_tqdm, scorer.task)
        return scorer.scores(pooled)


def _pooled(output: PoolingRequestOutput | RequestOutput) -> PoolingRequestOutput:
    if isinstance(output, PoolingRequestOutput):
        return output
    reason = output.outputs[0].finish_reason  # the core refused it (it logged why)
    raise RuntimeError(f"request {output.request_id!r} ended ({reason}) without a result")
