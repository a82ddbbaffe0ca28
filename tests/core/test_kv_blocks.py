"""KVCacheManager and BlockPool: accounting, prefix-cache hits, the hash chain, LRU eviction."""

from __future__ import annotations

import pytest

from loomllm.core.kv_blocks import KVCacheManager, hash_block_tokens
from loomllm.core.request import Request
from loomllm.protocols.sampling import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8), frozenset({0}), 1024, 0.0)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up, allocate the rest, advance."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def check_accounting(kv: KVCacheManager) -> None:
    pool = kv.block_pool
    holders = [0] * kv.num_total_blocks
    for blocks in kv.req_to_blocks.values():
        for block_id in blocks:
            holders[block_id] += 1
    assert pool.ref_cnt == holders
    assert set(pool.free_block_queue) == {b for b, n in enumerate(holders) if n == 0}
    assert kv.num_free_blocks + sum(1 for n in holders if n) == kv.num_total_blocks


def test_allocate_and_free_accounting() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    request = make_request("a", list(range(1, 10)))  # 9 tokens: 3 blocks
    new_blocks = kv.allocate_slots(request, 9)
    assert new_blocks == [0, 1, 2]
    assert kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    request.num_computed_tokens = 9
    assert kv.allocate_slots(request, 3) == []  # tokens 9..11 still fit in block 2
    request.num_computed_tokens = 12
    assert kv.allocate_slots(request, 1) == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    check_accounting(kv)
    kv.free(request)
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    assert kv.get_block_ids("a") == []
    kv.free(request)  # a second free is a no-op
    check_accounting(kv)


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(1, 13)))
    admit(kv, first)
    second = make_request("b", list(range(50, 60)))  # needs 3 blocks, 1 left
    assert kv.allocate_slots(second, 10) is None
    assert kv.num_free_blocks == 1 and "b" not in kv.req_to_blocks
    check_accounting(kv)


def test_prefix_hits_cover_full_blocks_only_and_never_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: blocks [1..4] [5..8] are full, [9, 10] is not
    a_blocks = admit(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt)) == (a_blocks[:2], 8)
    # Exactly two full blocks: one is reused, the last token must still be computed.
    assert kv.get_computed_blocks(make_request("c", prompt[:8])) == (a_blocks[:1], 4)
    assert kv.get_computed_blocks(make_request("d", prompt[:6] + [99, 99])) == (a_blocks[:1], 4)
    assert kv.get_computed_blocks(make_request("e", [99] + prompt)) == ([], 0)
    assert kv.get_computed_blocks(make_request("f", prompt[:4])) == ([], 0)


def test_shared_blocks_are_ref_counted() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))
    a, b = make_request("a", prompt), make_request("b", prompt + [42])
    a_blocks = admit(kv, a)
    b_blocks = admit(kv, b)
    assert b_blocks[:2] == a_blocks[:2] and set(b_blocks[2:]).isdisjoint(a_blocks)
    assert [kv.block_pool.ref_cnt[x] for x in a_blocks] == [2, 2, 1]
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 21)
    check_accounting(kv)
    kv.free(a)
    assert [kv.block_pool.ref_cnt[x] for x in a_blocks] == [1, 1, 0]
    check_accounting(kv)
    kv.free(b)
    assert kv.num_free_blocks == 16
    check_accounting(kv)


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 10))
    a = make_request("a", prompt)
    a_blocks = admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 8  # free, yet still findable
    b = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == (a_blocks[:2], 8)
    assert kv.allocate_slots(b, 1, hits) == [3]  # the LRU head: a never-used block
    assert kv.num_free_blocks == 5 and a_blocks[2] in kv.block_pool.free_block_queue
    assert not set(hits) & set(kv.block_pool.free_block_queue)
    check_accounting(kv)


def test_hits_in_the_free_queue_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6])  # hits 2 blocks, needs 1 more: 3 of 3
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    assert kv.allocate_slots(b, 3, hits) is None  # 2 more blocks + 2 free hits > 3 free
    assert kv.allocate_slots(b, 2, hits) is not None
    assert kv.num_free_blocks == 0
    check_accounting(kv)


def test_free_queue_is_lru_and_a_freed_sequence_loses_its_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4])
    assert admit(kv, a) == [0, 1]
    kv.free(a)
    assert list(kv.block_pool.free_block_queue) == [2, 3, 1, 0]
    c = make_request("c", [7, 8, 9, 10])
    assert admit(kv, c) == [2, 3]  # never-used blocks first: a's blocks stay cached
    d = make_request("d", [11])
    assert admit(kv, d) == [1]  # then a's tail block, which loses its hash
    assert kv.block_pool.block_hashes[1] is None and kv.block_pool.block_hashes[0] is not None
    assert kv.get_computed_blocks(make_request("e", [1, 2, 3, 4, 5])) == ([0], 2)
    check_accounting(kv)


def test_same_block_after_a_different_prefix_is_not_a_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert kv.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == ([], 0)
    first = hash_block_tokens(b"", [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(b"", [5, 6, 7, 8])
    assert hash_block_tokens(first, [5, 6, 7, 8]) == hash_block_tokens(first, (5, 6, 7, 8))


def test_decode_tokens_that_fill_a_block_make_it_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    assert kv.block_pool.block_hashes[0] is None  # 3 of 4 tokens: not full yet
    a.append_output_token_id(4)
    assert kv.allocate_slots(a, 1) == []  # the step computing token 4 fills block 0
    a.num_computed_tokens = 4
    assert kv.block_pool.block_hashes[0] == hash_block_tokens(b"", [1, 2, 3, 4])
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([0], 4)


def test_equal_content_in_two_blocks_keeps_the_first_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 3])
    a_blocks = admit(kv, a)
    assert kv.allocate_slots(b, 3) is not None  # computed again, no lookup
    b_blocks = kv.get_block_ids("b")
    assert kv.block_pool.block_hashes[b_blocks[0]] is None
    kv.free(b)
    assert kv.allocate_slots(make_request("c", [5, 6, 7, 8, 9, 10, 11, 12]), 8) is not None
    assert kv.get_computed_blocks(make_request("d", [1, 2, 3])) == (a_blocks[:1], 2)
    check_accounting(kv)


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.block_pool.block_hashes == [None] * 8
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hit_rate == 0.0


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    check_accounting(kv)
