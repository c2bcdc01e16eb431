"""Scheduler: budgets, chunked prefill, mixed steps, preemption order, FCFS. No torch."""

from __future__ import annotations

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.contracts import SchedulerOutput
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len=1024)


def seq_of(tokens, arrival=None) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), arrival=arrival)


def step(sched: Scheduler, token: int = 0) -> SchedulerOutput:
    """One engine step with a fake model that samples ``token`` when a chunk ends its sequence."""
    out = sched.schedule()
    sampled = [
        token if s.num_computed_tokens + n == len(s) else None
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True)
    ]
    sched.update(out, sampled)
    return out


def plan(out: SchedulerOutput) -> list[tuple[Sequence, int]]:
    return list(zip(out.seqs, out.num_new_tokens, strict=True))


def test_chunked_prefill_splits_a_long_prompt_exactly():
    sched = make(max_num_batched_tokens=8)
    a = seq_of(range(20))
    sched.add(a)
    assert a.status == SequenceStatus.WAITING
    out = step(sched)
    assert plan(out) == [(a, 8)] and a.status == SequenceStatus.RUNNING
    assert (a.num_computed_tokens, len(a), a.block_table) == (8, 20, [0, 1])
    assert plan(step(sched)) == [(a, 8)]
    assert (a.num_computed_tokens, len(a), a.block_table) == (16, 20, [0, 1, 2, 3])
    assert plan(step(sched, token=7)) == [(a, 4)]  # last chunk: samples
    assert (a.num_computed_tokens, len(a), a.block_table) == (20, 21, [0, 1, 2, 3, 4])
    assert a.output_token_ids == [7]
    assert plan(step(sched)) == [(a, 1)]  # decode: position 20 needs a 6th block
    assert (a.num_computed_tokens, len(a), a.block_table) == (21, 22, [0, 1, 2, 3, 4, 5])
    assert len(a.block_hashes) == 5  # every full computed block registered


def test_decodes_and_a_prefill_chunk_mix_in_one_step():
    sched = make(max_num_batched_tokens=10)
    a, b, c = seq_of(range(4)), seq_of(range(100, 112)), seq_of(range(200, 203))
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [(a, 4), (b, 6)]  # c waits: no token budget left
    assert plan(step(sched)) == [(a, 1), (b, 6), (c, 3)]
    assert plan(step(sched)) == [(a, 1), (b, 1), (c, 1)]
    assert [len(s) for s in (a, b, c)] == [7, 14, 5]


def test_token_and_seq_budgets():
    sched = make(max_num_seqs=2, max_num_batched_tokens=5)
    seqs = [seq_of(range(10 * i, 10 * i + 2)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert plan(out) == [(seqs[0], 2), (seqs[1], 2)]  # seq budget: 2 even with tokens left
    assert list(sched.waiting) == seqs[2:]
    sched.finish(seqs[0], "stop")
    assert plan(step(sched)) == [(seqs[1], 1), (seqs[2], 2)]
    sched.finish(seqs[1], "stop")
    sched.finish(seqs[2], "stop")
    long = seq_of(range(50, 70))
    sched.add(long)
    assert plan(step(sched)) == [(seqs[3], 2), (long, 3)]  # chunk = what the budget leaves


def test_add_keeps_waiting_in_arrival_order():
    # the engine re-adds sequences it preempted itself: they go back to their arrival place,
    # after earlier ones of equal arrival
    sched = make()
    seqs = [seq_of([1], arrival=t) for t in (0, 5, 3, 9, 3)]
    for s in seqs:
        sched.add(s)
    assert list(sched.waiting) == [seqs[i] for i in (0, 2, 4, 1, 3)]


def test_waiting_is_fcfs_without_skipping_ahead():
    sched = make(num_blocks=4, block_size=4)
    a, big, small = seq_of(range(8)), seq_of(range(100, 112)), seq_of([1])
    for s in (a, big, small):
        sched.add(s)
    # big needs 3 blocks, 2 are left: small (1 block) would fit but must not jump the queue
    assert plan(step(sched)) == [(a, 8)]
    assert list(sched.waiting) == [big, small]
    sched.finish(a, "stop")
    assert plan(step(sched)) == [(big, 12), (small, 1)]


def test_prefix_cache_hit_skips_cached_tokens():
    sched = make()
    a = seq_of(range(9))
    sched.add(a)
    step(sched)
    b = seq_of(range(9))
    sched.add(b)
    out = step(sched)
    assert plan(out) == [(a, 1), (b, 1)]
    assert (b.num_cached_tokens, b.num_computed_tokens, len(b)) == (8, 9, 10)
    assert b.block_table[:2] == a.block_table[:2] == [0, 1]
    assert sched.block_manager.ref_counts[:2] == [2, 2]


def test_prefix_cache_off_recomputes():
    sched = make(caching=False)
    a, b = seq_of(range(9)), seq_of(range(9))
    sched.add(a)
    step(sched)
    sched.add(b)
    assert plan(step(sched)) == [(a, 1), (b, 9)]
    assert b.num_cached_tokens == 0 and b.block_table == [3, 4, 5]


def test_preempts_newest_and_puts_it_back_first():
    # 6 blocks of 2 tokens; three 4-token prompts fill them all
    sched = make(num_blocks=6, block_size=2)
    a, b, c = seq_of([1, 2, 3, 4]), seq_of([5, 6, 7, 8]), seq_of([9, 10, 11, 12])
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched, token=50)) == [(a, 4), (b, 4), (c, 4)]
    d = seq_of([13])
    sched.add(d)
    # a and b each need a 3rd block: c (newest) is preempted once, freeing 2 blocks
    out = step(sched, token=51)
    assert plan(out) == [(a, 1), (b, 1)] and out.preempted == [c]
    assert sched.num_preemptions == 1 and c.num_preemptions == 1
    assert list(sched.waiting) == [c, d]  # c back before the newer d
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.block_hashes == []
    assert c.num_computed_tokens == 0 and c.token_ids == [9, 10, 11, 12, 50]  # output kept
    assert sched.running == [a, b]
    assert sched.block_manager.num_free_blocks == 0

    # no room yet for c, and d must not jump ahead of it
    assert plan(step(sched)) == [(a, 1), (b, 1)]
    assert list(sched.waiting) == [c, d]
    sched.finish(a, "stop")
    assert plan(step(sched)) == [(b, 1)]  # b takes a 4th block: 2 left, c needs 3
    assert list(sched.waiting) == [c, d]
    sched.finish(b, "stop")
    out = step(sched, token=52)
    # c recomputes prompt + its output token (its cached blocks were evicted for a and b)
    assert plan(out) == [(c, 5), (d, 1)]
    assert c.token_ids == [9, 10, 11, 12, 50, 52] and c.num_cached_tokens == 0
    assert sched.running == [c, d] and not sched.waiting


def test_preempted_sequence_reuses_its_cached_prefix():
    sched = make(num_blocks=5, block_size=2)
    a, b = seq_of([1, 2, 3, 4]), seq_of([5, 6, 7, 8, 9])
    sched.add(a)
    sched.add(b)
    assert plan(step(sched, token=0)) == [(a, 4), (b, 5)]
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)  # a needs a block: b is preempted; its blocks stay cached (tail first)
    assert out.preempted == [b] and plan(out) == [(a, 1)]
    sched.finish(a, "stop")
    out = step(sched)
    # b = 5 prompt + 1 output; blocks [5,6], [7,8] survived eviction: recompute 2 tokens
    assert plan(out) == [(b, 2)] and b.num_cached_tokens == 4


def test_scheduled_sequences_are_not_preemption_candidates():
    sched = make(num_blocks=4, block_size=2)
    a, b = seq_of([5, 6, 7, 8], arrival=0), seq_of([1, 2, 3], arrival=1)
    sched.add(b)
    sched.add(a)
    assert list(sched.waiting) == [a, b]  # add keeps arrival order
    assert plan(step(sched)) == [(a, 4), (b, 3)]
    # running out of arrival order (the engine re-appends sequences it held for external
    # sampling): when a needs a block, the newer b is already scheduled this step, so a (the
    # newest unscheduled one) preempts itself
    sched.running.reverse()
    out = step(sched)
    assert plan(out) == [(b, 1)] and out.preempted == [a]
    assert sched.running == [b] and list(sched.waiting) == [a]
    later = seq_of([0], arrival=5)
    sched.add(later)
    sched.finish(b, "stop")
    out = step(sched)
    assert plan(out) == [(a, 1), (later, 1)]  # a's 2 blocks came back from the prefix cache
    assert a.num_cached_tokens == 4


def test_the_newest_running_sequence_preempts_itself():
    sched = make(num_blocks=4, block_size=2)
    a, b = seq_of([1, 2, 3]), seq_of([5, 6, 7, 8])
    sched.add(a)
    sched.add(b)
    step(sched)
    out = step(sched)  # b needs a 3rd block, is the newest: preempted, a is untouched
    assert plan(out) == [(a, 1)] and out.preempted == [b]


def test_no_admission_in_a_step_that_preempted():
    # the victim's freed blocks would fit its first 1-token chunk, but it is not re-admitted in
    # the step that preempted it (that would only thrash)
    sched = make(num_blocks=4, block_size=2, max_num_batched_tokens=2, caching=False)
    a, b = seq_of([1]), seq_of([2, 3, 4])
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [(a, 1), (b, 1)]
    for _ in range(3):
        assert plan(step(sched)) == [(a, 1), (b, 1)]
    assert (len(a), len(b), sched.block_manager.num_free_blocks) == (5, 5, 0)
    out = step(sched)
    assert plan(out) == [(a, 1)] and out.preempted == [b]
    assert list(sched.waiting) == [b] and sched.block_manager.num_free_blocks == 1
    assert plan(step(sched)) == [(a, 1), (b, 1)]


def test_preempted_goes_before_newer_waiting_by_arrival():
    sched = make(num_blocks=4, block_size=2, max_num_seqs=2)
    a, b, c = seq_of([1, 2, 3, 4]), seq_of([5, 6, 7, 8]), seq_of([9])
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # a and b run (seq budget 2); c waits
    out = step(sched)
    assert out.preempted == [b]
    assert list(sched.waiting) == [b, c]
    assert [s.arrival for s in sched.waiting] == sorted(s.arrival for s in sched.waiting)


def test_run_to_completion_loses_and_duplicates_nothing():
    sched = make(num_blocks=12, block_size=2, max_num_seqs=4, max_num_batched_tokens=7)
    seqs = [seq_of(range(i, i + 3 + i % 5)) for i in range(10)]
    targets = {s.seq_id: len(s) + 2 + s.seq_id % 4 for s in seqs}
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        out = step(sched)
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        for s in out.seqs:
            if len(s) >= targets[s.seq_id]:
                sched.finish(s, "length")
    assert not sched.has_unfinished()
    assert all(s.is_finished and len(s) == targets[s.seq_id] for s in seqs)
    assert sched.num_preemptions > 0
    assert sched.block_manager.num_free_blocks == 12


def test_finish_removes_from_waiting_or_running():
    sched = make()
    a, b = seq_of(range(5)), seq_of(range(5))
    sched.add(a)
    step(sched)
    sched.add(b)
    sched.finish(b, "abort")
    assert list(sched.waiting) == [] and b.finish_reason == "abort"
    out = sched.schedule()
    sched.finish(a, "abort")  # aborted between schedule and update
    assert sched.running == [] and a.block_table == [] and a.is_finished
    sched.update(out, [9])  # skipped: a keeps its state
    assert a.token_ids == list(range(5)) + [0] and a.num_computed_tokens == 5
    sched.finish(a, "stop")  # already finished: no-op
    assert a.finish_reason == "abort"
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 16

    # a sequence the engine holds outside both queues (external sampling) can be finished too
    c = seq_of(range(3))
    sched.add(c)
    step(sched)
    sched.running.remove(c)
    sched.finish(c, "stop")
    assert c.is_finished and c.block_table == [] and sched.block_manager.num_free_blocks == 16


def test_bad_inputs_raise():
    sched = make()
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq_of(range(1025)))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq_of([]))
    assert not sched.waiting
    a = seq_of(range(100))
    sched.add(a)
    out = sched.schedule()
    assert plan(out) == [(a, 64)]
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.update(out, [])
    with pytest.raises(ValueError, match="before its prefill ended"):
        sched.update(out, [3])
