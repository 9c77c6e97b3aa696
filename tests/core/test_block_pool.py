"""BlockPool and its free queue: the null block, LRU eviction, reference counts, the cache map."""

from __future__ import annotations

import pytest

from v1engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def _free_ids(pool: BlockPool) -> list[int]:
    return _ids(pool.free_block_queue.get_all_free_blocks())


def test_free_queue_popleft_append_remove_in_o1_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5 and _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])  # from the middle
    queue.remove(blocks[4])  # the tail
    queue.remove(blocks[0])  # the head
    assert _ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.popleft() is blocks[1]
    queue.append(blocks[0])
    queue.append(blocks[4])
    assert _ids(queue.get_all_free_blocks()) == [3, 0, 4] and queue.num_free_blocks == 3
    assert [queue.popleft().block_id for _ in range(3)] == [3, 0, 4]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()


def test_null_block_is_reserved_and_never_handed_out() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.get_num_free_blocks() == 4 and pool.num_usable_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(_ids(blocks)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks + [pool.null_block])  # freeing the null block is a no-op
    assert 0 not in _free_ids(pool) and pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, enable_caching=True)


def test_allocation_takes_the_head_and_cached_frees_join_the_tail() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    assert _ids([a, b, c, d]) == [1, 2, 3, 4]
    pool.cache_full_blocks([a, b, c, d], [b"a", b"b", b"c", b"d"])
    pool.free_blocks([c, a])
    pool.free_blocks([d, b])
    assert _free_ids(pool) == [3, 1, 4, 2]  # least recently freed first
    assert _ids(pool.get_new_blocks(3)) == [3, 1, 4]


def test_empty_blocks_are_reused_before_never_used_and_cached_ones() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_blocks([a], [b"a"])
    pool.free_blocks([a, b, c])  # a cached: the tail; b, c empty: the head, last freed first
    assert _free_ids(pool) == [3, 2, 5, 6, 7, 1]
    assert _ids(pool.get_new_blocks(3)) == [3, 2, 5]  # then never-used blocks, in id order
    assert pool.get_cached_block(b"a") is a


def test_reset_prefix_cache_queues_written_blocks_before_never_used_ones() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"x", b"y", b"z"])
    pool.free_blocks(blocks[::-1])
    assert _free_ids(pool) == [4, 5, 6, 7, 3, 2, 1]
    assert pool.reset_prefix_cache() is True
    assert _free_ids(pool) == [3, 2, 1, 4, 5, 6, 7]
    assert _ids(pool.get_new_blocks(4)) == [3, 2, 1, 4]


def test_ref_counts_keep_shared_blocks_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in _free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and _free_ids(pool)[0] == block.block_id  # empty: reused first
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_cached_block_survives_free_and_touch_takes_it_back() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"])
    pool.free_blocks([b, a])
    assert pool.get_num_free_blocks() == 3 and pool.get_usage() == 0.0
    assert pool.get_cached_block(b"h0") is a and pool.get_cached_block(b"h1") is b
    assert pool.get_cached_block(b"h0", group_id=1) is None  # keys are per group
    pool.touch([a])
    assert a.ref_cnt == 1 and a.block_id not in _free_ids(pool)
    assert pool.get_num_free_blocks() == 2 and pool.get_cached_block(b"h0") is a


def test_eviction_drops_the_hash() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h0"])
    pool.free_blocks([a, b])  # b, empty, is reused first; then a is evicted
    assert pool.get_new_blocks(2) == [b, a] and a.block_hash is None
    assert pool.get_cached_block(b"h0") is None
    assert pool.cached_block_hash_to_block == {}


def test_first_cached_copy_wins_a_duplicate_hash() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"same"])
    pool.cache_full_blocks([b], [b"same"])
    assert pool.get_cached_block(b"same") is a and b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # b (empty), then a, evicted
    assert pool.get_cached_block(b"same") is None


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    a, _ = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [b"h0"])
    assert pool.get_cached_block(b"h0") is None and a.block_hash is None


def test_reset_prefix_cache_is_refused_while_a_block_is_in_use() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [b"h0", b"h1"])
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h0") is a and pool.get_cached_block(b"h1") is b
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h0") is None and a.block_hash is None and b.block_hash is None
    assert pool.get_num_free_blocks() == 3


def test_usage_is_the_fraction_of_usable_blocks_held() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(blocks)
    assert pool.get_usage() == pytest.approx(0.5)
