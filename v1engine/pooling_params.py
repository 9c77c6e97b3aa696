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


@dataclass(frozen=True)
class PoolingParams:
    # Keep only the first `dimensions` values: only for models trained for it (matryoshka).
    dimensions: int | None = None
    # L2-normalize the vector (None: yes, as vLLM's embed default).
    normalize: bool | None = None
    # Keep only the last k prompt tokens; -1: as many as max_model_len allows.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an int >= 1, got {self.dimensions!r}")
        tokens = self.truncate_prompt_tokens
        if tokens is not None and (tokens == 0 or tokens < -1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {tokens}")

    def check_for_model(self, hf_config: Any, model_name: str) -> None:
        """Raises ValueError for `dimensions` the model was not trained to be cut to (vLLM's
        rule: the model must be matryoshka, and the size one of its listed ones if it lists
        them)."""
        if self.dimensions is None:
            return
        listed = getattr(hf_config, "matryoshka_dimensions", None)
        if listed is None and not getattr(hf_config, "is_matryoshka", False):
            raise ValueError(
                f"model {model_name!r} does not support matryoshka representation: changing "
                f"output dimensions (got {self.dimensions}) would give poor embeddings; drop "
                "dimensions"
            )
        hidden_size = hf_config.hidden_size
        if listed is not None and self.dimensions not in listed:
            raise ValueError(
                f"model {model_name!r} supports matryoshka dimensions {list(listed)}, got "
                f"{self.dimensions}"
            )
        if self.dimensions > hidden_size:
            raise ValueError(
                f"dimensions {self.dimensions} is more than the model's hidden size {hidden_size}"
            )

    def apply(self, hidden_state: list[float]) -> list[float]:
        """The embedding of a prompt whose last hidden state is `hidden_state`."""
        vector = hidden_state if self.dimensions is None else hidden_state[: self.dimensions]
        if self.normalize is False:
            return list(vector)
        norm = math.sqrt(math.fsum(x * x for x in vector))
        return [x / max(norm, 1e-12) for x in vector]  # the eps of torch's F.normalize
