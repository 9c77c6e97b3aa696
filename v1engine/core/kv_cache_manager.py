"""KVCacheManager: which blocks each request holds, and prefix-cache reuse across requests.

Prefix caching works on FULL blocks only. Block i of a request is named by a hash chain:
`hash_i = sha256(msgpack((hash_{i-1}, tokens of block i)))` (`hash_{-1}` is None), so equal
hashes mean equal token sequences from the first token through the end of that block, which is
exactly when two requests may share the block's KV. sha256 rather than Python's `hash`: a
collision would silently hand a request someone else's KV, and 64-bit hashes of attacker-chosen
prompts can collide; with sha256 we treat collisions as impossible and do not compare tokens.

KV cache groups: every group draws from the one `BlockPool`, and a request holds the same number
of blocks in each group (block i of every group covers the same tokens). Sliding-window groups
are treated as full attention: correct, but blocks that fell out of the window are kept rather
than freed (known limitation: a hybrid model holds more blocks than its sizing assumed). With no
groups (an attention-free model) every allocation succeeds and nothing is cached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec

from v1engine.core.block_pool import BlockPool, KVCacheBlock
from v1engine.kv_cache_interface import KVCacheConfig
from v1engine.logger import init_logger
from v1engine.request import Request
from v1engine.utils import cdiv

logger = init_logger(__name__)

# One list of blocks per KV cache group.
KVCacheBlocks = tuple[list[KVCacheBlock], ...]

_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(
    parent_block_hash: bytes | None,
    token_ids: list[int],
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> bytes:
    """The chained hash of one full block: stable across processes and runs. A first block's
    `cache_salt` (vLLM's) and LoRA adapter are hashed with it, so every block of a salted
    request, or of one run with an adapter, differs from every block of another salt or
    adapter (the chain carries the first block's hash into all later ones)."""
    key: tuple = (parent_block_hash, token_ids)
    if cache_salt is not None or lora_name is not None:
        key = (None, token_ids, cache_salt, lora_name)
    return hashlib.sha256(_encoder.encode(key)).digest()


@dataclass
class PrefixCacheStats:
    """Cumulative, counted once per admission (not per scheduling attempt)."""

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVCacheManager:
    def __init__(
        self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool = True
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        block_sizes = {group.kv_cache_spec.block_size for group in groups}
        if len(block_sizes) > 1:
            raise ValueError(
                f"KV cache groups must share one block_size, got {sorted(block_sizes)}; "
                "build the KVCacheConfig with a single block_size"
            )
        if groups and kv_cache_config.num_blocks < 2:
            raise ValueError(
                f"KVCacheConfig.num_blocks must be >= 2 (block 0 is reserved), got "
                f"{kv_cache_config.num_blocks}; give the KV cache more memory"
            )
        self.num_groups = len(groups)
        self.block_size = block_sizes.pop() if block_sizes else 1
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching and self.num_groups > 0
        self.block_pool = BlockPool(max(kv_cache_config.num_blocks, 1), self.enable_caching)
        self.req_to_blocks: dict[str, KVCacheBlocks] = {}
        # How many of each request's leading blocks are already in the cache map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._warn_if_too_small()

    def _warn_if_too_small(self) -> None:
        # Sizing (kv_cache_utils) guarantees num_blocks for one max_model_len request; block 0
        # is reserved here, so a pool sized exactly would starve that request forever.
        num_needed = cdiv(self.max_model_len, self.block_size) * self.num_groups
        if num_needed > self.block_pool.num_usable_blocks:
            logger.warning(
                "KV cache has %d usable blocks (block 0 is reserved) but one max_model_len=%d "
                "request needs %d; such a request can never finish. Give the KV cache more "
                "memory or lower max_model_len",
                self.block_pool.num_usable_blocks,
                self.max_model_len,
                num_needed,
            )

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        return self.block_pool.get_usage()

    def _empty(self) -> KVCacheBlocks:
        return tuple([] for _ in range(self.num_groups))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of `request`'s full blocks, and the tokens it covers.

        Never the whole request: its last token is always left to compute, because the step
        that computes it is the one that produces the logits for the next token. None for a
        request asking for prompt logprobs: every prompt position's logits are needed (vLLM's
        rule; its full blocks are still cached for others). Takes no reference; pass the blocks
        to `allocate_slots` in the same scheduling pass.
        """
        hits = self._empty()
        if not self._reads_cache(request):
            return hits, 0
        self._update_block_hashes(request)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            blocks = [self.block_pool.get_cached_block(block_hash, g) for g in range(len(hits))]
            if any(block is None for block in blocks):
                break
            for group_hits, block in zip(hits, blocks):
                group_hits.append(block)
        return hits, len(hits[0]) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Gives `request` room for `num_new_tokens` more tokens after its computed ones.

        Args:
            request: its `num_computed_tokens` tokens already have KV in its blocks.
            num_new_tokens: tokens to compute this step (> 0).
            new_computed_blocks: prefix-cache hits from `get_computed_blocks`, only for a
                request that holds no blocks yet; they precede the new tokens.

        Returns:
            The blocks added per group (hits excluded), or None when the pool is short, in which
            case nothing changed. Blocks that become full with this step's tokens are cached.
        """
        assert num_new_tokens > 0
        hits = new_computed_blocks if new_computed_blocks is not None else self._empty()
        num_hit_blocks = len(hits[0]) if hits else 0
        req_blocks = self.req_to_blocks.get(request.request_id)
        assert not (req_blocks and num_hit_blocks), "prefix hits for a request holding blocks"
        num_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        assert num_tokens <= max(self.max_model_len, request.num_prompt_tokens), num_tokens
        if self.num_groups == 0:
            return ()
        num_held_blocks = len(req_blocks[0]) if req_blocks else 0
        # Fewer than it holds after speculative decoding rejected drafts that had needed a block.
        num_new_blocks = max(
            0, cdiv(num_tokens, self.block_size) - num_held_blocks - num_hit_blocks
        )
        if not self._can_allocate(num_new_blocks, hits):
            return None
        if req_blocks is None:
            req_blocks = self._start_request(request, num_hit_blocks)
        # Touch the hits before taking new blocks, or a free hit could be evicted for them.
        for group_blocks, group_hits in zip(req_blocks, hits):
            self.block_pool.touch(group_hits)
            group_blocks.extend(group_hits)
        new_blocks = tuple(self.block_pool.get_new_blocks(num_new_blocks) for _ in hits)
        for group_blocks, group_new in zip(req_blocks, new_blocks):
            group_blocks.extend(group_new)
        # Token ids exist only up to request.num_tokens: a block past them has no hash yet.
        self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def _reads_cache(self, request: Request) -> bool:
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def _can_allocate(self, num_new_blocks: int, hits: KVCacheBlocks) -> bool:
        # A hit on a free block leaves the free queue too, so it counts against the pool.
        num_free_hits = sum(1 for group in hits for block in group if block.ref_cnt == 0)
        num_needed = num_new_blocks * self.num_groups + num_free_hits
        return num_needed <= self.block_pool.get_num_free_blocks()

    def _start_request(self, request: Request, num_hit_blocks: int) -> KVCacheBlocks:
        req_blocks = self._empty()
        self.req_to_blocks[request.request_id] = req_blocks
        self.num_cached_blocks[request.request_id] = num_hit_blocks
        if self._reads_cache(request):
            stats = self.prefix_cache_stats
            stats.num_requests += 1
            stats.num_query_tokens += request.num_tokens
            stats.num_hit_tokens += num_hit_blocks * self.block_size
        return req_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Caches the request's blocks that its first `num_tokens` tokens fill.

        Called at allocation, before the step computes them: a request admitted later in the
        same step may hit them, which is safe because a step writes every request's new KV in
        a layer before any attention reads it, and the hit request does not recompute them.
        """
        if not self.enable_caching:
            return
        num_full_blocks = num_tokens // self.block_size
        start = self.num_cached_blocks[request.request_id]
        if num_full_blocks <= start:
            return
        self._update_block_hashes(request)
        block_hashes = request.block_hashes[start:num_full_blocks]
        for group_id, group_blocks in enumerate(self.req_to_blocks[request.request_id]):
            blocks = group_blocks[start:num_full_blocks]
            self.block_pool.cache_full_blocks(blocks, block_hashes, group_id)
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def _update_block_hashes(self, request: Request) -> None:
        """Extends `request.block_hashes` over every full block of its tokens."""
        block_hashes, token_ids, size = request.block_hashes, request.all_token_ids, self.block_size
        for start in range(len(block_hashes) * size, len(token_ids) - size + 1, size):
            tokens = token_ids[start : start + size]
            if block_hashes:
                block_hashes.append(hash_block_tokens(block_hashes[-1], tokens))
            else:
                lora = request.lora_request
                lora_name = None if lora is None else lora.lora_name
                block_hashes.append(hash_block_tokens(None, tokens, request.cache_salt, lora_name))

    def free(self, request: Request) -> None:
        """Returns the request's blocks; cached ones stay findable until evicted.

        Tail blocks are freed first so they are evicted first: a later request is likelier to
        share a prompt's leading blocks than its last ones.
        """
        self.num_cached_blocks.pop(request.request_id, None)
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        for group_blocks in req_blocks or ():
            self.block_pool.free_blocks(reversed(group_blocks))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.req_to_blocks.get(request_id) or self._empty()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table, one list of block ids per group."""
        return tuple([block.block_id for block in group] for group in self.get_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached blocks; False (and no change) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()
