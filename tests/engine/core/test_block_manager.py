"""BlockManager: exact block ids, ref counts, prefix-cache hits, eviction order. No torch
(``tests/test_package_layout.py`` checks that ``engine/core`` imports none)."""

from __future__ import annotations

import copy

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core import block_manager as bm_mod
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.sequence import Sequence


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def computed(seq: Sequence, bm: BlockManager, num_tokens: int | None = None) -> Sequence:
    """Mark ``seq``'s tokens computed (a finished forward pass) and register its full blocks."""
    seq.num_computed_tokens = len(seq) if num_tokens is None else num_tokens
    bm.cache_full_blocks(seq)
    return seq


def state(bm: BlockManager):
    return copy.deepcopy(
        (bm.ref_counts, bm._free_ids, bm._evictable, bm._cached, bm._block_hash, bm._block_key)
    )


def test_allocate_hands_out_lowest_ids_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq_of(range(10)), seq_of(range(100, 105))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    # growing within the last block takes nothing; crossing into a new block takes block 5
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2, 5]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 1, 0, 0]


def test_shared_prefix_gets_same_blocks_with_ref_two():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq_of(range(10))
    assert bm.allocate_slots(a, 10)
    computed(a, bm)
    assert len(a.block_hashes) == 2  # blocks 0 and 1 are full; block 2 holds 2 tokens
    assert (bm.num_prefix_queries_tokens, bm.num_prefix_hit_tokens) == (0, 0)

    b = seq_of([*range(8), 99, 98, 97])
    ids, n = bm.get_computed_blocks(b)
    assert (ids, n) == ([0, 1], 8)
    assert bm.ref_counts[:2] == [1, 1]  # lookup takes no reference
    assert bm.allocate_slots(b, len(b) - n, ids)
    assert b.block_table == [0, 1, 3]
    assert b.block_hashes == a.block_hashes
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    assert (bm.num_prefix_queries_tokens, bm.num_prefix_hit_tokens) == (11, 8)

    bm.free(a)
    assert a.block_table == [] and a.block_hashes == []
    assert bm.ref_counts[:4] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.ref_counts == [0] * 10
    assert bm.num_free_blocks == 10
    # cached blocks are evictable (b freed tail first: 1 before 0); unregistered ones are free
    assert list(bm._evictable) == [1, 0]
    assert list(bm._free_ids) == [4, 5, 6, 7, 8, 9, 2, 3]

    bm.reset_stats()
    assert (bm.num_prefix_queries_tokens, bm.num_prefix_hit_tokens) == (0, 0)
    assert bm.prefix_cache_hit_rate == 0.0


def test_reset_prefix_cache_drops_only_unheld_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq_of(range(8)), seq_of([*range(100, 108), 1])
    for s in (a, b):
        assert bm.allocate_slots(s, len(s))
        computed(s, bm)
    bm.free(a)  # a's two cached blocks are unheld; b still holds its own
    assert bm.reset_prefix_cache() == 2
    assert bm.get_computed_blocks(seq_of([*range(8), 5])) == ([], 0)  # a's prefix is gone
    ids, n = bm.get_computed_blocks(seq_of([*range(100, 108), 7]))
    assert n == 8 and ids == b.block_table[:2]  # b's blocks still hit
    assert bm.num_free_blocks == 10 - len(b.block_table)
    bm.free(b)
    assert bm.reset_prefix_cache() == 2 and bm.num_free_blocks == 10


def test_hit_capped_to_leave_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(8))
    assert bm.allocate_slots(a, 8)
    computed(a, bm)
    assert len(a.block_hashes) == 2

    # exactly 2 full blocks of identical tokens: only 1 block is a hit (last token recomputed)
    assert bm.get_computed_blocks(seq_of(range(8))) == ([0], 4)
    assert bm.get_computed_blocks(seq_of(range(9))) == ([0, 1], 8)
    assert bm.get_computed_blocks(seq_of(range(4))) == ([], 0)
    assert bm.get_computed_blocks(seq_of(range(5))) == ([0], 4)
    # a different first block breaks the chain even if the second block's tokens match
    assert bm.get_computed_blocks(seq_of([7, 1, 2, 3, 4, 5, 6, 7, 8])) == ([], 0)


def test_only_full_computed_blocks_are_registered():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(12))
    assert bm.allocate_slots(a, 12)
    computed(a, bm, num_tokens=7)  # a prefill chunk that ended inside block 1
    assert len(a.block_hashes) == 1
    assert bm.get_computed_blocks(seq_of(range(12))) == ([0], 4)
    computed(a, bm, num_tokens=12)
    assert len(a.block_hashes) == 3
    assert bm.get_computed_blocks(seq_of(range(13))) == ([0, 1, 2], 12)


def test_eviction_is_lru_of_freed_and_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq_of([1, 2, 3, 4, 5, 6])
    assert bm.allocate_slots(a, 6)
    computed(a, bm)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    assert bm.num_free_blocks == 6

    b = seq_of([10, 11, 12, 13, 14, 15])
    assert bm.allocate_slots(b, 6)
    assert b.block_table == [3, 4, 5]  # free list before evicting cached blocks
    c = seq_of([20, 21])
    assert bm.allocate_slots(c, 2)
    assert c.block_table == [2]  # a's tail block is evicted first
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 5, 6, 0])) == ([0, 1], 4)

    # re-using block 0 takes it out of the LRU; freed again, it becomes the newest
    d = seq_of([1, 2, 9])
    ids, n = bm.get_computed_blocks(d)
    assert (ids, n) == ([0], 2)
    assert bm.allocate_slots(d, 1, ids)
    assert d.block_table == [0, 1]  # block 1 was evicted: d's new block
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 5, 6, 0])) == ([0], 2)
    bm.free(c)  # block 2 was never registered by c (c not computed): free list
    bm.free(d)
    assert list(bm._evictable) == [0]
    assert list(bm._free_ids) == [2, 1]
    e = seq_of(range(30, 36))
    assert bm.allocate_slots(e, 6)
    assert e.block_table == [2, 1, 0]


def test_eviction_order_across_sequences():
    bm = BlockManager(num_blocks=4, block_size=2)
    x, y = seq_of([1, 1]), seq_of([2, 2])
    assert bm.allocate_slots(x, 2) and bm.allocate_slots(y, 2)
    computed(x, bm)
    computed(y, bm)
    bm.free(y)
    bm.free(x)  # LRU: y's block (1) was freed first, so it is evicted first
    z = seq_of(range(6))
    assert bm.allocate_slots(z, 6)
    assert z.block_table == [2, 3, 1]
    assert bm.get_computed_blocks(seq_of([2, 2, 0])) == ([], 0)
    assert bm.get_computed_blocks(seq_of([1, 1, 0])) == ([0], 2)


def test_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    x = seq_of([1, 2, 3, 4, 5])
    assert bm.allocate_slots(x, 5)
    computed(x, bm)
    bm.free(x)  # blocks 0, 1 cached (evictable), block 2 free
    assert list(bm._evictable) == [1, 0] and list(bm._free_ids) == [3, 2]

    b = seq_of([1, 2, 7, 7, 7, 7, 7, 7, 7, 7])
    ids, n = bm.get_computed_blocks(b)
    assert (ids, n) == ([0], 2)
    before, table = state(bm), list(b.block_table)
    # 4 obtainable blocks, but block 0 is one of them once b takes it: 3 new ones at most
    assert not bm.allocate_slots(b, 8, ids)
    assert state(bm) == before and b.block_table == table and b.block_hashes == []
    assert bm.allocate_slots(b, 6, ids)
    assert b.block_table == [0, 3, 2, 1]
    assert bm.num_free_blocks == 0
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 0])) == ([0], 2)  # block 1 evicted

    # a running sequence that cannot grow keeps its blocks
    before = state(bm)
    b.num_computed_tokens = 8
    assert not bm.allocate_slots(b, 1)
    assert state(bm) == before and b.block_table == [0, 3, 2, 1]


def test_computed_blocks_need_an_empty_block_table():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq_of([1, 2, 3])
    assert bm.allocate_slots(a, 3)
    computed(a, bm)
    with pytest.raises(ValueError, match="computed_blocks"):
        bm.allocate_slots(a, 1, [0])


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_hash_collision_is_a_miss(monkeypatch):
    # every block hashes to the same value: only exact (parent, tokens) matches may hit
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq_of([1, 2, 3])
    assert bm.allocate_slots(a, 3)
    computed(a, bm)
    assert bm._cached == {42: 0}

    assert bm.get_computed_blocks(seq_of([9, 9, 3])) == ([], 0)
    assert bm.get_computed_blocks(seq_of([1, 2, 3])) == ([0], 2)
    # a colliding block stays unregistered and goes to the free list, not the LRU, when freed
    b = seq_of([9, 9, 3])
    assert bm.allocate_slots(b, 3)
    computed(b, bm)
    assert b.block_hashes == [42] and bm._cached == {42: 0}
    bm.free(b)
    assert b.block_table == [] and 2 in bm._free_ids and 2 not in bm._evictable


def test_parent_hash_collision_is_a_miss(monkeypatch):
    # the hash ignores the parent: a block's key must still match its own parent's hash
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens: hash(tokens))
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq_of([1, 1, 5, 5, 0])
    c = seq_of([9, 9, 0])
    for s in (a, c):
        assert bm.allocate_slots(s, len(s))
        computed(s, bm)
    assert a.block_table == [0, 1, 2] and c.block_table == [3, 4]
    # block 0 of [9, 9, 5, 5, ...] is c's block 3; block 1 hashes like a's block 1 but its
    # parent differs, so it is a miss
    assert bm.get_computed_blocks(seq_of([9, 9, 5, 5, 0])) == ([3], 2)
    assert bm.get_computed_blocks(seq_of([1, 1, 5, 5, 0])) == ([0, 1], 4)


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = seq_of([1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    computed(a, bm)
    assert a.block_hashes == [] and bm._cached == {}
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 5])) == ([], 0)
    assert (bm.num_prefix_queries_tokens, bm.num_prefix_hit_tokens) == (0, 0)
    bm.free(a)  # reverse order onto the free list
    assert bm.num_free_blocks == 4
    b = seq_of(range(8))
    assert bm.allocate_slots(b, 8)
    assert b.block_table == [3, 2, 1, 0]


def test_all_freed_restores_the_pool():
    bm = BlockManager(num_blocks=7, block_size=3)
    seqs = [seq_of([1, 2, 3, 4, 5, 6, 7]), seq_of([1, 2, 3, 4, 5, 6, 8]), seq_of([1, 2, 3, 9])]
    for s in seqs:
        ids, n = bm.get_computed_blocks(s)
        assert bm.allocate_slots(s, len(s) - n, ids)
        computed(s, bm)
    assert [s.block_table for s in seqs] == [[0, 1, 2], [0, 1, 3], [0, 4]]
    assert bm.ref_counts == [3, 2, 1, 1, 1, 0, 0]
    assert bm.num_free_blocks == 2
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 7 and bm.ref_counts == [0] * 7
    assert sorted([*bm._free_ids, *bm._evictable]) == list(range(7))
