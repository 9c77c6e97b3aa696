"""The per-step context attention layers read, so the model's forward stays (input_ids, positions).

The runner wraps each forward in `set_forward_context(attn_metadata)`; every `Attention` layer
reads it through `get_forward_context()`. `attn_metadata` is one `AttentionMetadata` for all
layers, or a dict keyed by layer name when KV cache groups (e.g. full and sliding-window layers)
have their own block tables. Steps run one at a time per process, so a module global suffices.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from v1engine.model.layers.attention_metadata import AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | dict[str, AttentionMetadata] | None = None


_forward_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _forward_context


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | dict[str, AttentionMetadata] | None,
) -> Iterator[ForwardContext]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
