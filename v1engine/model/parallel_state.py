"""Tensor-parallel state over torch.distributed's default group.

The whole world is one tensor-parallel group (single node, one process per device), so the
helpers read the default group. Without an initialized process group every helper behaves as a
single rank, which lets models run in-process for tests and the uniprocess executor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def init_distributed(
    rank: int, world_size: int, init_method: str, backend: str | None = None
) -> None:
    """Joins the tensor-parallel group. `backend` defaults to NCCL with CUDA, gloo otherwise.

    Raises:
        RuntimeError: the process already belongs to a group of a different size.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialized with world_size="
                f"{dist.get_world_size()}, but world_size={world_size} was requested; call "
                "destroy_distributed() first"
            )
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the ranks (in place) and returns it; a no-op on one rank."""
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's `x` along `dim`, in rank order; every rank gets the result."""
    world_size = get_tp_world_size()
    if world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place (the other ranks pass a tensor of its shape and
    dtype) and returned; a no-op on one rank."""
    if get_tp_world_size() > 1:
        dist.broadcast(x, src=0)
    return x
