"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous range of token ids.

The vocabulary is padded up to a multiple of the tensor-parallel size so every rank holds the
same number of rows; padded rows are zero and padded logits are cut off after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from v1engine.model.layers.gemm import linear
from v1engine.model.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from v1engine.model.weight_utils import WeightSource, copy_weight, narrow_weight, weight_shape
from v1engine.utils import round_up


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp_size = get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = round_up(num_embeddings, tp_size)
        self.num_embeddings_per_rank = self.num_embeddings_padded // tp_size
        self.vocab_start = get_tp_rank() * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        # zeros, not empty: the padded rows are never loaded and must not produce garbage logits.
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: WeightSource, shard_id: object = None
    ) -> None:
        rows = weight_shape(loaded)[0]
        if rows != self.num_embeddings:
            raise ValueError(
                f"checkpoint embedding has {rows} rows but config.json says vocab_size="
                f"{self.num_embeddings}; the checkpoint does not match its config"
            )
        num_rows = max(0, min(self.vocab_end, rows) - self.vocab_start)
        if num_rows:
            shard = narrow_weight(loaded, 0, self.vocab_start, num_rows)
            copy_weight(param.data[:num_rows], shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [num_tokens] -> [num_tokens, embedding_dim]
        if self.num_embeddings_per_rank == self.num_embeddings_padded:
            return F.embedding(input_ids, self.weight)
        # Ids owned by another rank look up row 0 here, are zeroed, and arrive via the all-reduce.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        embeds = F.embedding(local_ids, self.weight).masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(embeds)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden_size] -> [num_tokens, vocab_size] float32, on every rank."""
        logits = linear(hidden_states, self.weight)  # [num_tokens, num_embeddings_per_rank]
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings].float()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
