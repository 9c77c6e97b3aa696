"""The pool of KV cache blocks: allocation, reference counts, and the prefix-cache map.

Every block is in exactly one of three states:
- in use: `ref_cnt > 0`, held by one or more requests, not in the free queue;
- free and cached: `ref_cnt == 0`, in the free queue, `block_hash` set and findable through
  `get_cached_block` until it is evicted (handed out again by `get_new_blocks`);
- free and empty: `ref_cnt == 0`, in the free queue, no hash.
Block 0 is the *null block*: reserved, never free, never handed to a request (a placeholder id
for table slots that hold no KV), so `num_blocks - 1` blocks are usable.

The free queue is the allocation order, head first: empty blocks that have held KV (the most
recently freed first), then blocks never handed out (by id), then cached blocks, the least
recently freed first. So a cached block is evicted only when no empty block is left, and an empty
block is reused before a never-used one: on a CPU the cache is an anonymous mapping whose pages
are committed on first write, which cost 1-5 us per 4 KiB page on the bench VM (~140 ms of a
2048-token prefill step), so reusing written blocks keeps those faults to the engine's working
set instead of the whole pool.
"""

from __future__ import annotations

from collections.abc import Iterable

from v1engine.logger import init_logger

logger = init_logger(__name__)

# A cache key: (KV cache group index, hash of the block's tokens and all tokens before them).
BlockHashKey = tuple[int, bytes]


class KVCacheBlock:
    """One block id and its bookkeeping; `prev_free`/`next_free` link the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHashKey | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """A doubly-linked list of free blocks threaded through the blocks themselves.

    A deque cannot remove from the middle in O(1), which `touch` needs when a cached free block is
    reused. Two sentinel blocks (id -1) bound the list so no operation special-cases the ends.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("popleft from an empty FreeKVCacheBlockQueue")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        assert self._tail.prev_free is not None
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (next to evict) to tail; O(n), for tests and debugging."""
        blocks = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free
        return blocks


class BlockPool:
    """All `num_blocks` blocks of the KV cache, shared by every KV cache group."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"BlockPool needs num_blocks >= 1 (block 0 is the reserved null block), "
                f"got {num_blocks}; give the KV cache more memory"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # The null block is never in the free queue, and its ref count never reaches 0.
        self.null_block.ref_cnt = 1
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Blocks are first handed out in id order, so those from this id on have never held KV.
        self._first_unused_id = 1
        self.cached_block_hash_to_block: dict[BlockHashKey, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks a request could get now: empty ones and evictable cached ones."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks held by requests (cached free blocks count as free)."""
        if self.num_usable_blocks == 0:
            return 0.0
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes `num_blocks` blocks from the head of the free queue, evicting cached ones."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            blocks.append(block)
            self._first_unused_id = max(self._first_unused_id, block.block_id + 1)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        # Only the block the map points at is in the map (first writer wins, see cache).
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get((group_id, block_hash))

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[bytes], group_id: int = 0
    ) -> None:
        """Makes full, computed blocks findable by hash; `block_hashes[i]` belongs to `blocks[i]`.

        When an equal block is already cached (two requests computed the same tokens at once),
        the first one stays the cached copy and the newcomer stays a plain block: KV for the
        same token chain is the same, so either serves later hits.
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes)
        for block, block_hash in zip(blocks, block_hashes):
            assert block is not self.null_block
            key = (group_id, block_hash)
            if block.block_hash is not None or key in self.cached_block_hash_to_block:
                continue
            block.block_hash = key
            self.cached_block_hash_to_block[key] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on cache hits; a hit on a free block takes it off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each. Cached blocks reaching 0 join the free queue's tail in this
        order, so the caller passes first the blocks it wants evicted first (a request's tail);
        empty ones join its head, to be reused first."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self.free_block_queue.appendleft(block)
            else:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refused (returns False) while any request holds a block:
        the manager's record of which of that request's blocks are cached would go stale."""
        num_used = self.num_usable_blocks - self.get_num_free_blocks()
        if num_used > 0:
            logger.warning(
                "reset_prefix_cache refused: %d blocks are still held by requests; "
                "retry when no request is running",
                num_used,
            )
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        # Every free block is empty now: those that have held KV move ahead of the never-used
        # ones (in their order), as `free_blocks` would have queued them empty.
        queue = self.free_block_queue
        for block in reversed(queue.get_all_free_blocks()):
            if block.block_id < self._first_unused_id:
                queue.remove(block)
                queue.appendleft(block)
        return True
