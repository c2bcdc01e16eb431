"""State slots of recurrent models in the BlockManager: a sequence gets a slot with its first
blocks and gives it back with its last (finish, preemption, parking); admission fails without
a free slot; a fork gets its own slot and records the state copy; a rollback of a recurrent
sequence drops all its KV (the state cannot be rolled back)."""

from __future__ import annotations

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence
from hf_paged.engine.core.state_slots import StateSlots


def _seq(n: int) -> Sequence:
    return Sequence(list(range(3, 3 + n)), SamplingParams())


def test_state_slots_free_list():
    slots = StateSlots(2)
    a, b = slots.alloc(), slots.alloc()
    assert {a, b} == {1, 2}
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.alloc()
    slots.free(a)
    with pytest.raises(ValueError, match="not in use"):
        slots.free(a)
    assert slots.alloc() == a
    with pytest.raises(ValueError, match="num_slots=0"):
        StateSlots(0)


def test_slot_follows_the_blocks():
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_state_slots=2)
    s1, s2, s3 = _seq(5), _seq(3), _seq(2)
    assert bm.allocate_slots(s1, 5) and s1.state_slot == 1
    assert bm.allocate_slots(s2, 3) and s2.state_slot == 2
    free_blocks = bm.num_free_blocks
    assert not bm.allocate_slots(s3, 2)  # blocks are there, no slot: nothing changes
    assert s3.state_slot == 0 and s3.block_table == [] and bm.num_free_blocks == free_blocks
    s1.num_computed_tokens = 5
    assert bm.allocate_slots(s1, 1) and s1.state_slot == 1  # a running sequence keeps its slot
    bm.free(s1)
    assert s1.state_slot == 0
    assert bm.allocate_slots(s3, 2) and s3.state_slot == 1


def test_prefix_caching_is_refused_with_slots():
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(16, 4, enable_prefix_caching=True, num_state_slots=2)


def test_fork_gets_a_slot_and_records_the_copy():
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_state_slots=3)
    src = _seq(6)
    assert bm.allocate_slots(src, 6)
    src.num_computed_tokens = 6
    dst = src.fork()
    bm.fork(src, dst)
    assert dst.state_slot not in (0, src.state_slot)
    assert bm.take_state_copies() == [(src.state_slot, dst.state_slot)]
    assert bm.take_state_copies() == []


def test_rollback_of_a_recurrent_sequence_recomputes_it_all():
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_state_slots=1)
    seq = _seq(10)
    assert bm.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    assert bm.rollback(seq, 9) == 0
    assert seq.block_table == [] and seq.state_slot == 1  # the slot stays, its state is stale
    assert bm.rollback(seq, 0) == 0


def test_scheduler_preemption_frees_the_slot_and_admission_waits_for_one():
    bm = BlockManager(6, 4, enable_prefix_caching=False, num_state_slots=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=24)
    seqs = [_seq(4), _seq(4), _seq(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == seqs[:2]  # the third waits for a slot, though blocks are free
    assert sorted(s.state_slot for s in seqs[:2]) == [1, 2] and seqs[2].state_slot == 0
    sched.update(out, [7, 7])
    # grow both until the KV runs out: the newest is preempted and its slot freed
    for _ in range(20):
        out = sched.schedule()
        if out.preempted:
            break
        sched.update(out, [7] * len(out.seqs))
    assert out.preempted and out.preempted[0].state_slot == 0
    sched.finish(seqs[0], "stop")
    assert seqs[0].state_slot == 0 and bm.state_slots.num_free >= 1
