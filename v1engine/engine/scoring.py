"""Scores of text pairs from a pooling model (vLLM's `LLM.score`, `/score` and `/rerank`): with an
embedding model, the cosine similarity of the two texts' embeddings; with a cross-encoder (a
sequence classifier of one class), the classifier's score of the pair read as one input (the
tokenizer's pair encoding), after its activation (a sigmoid).

Pairs follow vLLM's rule: one text against one, one against N (the one repeated), or N against N
(the i-th with the i-th). Each distinct text is embedded once, however many pairs hold it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from v1engine.model.hf_config import classifier_labels
from v1engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)


def score_pairs(
    texts_1: str | Sequence[str], texts_2: str | Sequence[str]
) -> list[tuple[str, str]]:
    """The pairs to score, in order.

    Raises:
        ValueError: empty sides, or N against M texts with 1 < N != M.
    """
    first = [texts_1] if isinstance(texts_1, str) else list(texts_1)
    second = [texts_2] if isinstance(texts_2, str) else list(texts_2)
    if not first or not second:
        raise ValueError("there is nothing to score: both sides need at least one text")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"cannot pair {len(first)} texts with {len(second)}: send one text against any "
            "number, or as many on each side"
        )
    return list(zip(first, second))


def distinct_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """Every text of the pairs once, in first-seen order: what to embed."""
    return list(dict.fromkeys(text for pair in pairs for text in pair))


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / max(norms, 1e-12)  # torch's cosine_similarity eps (zero vectors score 0)


def score_outputs(
    pairs: list[tuple[str, str]], embedded: dict[str, EmbeddingRequestOutput]
) -> list[ScoringRequestOutput]:
    """One output per pair (its prompt tokens: both texts'), from each text's embedding."""
    outputs = []
    for first, second in pairs:
        a, b = embedded[first], embedded[second]
        outputs.append(
            ScoringRequestOutput(
                request_id=f"{a.request_id}_{b.request_id}",
                outputs=ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding)),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
            )
        )
    return outputs


class PairScorer:
    """How this engine's pooling model scores text pairs, one plan for `LLM.score` and the
    server alike: pool `token_ids()` (each input, in order) for `task`, then `scores(pooled)`.

    Raises (on construction):
        ValueError: the model is a classifier of more than one class (no cross-encoder).
    """

    def __init__(
        self,
        pairs: list[tuple[str, str]],
        pooling_task: str | None,
        hf_config: Any,
        tokenizer: Any,
    ) -> None:
        self.pairs = pairs
        self.tokenizer = tokenizer
        self.cross_encoder = pooling_task == "classify"
        if self.cross_encoder:
            num_classes = len(classifier_labels(hf_config))
            if num_classes != 1:
                raise ValueError(
                    "scoring text pairs needs an embedding model or a cross-encoder (a "
                    f"classifier of one class); this classifier has {num_classes} classes: use "
                    "classify instead"
                )
        self.task = "classify" if self.cross_encoder else "embed"
        # An embedding model embeds each distinct text once.
        self.texts = None if self.cross_encoder else distinct_texts(pairs)

    def token_ids(self) -> list[list[int]]:
        """The inputs to pool: each pair as one input (a cross-encoder's, the tokenizer's pair
        encoding), or each distinct text.

        Raises:
            ValueError: there is no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError("scoring text pairs needs the tokenizer (skip_tokenizer_init is set)")
        if self.cross_encoder:
            return [self.tokenizer(a, text_pair=b)["input_ids"] for a, b in self.pairs]
        return [self.tokenizer.encode(text) for text in self.texts]

    def scores(
        self, pooled: list[EmbeddingRequestOutput] | list[ClassificationRequestOutput]
    ) -> list[ScoringRequestOutput]:
        """One output per pair, from the pooled inputs (in `token_ids()` order)."""
        if self.cross_encoder:
            return [_cross_encoder_score(output) for output in pooled]
        return score_outputs(self.pairs, dict(zip(self.texts, pooled)))


def _cross_encoder_score(output: ClassificationRequestOutput) -> ScoringRequestOutput:
    return ScoringRequestOutput(
        request_id=output.request_id,
        outputs=ScoringOutput(output.outputs.probs[0]),
        prompt_token_ids=output.prompt_token_ids,
        num_cached_tokens=output.num_cached_tokens,
    )
