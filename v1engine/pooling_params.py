"""PoolingParams: how one embedding request turns its prompt into a vector (vLLM's names).

An engine started with `runner="pooling"` (`--runner pooling`) embeds instead of generating: the
workers return the final hidden state of each prompt's last token (vLLM's LAST pooling, its
default for a decoder model run as an embedding model), and the front end applies these params
to it: first the matryoshka cut to `dimensions`, then L2 normalization.
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

    def check_for_model(self, hf_config: Any, model_name: str | None) -> None:
        """Raises ValueError for `dimensions` the model was not trained to be cut to (vLLM's
        rule: the model must be matryoshka, and the size one of its listed ones if it lists
        them)."""
        if self.dimensions is None:
            return
        error = f"PoolingParams.dimensions {self.dimensions}: model {model_name!r}"
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

    def apply(self, hidden_state: list[float]) -> list[float]:
        """The embedding of a prompt whose last hidden state is `hidden_state`."""
        vector = hidden_state if self.dimensions is None else hidden_state[: self.dimensions]
        if self.normalize is False:
            return list(vector)
        norm = math.sqrt(math.fsum(x * x for x in vector))
        return [x / max(norm, 1e-12) for x in vector]  # the eps of torch's F.normalize
