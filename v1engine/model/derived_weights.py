"""The copies a model runner derives from the weights for speed, kept in step with them.

On CPU in float32 the loader gives each matmul a packed copy of its weight for our gemm
(`linear.pack_cpu_weights`), and greedy steps read the LM head through a bfloat16 copy
(`greedy_screen.py`). Weights loaded again in place (a trainer's new weights through
`model.load_weights`, as in vLLM's RL recipe, or `Worker.reload_weights`) bump the model's
`weights_version`; the model runner then calls `refresh` before the next step, which rewrites
the copies.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from v1engine.model.layers.greedy_screen import GreedyScreen
from v1engine.model.layers.linear import packed_weight_bytes, repack_cpu_weights


class DerivedWeights:
    """`with_greedy_screen=False`: a model that only pools needs no screen."""

    def __init__(self, model: nn.Module, with_greedy_screen: bool) -> None:
        self.model = model
        self.greedy_screen = GreedyScreen.for_model(model) if with_greedy_screen else None
        self.version = model.weights_version

    @property
    def nbytes(self) -> int:
        """What the copies add to the weights' memory."""
        screen = 0 if self.greedy_screen is None else self.greedy_screen.nbytes
        return packed_weight_bytes(self.model) + screen

    def tensors(self) -> Iterator[torch.Tensor]:
        """The copies themselves (sleep mode frees them with the weights)."""
        packed = (getattr(m, "packed_weight", None) for m in self.model.modules())
        yield from (p for p in packed if p is not None)
        if self.greedy_screen is not None:
            yield self.greedy_screen.weight_bf16

    def refresh(self) -> None:
        """Derives the copies again from the weights (the model runner calls it before a step
        when the model's `weights_version` moved past `version`)."""
        repack_cpu_weights(self.model)
        if self.greedy_screen is not None:
            self.greedy_screen.refresh()
        self.version = self.model.weights_version
