"""BlockPool and KVCacheManager at the integer level: allocation, refcounts, prefix hashes, forks."""

from __future__ import annotations

import pytest

from libs.engine import SamplingParams
from libs.engine.block_manager import NULL_BLOCK, BlockPool, KVCacheManager
from libs.engine.sequence import Sequence

BS = 4  # tokens per block


def seq(tokens: list[int], adapter_key: bytes = b"") -> Sequence:
    return Sequence("r", tokens, SamplingParams(), request_seed=0, adapter_key=adapter_key)


def computed(kv: KVCacheManager, tokens: list[int], adapter_key: bytes = b"") -> Sequence:
    """A sequence whose tokens are all in the cache (prefix-cache hits used), its blocks published."""
    s = seq(tokens, adapter_key)
    cached = kv.find_cached_prefix(s)
    assert kv.allocate_slots(s, s.num_tokens - len(cached) * BS, cached)
    s.num_computed_tokens = s.num_tokens
    kv.register_computed_blocks(s)
    return s


def hits(kv: KVCacheManager, tokens: list[int], adapter_key: bytes = b"") -> int:
    """How many leading blocks of `tokens` the prefix cache holds."""
    return len(kv.find_cached_prefix(seq(tokens, adapter_key)))


def refcounts(kv: KVCacheManager, s: Sequence) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in s.block_table]


# -- BlockPool ------------------------------------------------------------------------------------


def test_a_pool_reserves_the_null_block():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == pool.num_allocatable_blocks == 4
    assert NULL_BLOCK not in {b.block_id for b in pool.allocate(4)}


def test_a_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_allocate_gives_distinct_blocks_with_one_reference_each():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    assert len({b.block_id for b in blocks}) == 3
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_allocatable_blocks == 2


def test_allocate_returns_none_when_short_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_allocatable_blocks == 1
    assert pool.allocate(1) is not None
    assert pool.allocate(1) is None


def test_a_block_is_free_again_only_when_its_last_reference_goes():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_allocatable_blocks == 1
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_allocatable_blocks == 2


def test_the_first_block_registered_under_a_hash_wins():
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    pool.register(first, b"h")
    pool.register(second, b"h")
    assert pool.lookup(b"h") is first
    assert second.block_hash is None


def test_a_freed_hashed_block_stays_findable_until_reused():
    pool = BlockPool(2)  # one usable block
    (block,) = pool.allocate(1)
    pool.register(block, b"h")
    pool.free([block])
    assert pool.lookup(b"h") is block
    (again,) = pool.allocate(1)
    assert again is block
    assert pool.lookup(b"h") is None and block.block_hash is None


def test_touching_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.register(block, b"h")
    pool.free([block])
    assert pool.num_allocatable_blocks == 2
    pool.touch([block])
    assert pool.num_allocatable_blocks == 1 and block.ref_cnt == 1
    (other,) = pool.allocate(1)
    assert other is not block


def test_unhashed_free_blocks_are_reused_before_hashed_ones():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.register(a, b"a")
    pool.free([a, b, c])  # a keeps a hash; b and c have nothing worth keeping
    assert {x.block_id for x in pool.allocate(2)} == {b.block_id, c.block_id}
    assert pool.lookup(b"a") is a


# -- KVCacheManager: slots ------------------------------------------------------------------------


def test_blocks_for_rounds_up():
    kv = KVCacheManager(10, BS)
    assert [kv.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_slots_adds_blocks_only_when_a_block_fills():
    kv = KVCacheManager(10, BS, watermark=0)
    s = seq(list(range(6)))
    assert kv.allocate_slots(s, 6)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 6
    for _ in range(2):  # tokens 7 and 8 fit the second block
        s.append_token(1)
        assert kv.allocate_slots(s, 1)
        s.num_computed_tokens += 1
    assert len(s.block_table) == 2
    s.append_token(1)
    assert kv.allocate_slots(s, 1)
    assert len(s.block_table) == 3


def test_allocate_slots_refuses_without_changes_when_the_pool_is_short():
    kv = KVCacheManager(4, BS, watermark=0)  # 3 usable blocks
    s = seq(list(range(13)))
    assert not kv.allocate_slots(s, 13)
    assert s.block_table == [] and kv.pool.num_allocatable_blocks == 3
    assert kv.allocate_slots(s, 12)
    assert kv.pool.num_allocatable_blocks == 0


def test_admission_keeps_the_watermark_free():
    kv = KVCacheManager(11, BS, watermark=0.2)  # 10 usable, 2 kept back for running sequences
    assert kv.watermark_blocks == 2
    assert not kv.allocate_slots(seq(list(range(36))), 36, keep_watermark=True)  # 9 blocks
    assert kv.allocate_slots(seq(list(range(32))), 32, keep_watermark=True)  # 8 blocks
    assert not kv.allocate_slots(seq([1]), 1, keep_watermark=True)
    assert kv.allocate_slots(seq([1]), 1)  # a running sequence may use the watermark


def test_free_returns_every_block():
    kv = KVCacheManager(8, BS)
    s = computed(kv, list(range(10)))
    assert kv.pool.num_allocatable_blocks == 4
    kv.free(s)
    assert s.block_table == [] and kv.pool.num_allocatable_blocks == 7


def test_usage_counts_blocks():
    kv = KVCacheManager(9, BS)
    s = computed(kv, list(range(9)))  # 3 blocks, 2 of them full and published
    usage = kv.usage()
    assert (usage.num_blocks, usage.num_used_blocks, usage.num_free_blocks) == (8, 3, 5)
    assert usage.num_cached_blocks == 0  # the published blocks are in use, not reusable KV
    assert usage.usage == 3 / 8
    kv.free(s)  # the 2 published blocks stay findable: cached, not free
    usage = kv.usage()
    assert (usage.num_used_blocks, usage.num_cached_blocks, usage.num_free_blocks) == (0, 2, 6)
    assert usage.num_available_blocks == 8


def test_a_kept_block_is_cached_unless_a_live_sequence_shares_it():
    kv = KVCacheManager(9, BS)
    kept = computed(kv, list(range(9)))  # blocks: 2 full (published), 1 partial
    kv.keep(kept)
    usage = kv.usage()
    assert (usage.num_used_blocks, usage.num_cached_blocks, usage.num_session_blocks) == (0, 3, 3)
    live = computed(kv, [*range(8), 99])  # shares the 2 full blocks
    usage = kv.usage()
    assert (usage.num_used_blocks, usage.num_cached_blocks, usage.num_session_blocks) == (3, 1, 1)
    assert usage.num_used_blocks + usage.num_cached_blocks + usage.num_free_blocks == 8
    kv.unkeep(kept)
    kv.free(kept)
    usage = kv.usage()
    assert (usage.num_used_blocks, usage.num_cached_blocks, usage.num_session_blocks) == (3, 0, 0)
    kv.free(live)
    assert kv.usage().num_cached_blocks == 2


# -- KVCacheManager: prefix cache -----------------------------------------------------------------


def test_a_shared_prefix_is_found_block_by_block():
    kv = KVCacheManager(20, BS)
    computed(kv, list(range(12)))
    assert hits(kv, [*range(8), 99, 98, 97]) == 2
    assert hits(kv, [*range(4), 99, 98, 97, 96, 95]) == 1
    assert hits(kv, [99, *range(1, 12)]) == 0


def test_only_full_blocks_are_published():
    kv = KVCacheManager(20, BS)
    computed(kv, list(range(10)))  # blocks [0..3], [4..7] full, [8, 9] partial
    assert hits(kv, [*range(12), 1]) == 2


def test_the_hash_chains_through_the_parent_blocks():
    kv = KVCacheManager(20, BS)
    computed(kv, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # same second block, different first block: nothing is found, not even the second block
    assert hits(kv, [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_a_lookup_always_leaves_the_last_token_to_compute():
    kv = KVCacheManager(20, BS)
    computed(kv, list(range(12)))
    assert hits(kv, list(range(12))) == 2
    assert hits(kv, list(range(13))) == 3


def test_a_prefix_hit_shares_the_blocks():
    kv = KVCacheManager(20, BS)
    a = computed(kv, list(range(12)))
    b = computed(kv, [*range(8), 50, 51])
    assert b.block_table[:2] == a.block_table[:2]
    assert refcounts(kv, b)[:2] == [2, 2]
    assert b.block_table[2] != a.block_table[2]


def test_a_freed_sequence_prefix_stays_findable():
    kv = KVCacheManager(20, BS)
    kv.free(computed(kv, list(range(12))))
    assert hits(kv, [*range(12), 0]) == 3


def test_reusing_a_cached_block_invalidates_its_prefix():
    kv = KVCacheManager(5, BS, watermark=0)  # 4 usable blocks
    kv.free(computed(kv, list(range(8))))
    assert hits(kv, [*range(8), 0]) == 2
    other = seq([50 + i for i in range(16)])
    assert kv.allocate_slots(other, 16)  # takes every block, the cached two included
    assert hits(kv, [*range(8), 0]) == 0


def test_freeing_keeps_the_head_of_a_prefix_cached_longest():
    kv = KVCacheManager(6, BS, watermark=0)  # 5 usable blocks
    kv.free(computed(kv, list(range(16))))  # four hashed blocks, freed tail first; one never used
    probe = [*range(16), 0]
    assert hits(kv, probe) == 4
    kv.allocate_slots(seq([99]), 1)  # the unhashed block goes first
    assert hits(kv, probe) == 4
    kv.allocate_slots(seq([99]), 1)  # then the last block of the prefix
    assert hits(kv, probe) == 3
    kv.allocate_slots(seq([99]), 1)
    assert hits(kv, probe) == 2


def test_the_adapter_key_separates_prefixes():
    kv = KVCacheManager(20, BS)
    computed(kv, list(range(12)), adapter_key=b"lora:math")
    assert hits(kv, [*range(12), 0]) == 0
    assert hits(kv, [*range(12), 0], adapter_key=b"lora:code") == 0
    assert hits(kv, [*range(12), 0], adapter_key=b"lora:math") == 3


def test_adapter_keys_are_length_prefixed_in_the_hash():
    kv = KVCacheManager(20, BS)
    a = seq([1, 2, 3, 4], adapter_key=b"ab")
    b = seq([1, 2, 3, 4], adapter_key=b"a")
    assert kv._block_hashes(a) != kv._block_hashes(b)


def test_no_prefix_hits_when_prefix_caching_is_off():
    kv = KVCacheManager(20, BS, enable_prefix_caching=False)
    kv.free(computed(kv, list(range(12))))
    assert hits(kv, [*range(12), 0]) == 0
    assert kv.usage().num_cached_blocks == 0


# -- KVCacheManager: forks and copy-on-write ------------------------------------------------------


def _forked(kv: KVCacheManager, tokens: list[int]) -> tuple[Sequence, Sequence]:
    parent = computed(kv, tokens)
    child = parent.fork(1)
    kv.fork(parent, child)
    return parent, child


def test_a_fork_shares_every_block():
    kv = KVCacheManager(20, BS)
    parent, child = _forked(kv, list(range(6)))
    assert child.block_table == parent.block_table
    assert refcounts(kv, parent) == [2, 2]


def test_the_first_write_into_a_shared_partial_block_copies_it():
    kv = KVCacheManager(20, BS)
    parent, child = _forked(kv, list(range(6)))
    shared = parent.block_table[1]
    child.append_token(7)
    assert kv.allocate_slots(child, 1)
    copy = child.block_table[1]
    assert copy != shared and child.block_table[0] == parent.block_table[0]
    assert kv.take_copies() == [(shared, copy)]
    assert kv.take_copies() == []
    assert refcounts(kv, parent) == [2, 1] and refcounts(kv, child) == [2, 1]


def test_the_last_holder_of_a_block_writes_without_copying():
    kv = KVCacheManager(20, BS)
    parent, child = _forked(kv, list(range(6)))
    child.append_token(7)
    kv.allocate_slots(child, 1)
    kv.take_copies()
    parent.append_token(8)
    assert kv.allocate_slots(parent, 1)
    assert kv.take_copies() == []


def test_a_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(20, BS)
    parent, child = _forked(kv, list(range(8)))
    child.append_token(7)
    assert kv.allocate_slots(child, 1)
    assert kv.take_copies() == []
    assert child.block_table[:2] == parent.block_table and len(child.block_table) == 3


def test_a_copy_on_write_needs_a_free_block():
    kv = KVCacheManager(3, BS, watermark=0)  # 2 usable blocks
    parent, child = _forked(kv, list(range(6)))
    child.append_token(7)
    assert not kv.allocate_slots(child, 1)
    assert child.block_table == parent.block_table and kv.take_copies() == []


def test_freeing_a_fork_releases_only_its_references():
    kv = KVCacheManager(20, BS)
    parent, child = _forked(kv, list(range(6)))
    kv.free(child)
    assert refcounts(kv, parent) == [1, 1]
    assert kv.pool.num_allocatable_blocks == 19 - 2


def test_a_pending_copy_into_a_freed_sequence_is_dropped():
    kv = KVCacheManager(20, BS)
    _, child = _forked(kv, list(range(6)))
    child.append_token(7)
    kv.allocate_slots(child, 1)
    kv.free(child)
    assert kv.take_copies() == []
