"""A sparse mixture-of-experts MLP (Qwen3-MoE's, Mixtral's): a router scores every expert per
token, the top k by softmax run (their weights renormalized over the k when the config says so),
and the token's output is their SwiGLU outputs weighted by those scores, summed in expert order
(as transformers sums them, so float32 results match it to rounding); Qwen2-MoE adds a shared
expert, a dense MLP weighted by a sigmoid gate.

The experts' weights are stacked: `w13` [experts, 2 * intermediate, hidden] (gate rows, then up
rows) and `w2` [experts, hidden, intermediate]. Under tensor parallelism each rank holds every
expert's slice of the intermediate dimension (as a column-parallel gate/up and a row-parallel
down projection) and the block's output is all-reduced. Each step runs only the experts its
tokens chose, one pair of matmuls each; the choice is data-dependent, so a model with such a
block is never captured in a CUDA graph (`supports_cuda_graphs`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from v1engine.model.layers.activation import silu_and_mul
from v1engine.model.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_reduce,
)
from v1engine.model.weight_utils import (
    WeightSource,
    copy_weight,
    default_weight_loader,
    narrow_weight,
)

# A checkpoint expert's projection -> (the stacked parameter, where its rows go in it).
EXPERT_PROJECTIONS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


class SparseMoeBlock(nn.Module):
    """Replaces a dense MLP: [num_tokens, hidden] -> [num_tokens, hidden]. The router's weight
    is `gate.weight` and expert e's projections load through `load_expert_weight`."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        tp_size = get_tp_world_size()
        if intermediate_size % tp_size:
            raise ValueError(
                f"moe_intermediate_size={intermediate_size} is not divisible by "
                f"tensor_parallel_size={tp_size}"
            )
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate = intermediate_size // tp_size  # this rank's slice
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, replicated
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = default_weight_loader
        size = self.intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size), False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, size), False)
        # Qwen2-MoE's: a dense MLP every token runs, added with a sigmoid gate's weight.
        self.shared_expert = shared_expert
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)
            self.shared_expert_gate.weight.weight_loader = default_weight_loader

    def load_expert_weight(self, expert: int, projection: str, loaded: WeightSource) -> None:
        """Copies this rank's slice of expert `expert`'s `projection` (a checkpoint tensor of
        EXPERT_PROJECTIONS' names) into the stacked parameter."""
        name, half = EXPERT_PROJECTIONS[projection]
        size, start = self.intermediate, get_tp_rank() * self.intermediate
        if name == "w2":  # [hidden, intermediate]: this rank's columns
            copy_weight(self.w2[expert], narrow_weight(loaded, 1, start, size), "down_proj")
        else:  # [intermediate, hidden]: this rank's rows, into the gate or the up half
            target = self.w13[expert].narrow(0, half * size, size)
            copy_weight(target, narrow_weight(loaded, 0, start, size), projection)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        scores = F.softmax(self.gate(hidden_states), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)  # [num_tokens, top_k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(experts).tolist():  # ascending: transformers' order
            token_idx, slot = torch.where(experts == expert)
            x = F.linear(hidden_states[token_idx], self.w13[expert])
            x = F.linear(silu_and_mul(x), self.w2[expert])
            out.index_add_(0, token_idx, x * weights[token_idx, slot, None])
        out = tensor_model_parallel_all_reduce(out)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(hidden_states)  # all-reduced by its own down projection
        return out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
