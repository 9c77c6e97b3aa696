"""PoolingParams: how one pooling request turns its prompt into a vector (vLLM's names).

An engine started with `runner="pooling"` (`--runner pooling`) pools instead of generating: the
workers return, for each prompt's last token (vLLM's LAST pooling, its default for a decoder
model), the final hidden state, or a sequence classifier's class logits of it. The front end
applies these params: for an embedding, first the matryoshka cut to `dimensions`, then L2
normalization; for a classification, the model's activation (`hf_config.classifier_activation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from v1engine.sampling_params import _check


@dataclass(frozen=True)
class PoolingParams:
    # Keep only the first `dimensions` values: only for models trained for it (matryoshka).
    dimensions: int | None = None
    # L2-normalize the vector (None: yes, as vLLM's embed default).
    normalize: bool | None = None
    # Keep only the last k prompt tokens; -1: as many as max_model_len allows.
    truncate_prompt_tokens: int | None = None
    # Classification: apply the model's activation to the class logits (None: yes).
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        dimensions, tokens = self.dimensions, self.truncate_prompt_tokens
        _check(
            dimensions is None or (isinstance(dimensions, int) and dimensions >= 1),
            "dimensions",
            dimensions,
            "must be an int >= 1 (or None: all)",
            "PoolingParams",
        )
        _check(
            tokens is None or tokens == -1 or tokens >= 1,
            "truncate_prompt_tokens",
            tokens,
            "must be >= 1 or -1",
            "PoolingParams",
        )

    def check_for_model(self, task: str, hf_config: Any, model_name: str | None) -> None:
        """Raises ValueError for a field the model's task ("embed" or "classify") does not
        read, or `dimensions` the model was not trained to be cut to (vLLM's rule: the model
        must be matryoshka, and the size one of its listed ones if it lists them)."""
        model = f"model {model_name!r}"
        if task == "classify":
            for name in ("dimensions", "normalize"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"PoolingParams.{name} shapes embeddings, but {model} is a classifier; "
                        "drop it"
                    )
            return
        if self.use_activation is not None:
            raise ValueError(
                f"PoolingParams.use_activation is for classifiers, but {model} embeds; drop it"
            )
        if self.dimensions is None:
            return
        error = f"PoolingParams.dimensions {self.dimensions}: {model}"
        listed = getattr(hf_config, "matryoshka_dimensions", None)
        if listed is None and not getattr(hf_config, "is_matryoshka", False):
            raise ValueError(
                f"{error} does not support matryoshka representation, and cutting its "
                "embeddings would make them poor; drop dimensions"
            )
        if listed is not None and self.dimensions not in listed:
            raise ValueError(f"{error} supports matryoshka dimensions {list(listed)} only")
        if self.dimensions > hf_config.hidden_size:
            raise ValueError(f"{error} has hidden size {hf_config.hidden_size}, fewer")

    def embed(self, hidden_state: list[float]) -> list[float]:
        """The embedding of a prompt whose last hidden state is `hidden_state`."""
        vector = hidden_state if self.dimensions is None else hidden_state[: self.dimensions]
        if self.normalize is False:
            return list(vector)
        norm = math.sqrt(math.fsum(x * x for x in vector))
        return [x / max(norm, 1e-12) for x in vector]  # the eps of torch's F.normalize

    def classify(self, logits: list[float], activation: str) -> list[float]:
        """The class scores of a prompt whose class logits are `logits`; `activation`:
        "softmax", "sigmoid" or "none" (`hf_config.classifier_activation`)."""
        if self.use_activation is False or activation == "none":
            return list(logits)
        if activation == "sigmoid":
            return [_sigmoid(x) for x in logits]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = math.fsum(exps)
        return [e / total for e in exps]


def _sigmoid(x: float) -> float:
    # Either form alone overflows math.exp for one sign of a large |x|.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
