"""KVCacheManager: the block-hash chain, prefix hits, allocation, freeing and KV cache groups."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from tests.core.fake_worker import make_kv_cache_config, make_request
from v1engine.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from v1engine.kv_cache_interface import KVCacheConfig

BLOCK_SIZE = 4


def _manager(num_blocks: int = 16, num_groups: int = 1, enable_caching: bool = True):
    config = make_kv_cache_config(num_blocks, BLOCK_SIZE, num_groups)
    return KVCacheManager(config, max_model_len=64, enable_caching=enable_caching)


def _prefill(
    manager: KVCacheManager, request_id: str, prompt: list[int], cache_salt=None, lora=None
):
    """Admits a request the way the scheduler does and computes its whole prompt."""
    request = make_request(request_id, prompt, cache_salt=cache_salt, lora_request=lora)
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return request, num_hit_tokens


def test_hash_chain_covers_full_blocks_only() -> None:
    manager = _manager()
    request = make_request("a", list(range(10)))
    manager.get_computed_blocks(request)
    assert len(request.block_hashes) == 2  # tokens 8 and 9 fill no block
    h0 = hashlib.sha256(msgspec.msgpack.encode((None, [0, 1, 2, 3]))).digest()
    assert request.block_hashes[0] == h0 == hash_block_tokens(None, [0, 1, 2, 3])
    assert request.block_hashes[1] == hash_block_tokens(h0, [4, 5, 6, 7])
    # The same tokens after a different prefix are a different block.
    other = make_request("b", [9, 9, 9, 9, 4, 5, 6, 7, 0])
    manager.get_computed_blocks(other)
    assert other.block_hashes[1] != request.block_hashes[1]
    request.append_output_token_ids([10, 11])  # outputs complete block 2
    manager.get_computed_blocks(request)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [8, 9, 10, 11])


def test_shared_prefix_of_several_blocks_is_a_hit() -> None:
    manager = _manager()
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    first, num_hit_tokens = _prefill(manager, "a", prompt)
    assert num_hit_tokens == 0
    second = make_request("b", prompt[:10] + [7, 7, 7])  # shares blocks 0 and 1 only
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8
    assert [b.block_id for b in hits[0]] == manager.get_block_ids("a")[0][:2]
    new_blocks = manager.allocate_slots(second, second.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None and len(new_blocks[0]) == 2  # 13 tokens: 4 blocks, 2 shared
    shared = manager.get_blocks("b")[0][:2]
    assert shared == manager.get_blocks("a")[0][:2] and all(b.ref_cnt == 2 for b in shared)
    stats = manager.prefix_cache_stats
    assert (stats.num_requests, stats.num_query_tokens, stats.num_hit_tokens) == (2, 26, 8)
    assert stats.hit_rate == pytest.approx(8 / 26)


def test_a_cache_salt_shares_blocks_only_within_the_salt() -> None:
    manager = _manager()
    prompt = list(range(13))  # 3 full blocks
    salted, _ = _prefill(manager, "a", prompt, cache_salt="tenant-1")
    plain = make_request("p", prompt)
    manager.get_computed_blocks(plain)
    # Every block differs, the first by the salt and the rest by the chain.
    assert not set(salted.block_hashes) & set(plain.block_hashes)
    assert salted.block_hashes[0] == hash_block_tokens(None, prompt[:4], "tenant-1")
    for request_id, salt, expected_hit_tokens in [("b", "tenant-2", 0), ("c", None, 0)]:
        assert _prefill(manager, request_id, prompt, salt)[1] == expected_hit_tokens
    assert _prefill(manager, "d", prompt, "tenant-1")[1] == 12
    assert _prefill(manager, "e", prompt)[1] == 12  # "c" cached the unsalted blocks


@pytest.mark.parametrize(("prompt_len", "expected_hit_tokens"), [(8, 4), (9, 8), (12, 8)])
def test_fully_cached_prompt_still_recomputes_its_last_token(prompt_len, expected_hit_tokens):
    manager = _manager()
    prompt = list(range(prompt_len))
    _prefill(manager, "a", prompt)
    _, num_hit_tokens = _prefill(manager, "b", prompt)
    assert num_hit_tokens == expected_hit_tokens < prompt_len


def test_hits_on_free_cached_blocks_after_the_owner_is_freed() -> None:
    manager = _manager(num_blocks=5)
    first, _ = _prefill(manager, "a", list(range(12)))
    manager.free(first)
    assert manager.usage == 0.0 and manager.block_pool.get_num_free_blocks() == 4
    second, num_hit_tokens = _prefill(manager, "b", list(range(12)))
    assert num_hit_tokens == 8
    # Blocks 0-1 came back from the free queue; block 2 is new (the last token is recomputed).
    assert manager.get_block_ids("b")[0][:2] == [1, 2]
    assert manager.block_pool.get_num_free_blocks() == 1


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    manager = _manager(num_blocks=5)  # 4 usable blocks
    _prefill(manager, "a", list(range(8)))
    request = make_request("b", list(range(8)) + list(range(50, 60)))  # 18 tokens: 5 blocks
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 8
    pool = manager.block_pool

    def snapshot():
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        ref_cnts = [b.ref_cnt for b in pool.blocks]
        hashes = [b.block_hash for b in pool.blocks]
        return free_ids, ref_cnts, hashes, dict(pool.cached_block_hash_to_block)

    before = snapshot()
    stats_before = dict(vars(manager.prefix_cache_stats))
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is None
    assert snapshot() == before and vars(manager.prefix_cache_stats) == stats_before
    assert "b" not in manager.req_to_blocks and manager.get_block_ids("b") == ([],)
    assert not request.num_computed_tokens


def test_free_returns_every_block_tail_first() -> None:
    manager = _manager(num_blocks=8)
    first, _ = _prefill(manager, "a", list(range(10)))  # blocks 1, 2, 3
    second, _ = _prefill(manager, "b", list(range(10)))  # shares 1, 2; owns 4
    assert manager.usage == pytest.approx(4 / 7)
    manager.free(second)
    manager.free(first)
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == 7 and manager.usage == 0.0
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:]) and manager.req_to_blocks == {}
    # The partial (uncached) last blocks first, the most recently freed first: 3, 4; then the
    # never-used blocks; then the cached ones from each request's tail: 2, 1.
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [
        3,
        4,
        5,
        6,
        7,
        2,
        1,
    ]
    manager.free(first)  # freeing twice is harmless: the request holds nothing now


def test_decode_allocates_a_block_only_at_a_boundary_and_caches_it_when_full() -> None:
    manager = _manager()
    request, _ = _prefill(manager, "a", [1, 2, 3, 4, 5, 6])  # 2 blocks, 1 cached
    assert manager.num_cached_blocks["a"] == 1
    request.append_output_token_ids([7])
    assert manager.allocate_slots(request, 1) == ([],)  # token 6 fits block 1
    request.num_computed_tokens += 1
    request.append_output_token_ids([8])
    assert manager.allocate_slots(request, 1) == ([],)  # token 7 fills block 1
    assert manager.num_cached_blocks["a"] == 2
    assert manager.block_pool.get_cached_block(request.block_hashes[1]) is not None
    request.num_computed_tokens += 1
    request.append_output_token_ids([9])
    (new_blocks,) = manager.allocate_slots(request, 1)
    assert len(new_blocks) == 1 and len(manager.get_block_ids("a")[0]) == 3


def test_chunk_caches_only_blocks_whose_tokens_are_known() -> None:
    manager = _manager()
    request = make_request("a", list(range(10)))
    assert manager.allocate_slots(request, 6) is not None  # first chunk: block 0 full
    assert manager.num_cached_blocks["a"] == 1
    request.num_computed_tokens = 6
    assert manager.allocate_slots(request, 4) is not None
    assert manager.num_cached_blocks["a"] == 2 and len(manager.get_block_ids("a")[0]) == 3


def test_every_group_gets_the_same_number_of_blocks_from_one_pool() -> None:
    manager = _manager(num_blocks=13, num_groups=3)  # 12 usable: 4 per group per request
    first, _ = _prefill(manager, "a", list(range(9)))
    ids = manager.get_block_ids("a")
    assert [len(group) for group in ids] == [3, 3, 3]
    assert len({i for group in ids for i in group}) == 9  # distinct block ids
    second, num_hit_tokens = _prefill(manager, "b", list(range(9)))
    assert num_hit_tokens == 8  # 2 hit blocks in every group
    assert [g[:2] for g in manager.get_block_ids("b")] == [g[:2] for g in ids]
    assert manager.block_pool.get_num_free_blocks() == 0
    third = make_request("c", [5])
    assert manager.allocate_slots(third, 1) is None
    manager.free(first)
    manager.free(second)
    assert manager.block_pool.get_num_free_blocks() == 12


def test_a_hit_needs_the_block_in_every_group() -> None:
    manager = _manager(num_blocks=9, num_groups=2)
    first, _ = _prefill(manager, "a", list(range(9)))
    manager.free(first)
    pool = manager.block_pool
    # Free queue: the groups' partial last blocks 6, 3 (empty, reused first), 7, 8 (never used),
    # then the cached blocks, group 0's tail first, then group 1's: taking six blocks evicts
    # every group-0 copy while group 1 keeps its own.
    pool.get_new_blocks(6)
    assert pool.get_cached_block(first.block_hashes[0], group_id=0) is None
    assert pool.get_cached_block(first.block_hashes[0], group_id=1) is not None
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(9))))
    assert num_hit_tokens == 0 and hits == ([], [])


def test_attention_free_model_allocates_trivially() -> None:
    config = KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
    manager = KVCacheManager(config, max_model_len=64)
    request = make_request("a", list(range(30)))
    assert manager.get_computed_blocks(request) == ((), 0)
    assert manager.allocate_slots(request, 30) == ()
    assert manager.get_block_ids("a") == () and manager.usage == 0.0
    manager.free(request)
    assert manager.reset_prefix_cache() is True


def test_caching_disabled_never_hits() -> None:
    manager = _manager(enable_caching=False)
    _prefill(manager, "a", list(range(12)))
    _, num_hit_tokens = _prefill(manager, "b", list(range(12)))
    assert num_hit_tokens == 0 and manager.block_pool.cached_block_hash_to_block == {}
    assert manager.prefix_cache_stats.num_requests == 0


def test_reset_prefix_cache_only_when_idle() -> None:
    manager = _manager()
    first, _ = _prefill(manager, "a", list(range(12)))
    assert manager.reset_prefix_cache() is False
    manager.free(first)
    assert manager.reset_prefix_cache() is True
    _, num_hit_tokens = _prefill(manager, "b", list(range(12)))
    assert num_hit_tokens == 0


def test_bad_configs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        KVCacheManager(make_kv_cache_config(1), max_model_len=8)
    config = make_kv_cache_config(8)
    other = make_kv_cache_config(8, block_size=8)
    mixed = KVCacheConfig(8, [], config.kv_cache_groups + other.kv_cache_groups)
    with pytest.raises(ValueError, match="share one block_size"):
        KVCacheManager(mixed, max_model_len=8)
