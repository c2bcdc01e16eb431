"""Speculative tokens in the pure-Python core: the scheduler gives a sequence one chunk of its last
token plus its proposal (cut to the token budget, dropped when KV is short), ``accept`` rolls the
rejected tokens back (blocks past the kept tokens released, ``num_computed_tokens`` rewound, no
prefix-cache entry holding a rejected token) and ``BlockManager.rollback`` never writes into a
block the prefix cache holds. Exact block ids, as the other core tests. No torch."""

from __future__ import annotations

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager, hash_block
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence


def make(num_blocks=16, block_size=4, max_num_batched_tokens=64, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, 8, max_num_batched_tokens, max_model_len=1024)


def decoding(sched: Scheduler, prompt: list[int], first: int = 50) -> Sequence:
    """A sequence past its prefill: ``prompt`` computed, ``first`` sampled (uncomputed)."""
    seq = Sequence(prompt, SamplingParams())
    sched.add(seq)
    out = sched.schedule()
    sched.update(out, [first])
    return seq


def cached_keys(bm: BlockManager) -> dict[int, tuple]:
    """block id -> the tokens its prefix-cache entry says it holds."""
    return {b: bm._block_key[b][1] for b in bm._cached.values()}


def test_a_proposal_rides_with_the_last_token_and_rejections_roll_back():
    sched = make()
    seq = decoding(sched, [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed, blocks [0, 1]
    seq.spec_token_ids = [60, 61, 62, 63]
    out = sched.schedule()
    assert out.num_new_tokens == [5]
    chunk = out.model_input()[0].chunks[0]
    assert (chunk.token_ids, chunk.start_pos, chunk.num_logits) == ([50, 60, 61, 62, 63], 6, 5)
    assert seq.block_table == [0, 1, 2]  # positions 6..10 need a third block
    sched.update(out, [[60, 61, 99]])  # kept 60, 61; the model's own token 99 after them
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 50, 60, 61, 99]
    assert (seq.num_computed_tokens, seq.spec_token_ids) == (9, [])
    assert seq.block_table == [0, 1, 2]  # 9 computed tokens still span three blocks
    # blocks 0 and 1 are full and hold only kept tokens; block 2 is partial: not cached
    assert cached_keys(sched.block_manager) == {0: (1, 2, 3, 4), 1: (5, 6, 50, 60)}


def test_a_rejection_at_the_first_token_frees_the_blocks_past_the_kept_ones():
    sched = make()
    seq = decoding(sched, [1, 2, 3, 4, 5, 6, 7])  # 8 tokens: blocks [0, 1], 7 computed
    seq.spec_token_ids = [60, 61, 62, 63, 64, 65]
    out = sched.schedule()
    assert seq.block_table == [0, 1, 2, 3]  # positions 7..13
    free_before = sched.block_manager.num_free_blocks
    sched.update(out, [[77]])  # nothing kept
    assert seq.token_ids[-2:] == [50, 77] and seq.num_computed_tokens == 8
    assert seq.block_table == [0, 1]  # blocks 2 and 3 held only rejected tokens
    assert sched.block_manager.num_free_blocks == free_before + 2
    # block 1 (positions 4..7) is full of kept tokens: registered; nothing else
    assert cached_keys(sched.block_manager) == {0: (1, 2, 3, 4), 1: (5, 6, 7, 50)}
    assert len(seq.block_hashes) == 2


def test_accept_checks_the_kept_tokens_against_the_proposal():
    sched = make()
    seq = decoding(sched, [1, 2, 3])
    seq.spec_token_ids = [60, 61]
    out = sched.schedule()
    with pytest.raises(ValueError, match="prefix of its speculative tokens"):
        sched.update(out, [[60, 62, 5]])
    with pytest.raises(ValueError, match="pass the accepted list"):
        sched.update(out, [7])


def test_the_token_budget_cuts_the_proposal_and_the_kv_drops_it():
    sched = make(max_num_batched_tokens=3)
    seq = decoding(sched, [1, 2])
    seq.spec_token_ids = [60, 61, 62, 63]
    out = sched.schedule()
    assert out.num_new_tokens == [3] and seq.spec_token_ids == [60, 61]
    sched.update(out, [[60, 61, 9]])
    # KV short: 5 blocks of 4 tokens, the sequence holds 2; 6 proposed tokens would need 3 more
    sched = make(num_blocks=3, block_size=4)
    seq = decoding(sched, [1, 2, 3, 4, 5, 6])  # 7 tokens: blocks [0, 1]
    seq.spec_token_ids = [60, 61, 62, 63, 64, 65]  # positions 6..12 need blocks 2 and 3
    out = sched.schedule()
    assert out.num_new_tokens == [1] and seq.spec_token_ids == [] and not out.preempted
    assert out.model_input()[0].chunks[0].num_logits == 1
    sched.update(out, [8])


def test_a_preempted_sequence_loses_its_proposal():
    sched = make(num_blocks=4, block_size=4)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams())
    b = Sequence([11, 12, 13, 14, 15, 16, 17, 18], SamplingParams())
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), [50, 51])  # 2 blocks each: the pool is full
    b.spec_token_ids = [60, 61]
    a.spec_token_ids = [70]  # a's proposal would need a fourth block of its own: dropped
    out = sched.schedule()  # a's 9th token needs a block: b (newest) is preempted
    assert out.preempted == [b] and b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert out.seqs == [a] and out.num_new_tokens == [1] and a.spec_token_ids == []


def test_rollback_never_writes_into_a_cached_block():
    bm = BlockManager(8, 4)
    seq = Sequence(list(range(10, 20)), SamplingParams())  # 10 tokens
    assert bm.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    bm.cache_full_blocks(seq)  # blocks 0, 1 registered; block 2 partial
    assert seq.block_table == [0, 1, 2] and len(seq.block_hashes) == 2
    # a rollback inside the registered block 1: it is released (it stays cached) and its
    # first tokens are to be recomputed into a block of the sequence's own
    assert bm.rollback(seq, 6) == 4
    assert seq.block_table == [0] and len(seq.block_hashes) == 1
    assert 1 in cached_keys(bm) and bm.ref_counts[1] == 0
    assert bm.rollback(seq, 4) == 4 and seq.block_table == [0]  # a block edge: nothing moves
    # an unregistered partial block is the sequence's own: kept
    other = Sequence([1, 2, 3, 4, 5, 6], SamplingParams())
    assert bm.allocate_slots(other, 6)
    table = list(other.block_table)
    assert bm.rollback(other, 5) == 5 and other.block_table == table
    assert bm.rollback(other, 0) == 0 and other.block_table == []
    with pytest.raises(ValueError, match="num_tokens=-1"):
        bm.rollback(other, -1)


def test_scheduler_rollback_cuts_tokens_and_kv():
    sched = make()
    seq = decoding(sched, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 10 tokens, 9 computed: blocks 0..2
    sched.rollback(seq, 9)  # drop the uncomputed token: KV unchanged
    assert (len(seq), seq.num_computed_tokens, seq.block_table) == (9, 9, [0, 1, 2])
    sched.rollback(seq, 9, num_computed=8)  # the last token to be computed again
    assert (len(seq), seq.num_computed_tokens) == (9, 8) and seq.block_table == [0, 1]
    with pytest.raises(ValueError, match=r"must be in \[9, 9\]"):
        sched.rollback(seq, 5)


def test_chained_hashes_of_kept_blocks_match_a_fresh_sequence():
    """The hashes a sequence registers after rejections are the ones the same tokens get from
    scratch, so a later request with those tokens hits the cache."""
    sched = make()
    seq = decoding(sched, [1, 2, 3])
    for proposal, kept in (([4, 5, 9], [4, 5, 6]), ([7, 8, 9, 9, 9], [7, 8, 1])):
        seq.spec_token_ids = proposal
        sched.update(sched.schedule(), [kept])
    fresh, parent = [], None
    for i in range(len(seq.block_hashes)):
        parent = hash_block(parent, tuple(seq.token_ids[4 * i : 4 * i + 4]))
        fresh.append(parent)
    assert seq.block_hashes == fresh and len(fresh) == seq.num_computed_tokens // 4
