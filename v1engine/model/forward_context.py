"""The per-step context attention layers read, so the model's forward stays (input_ids, positions).

The runner wraps each forward in `set_forward_context(...)`; every `Attention` layer reads it
through `get_forward_context()` and takes entry `kv_cache_group_index` of `attn_metadata`. It is a
module global because a process runs one forward at a time (a worker executes its steps in
order, and the model is never re-entered), so no layer can see another step's context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from v1engine.model.layers.attention_backend import AttentionBackend


@dataclass(frozen=True)
class ForwardContext:
    # [num_reqs + 1] int32: where each request's new tokens start; None: one request.
    query_start_loc: torch.Tensor | None = None
    attn_backend: AttentionBackend | None = None
    # Per KV cache group, the backend's metadata for this step; None: no KV cache (profiling).
    attn_metadata: list[Any] | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextmanager
def set_forward_context(
    query_start_loc: torch.Tensor | None,
    attn_backend: AttentionBackend | None = None,
    attn_metadata: list[Any] | None = None,
) -> Iterator[ForwardContext]:
    if attn_metadata is not None and attn_backend is None:
        raise ValueError("attn_metadata needs the attn_backend that built it, got None")
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(query_start_loc, attn_backend, attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
