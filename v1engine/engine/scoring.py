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


def check_cross_encoder(hf_config: Any) -> None:
    """Raises ValueError unless the classifier has one class (it is a cross-encoder)."""
    num_classes = len(classifier_labels(hf_config))
    if num_classes != 1:
        raise ValueError(
            f"scoring text pairs needs an embedding model or a cross-encoder (a classifier of "
            f"one class); this classifier has {num_classes} classes: use classify instead"
        )


def cross_encoder_inputs(tokenizer: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """Each pair's token ids as one cross-encoder input (the tokenizer's pair encoding).

    Raises:
        ValueError: there is no tokenizer.
    """
    if tokenizer is None:
        raise ValueError("scoring text pairs needs the tokenizer (skip_tokenizer_init is set)")
    return [tokenizer(first, text_pair=second)["input_ids"] for first, second in pairs]


def cross_encoder_scores(
    classified: list[ClassificationRequestOutput],
) -> list[ScoringRequestOutput]:
    """One output per pair, its cross-encoder input classified."""
    return [
        ScoringRequestOutput(
            request_id=output.request_id,
            outputs=ScoringOutput(output.outputs.probs[0]),
            prompt_token_ids=output.prompt_token_ids,
            num_cached_tokens=output.num_cached_tokens,
        )
        for output in classified
    ]
