"""Worker extensions (`worker_extension_cls`) for test_llm_weight_sync.py."""

from __future__ import annotations

import torch


class WeightSync:
    """vLLM's RL recipe: a trainer sends its tensors (HF names, full size) to every rank over
    `collective_rpc`, and each rank loads them into its model, which shards them."""

    def load_trainer_weights(self, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
        return sorted(self.model_runner.model.load_weights(weights))


class ClashingExtension:
    def load_model(self) -> None:  # the worker's own: refused, not silently replaced
        raise AssertionError("never called")
