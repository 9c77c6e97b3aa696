"""Worker extensions (`worker_extension_cls`) and worker-side probes for the tests of weight
updates and sleep mode (test_llm_weight_sync.py, test_llm_sleep.py)."""

from __future__ import annotations

import psutil
import torch


class WeightSync:
    """vLLM's RL recipe: a trainer sends its tensors (HF names, full size) to every rank over
    `collective_rpc`, and each rank loads them into its model, which shards them."""

    def load_trainer_weights(self, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
        return sorted(self.model_runner.model.load_weights(weights))


class ClashingExtension:
    def load_model(self) -> None:  # the worker's own: refused, not silently replaced
        raise AssertionError("never called")


def worker_vms(worker) -> int:
    """The worker process's mapped memory, in bytes: a CPU KV cache is an anonymous mapping whose
    pages become resident only as blocks are written, so its release shows here in full."""
    return psutil.Process().memory_info().vms


def weight_storage_bytes(worker) -> int:
    """The bytes the storages of the model's parameters hold (0 once sleep level 2 freed them)."""
    params = worker.model_runner.model.parameters()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    return sum(storages.values())


def cuda_reserved_bytes(worker) -> int:
    """What the worker's CUDA caching allocator holds."""
    return torch.cuda.memory_reserved(worker.device)


def has_cuda_graphs(worker) -> bool:
    return worker.model_runner.cuda_graphs is not None
