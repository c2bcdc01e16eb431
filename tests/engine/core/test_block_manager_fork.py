"""Forked sequences (beam search): ``BlockManager.fork`` shares every block, ``allocate_slots``
copies a shared block on write, the scheduler hands the copies to the step. Exact block ids and
ref counts; no torch."""

from __future__ import annotations

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence, SequenceStatus


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def computed(seq: Sequence, bm: BlockManager) -> Sequence:
    """Every token of ``seq`` computed (a finished forward) and its full blocks registered."""
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return seq


def forked(bm: BlockManager, seq: Sequence) -> Sequence:
    child = seq.fork()
    bm.fork(seq, child)
    return child


def test_fork_shares_every_block_and_keeps_progress():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(10))
    assert bm.allocate_slots(a, 10)
    computed(a, bm)
    b = forked(bm, a)
    assert b.seq_id != a.seq_id and b.request_id == a.request_id and b.arrival == a.arrival
    assert (b.token_ids, b.num_prompt_tokens, b.num_computed_tokens) == (a.token_ids, 10, 10)
    assert b.block_table == a.block_table == [0, 1, 2] and b.block_table is not a.block_table
    assert b.block_hashes == a.block_hashes and len(b.block_hashes) == 2
    assert bm.ref_counts == [2, 2, 2, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5  # a fork takes no block
    b.append_token(7)
    assert a.token_ids == list(range(10))  # the fork's tokens are its own
    bm.free(a)
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0, 0, 0]
    bm.free(b)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8


def test_write_into_shared_partial_block_copies_it_and_the_last_holder_writes_in_place():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(10))
    assert bm.allocate_slots(a, 10)
    computed(a, bm)  # blocks [0, 1, 2]; block 2 holds tokens 8, 9
    b, c = forked(bm, a), forked(bm, a)
    assert bm.ref_counts[:3] == [3, 3, 3]
    for s, tok in ((a, 50), (b, 51), (c, 52)):
        s.append_token(tok)
    # b writes token 10 into block 2, shared: it gets block 3 and a copy of block 2
    assert bm.allocate_slots(b, 1)
    assert b.block_table == [0, 1, 3] and bm.ref_counts[:4] == [3, 3, 2, 1]
    assert bm.take_copies() == [(2, 3)] and bm.take_copies() == []
    assert bm.allocate_slots(c, 1)
    assert c.block_table == [0, 1, 4] and bm.ref_counts[:5] == [3, 3, 1, 1, 1]
    # a is the last holder of block 2: it writes there, no copy
    assert bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2] and bm.take_copies() == [(2, 4)]
    assert bm.num_copied_blocks == 2
    # the full prefix blocks stay shared; each beam's tail block is its own
    for s in (a, b, c):
        bm.free(s)
    assert bm.ref_counts == [0] * 8


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(8))
    assert bm.allocate_slots(a, 8)
    computed(a, bm)
    b = forked(bm, a)
    a.append_token(1)
    b.append_token(2)
    assert bm.allocate_slots(b, 1) and bm.allocate_slots(a, 1)
    assert (a.block_table, b.block_table) == ([0, 1, 3], [0, 1, 2])
    assert bm.take_copies() == [] and bm.ref_counts[:4] == [2, 2, 1, 1]


def test_copy_on_write_needs_a_free_block_and_fails_with_nothing_changed():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(range(10))
    assert bm.allocate_slots(a, 10)  # all 3 blocks
    computed(a, bm)
    b = forked(bm, a)
    b.append_token(5)
    before = (list(bm.ref_counts), list(b.block_table), bm.num_free_blocks)
    assert not bm.allocate_slots(b, 1)
    assert (list(bm.ref_counts), list(b.block_table), bm.num_free_blocks) == before
    assert bm.take_copies() == []
    bm.free(a)  # a's reference goes: block 2 is b's alone, so b writes in place
    assert bm.allocate_slots(b, 1) and b.block_table == [0, 1, 2] and bm.take_copies() == []


def test_prefix_cache_stays_right_for_forked_blocks():
    bm = BlockManager(num_blocks=12, block_size=4)
    a = seq_of(range(6))
    assert bm.allocate_slots(a, 6)
    computed(a, bm)  # block 0 registered; block 1 holds tokens 4, 5
    b = forked(bm, a)
    a.token_ids += [60, 61]
    b.token_ids += [70, 71]
    assert bm.allocate_slots(b, 2) and bm.allocate_slots(a, 2)
    assert (a.block_table, b.block_table) == ([0, 1], [0, 2])
    assert bm.take_copies() == [(1, 2)]
    computed(a, bm)
    computed(b, bm)
    assert a.block_hashes[0] == b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    # a fresh sequence with b's tokens finds b's blocks, one with a's finds a's: the copy holds
    # b's tokens under b's hash, not its source's
    assert bm.get_computed_blocks(seq_of([*b.token_ids, 9])) == ([0, 2], 8)
    assert bm.get_computed_blocks(seq_of([*a.token_ids, 9])) == ([0, 1], 8)
    # the shared block is cached once and stays held while either beam holds it
    bm.free(a)
    assert bm.ref_counts[:3] == [1, 0, 1] and list(bm._evictable) == [1]
    bm.free(b)
    assert bm.ref_counts == [0] * 12 and list(bm._evictable) == [1, 2, 0]


def test_scheduler_hands_the_steps_copies_to_the_model_input():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    a = seq_of(range(6))
    sched.add(a)
    out = sched.schedule()
    assert out.blocks_to_copy == []
    sched.update(out, [40])  # a: 7 tokens, 6 computed, blocks [0, 1]
    b = forked(bm, a)
    b.token_ids[-1] = 41  # a different next token: both write position 6 into block 1
    sched.running.append(b)
    out = sched.schedule()
    assert [s.seq_id for s in out.seqs] == [a.seq_id, b.seq_id]
    # a runs first, so a writes into a copy and b, the last holder, in place
    assert out.blocks_to_copy == [(1, 2)] and (a.block_table, b.block_table) == ([0, 2], [0, 1])
    inp, sampled = out.model_input()
    assert inp.blocks_to_copy == [(1, 2)] and len(sampled) == 2
    assert [c.block_table for c in inp.chunks] == [[0, 2], [0, 1]]
    assert bm.take_copies() == []  # the scheduler took them
    sched.update(out, [1, 2])
    assert sched.schedule().blocks_to_copy == []  # nothing shared is written any more
    assert b.status == SequenceStatus.RUNNING


def test_rollback_of_a_fork_lets_go_of_the_shared_block_it_ends_in():
    """Speculative rollback beside forks: a sequence rolled back into a block another one also
    holds must not write into it later, so it releases that block (its tokens there are
    recomputed into a fresh block, no copy); the full shared blocks before it stay shared and
    the other sequence keeps every block."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(range(10))
    assert bm.allocate_slots(a, 10)
    computed(a, bm)  # blocks [0, 1, 2]; block 2 holds tokens 8, 9
    b = forked(bm, a)
    assert bm.rollback(b, 9) == 8  # the new end (token 9) falls in shared block 2
    assert b.block_table == [0, 1] and len(b.block_hashes) == 2
    assert a.block_table == [0, 1, 2] and bm.ref_counts[:3] == [2, 2, 1]
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 2)  # tokens 8 and 9 again, into a block of its own
    assert b.block_table == [0, 1, 3] and bm.take_copies() == []
    assert bm.rollback(b, 6) == 4  # into cached (full, registered) block 1: released too
    assert b.block_table == [0] and bm.ref_counts[:4] == [2, 1, 1, 0]
    for s in (a, b):
        bm.free(s)
    assert bm.ref_counts == [0] * 8
