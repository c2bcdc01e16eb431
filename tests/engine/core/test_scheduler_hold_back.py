"""Scheduler: a waiting sequence whose prefix a running one is still prefilling waits for it to
reach the prefix cache instead of computing it again. No torch."""

from __future__ import annotations

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence


def make(max_num_batched_tokens=64, caching=True, num_blocks=64, block_size=4):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, 8, max_num_batched_tokens, max_model_len=1024)


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=1))


def step(sched: Scheduler) -> dict[int, int]:
    """One step; a sequence that samples is finished at once (max_tokens=1). Returns
    {seq_id: tokens computed this step}."""
    out = sched.schedule()
    sampled = [0 if s.num_computed_tokens + n == len(s) else None
               for s, n in zip(out.seqs, out.num_new_tokens, strict=True)]  # fmt: skip
    sched.update(out, sampled)
    for s, tok in zip(out.seqs, sampled, strict=True):
        if tok is not None:
            sched.finish(s, "length")
    return {s.seq_id: n for s, n in zip(out.seqs, out.num_new_tokens, strict=True)}


CTX = list(range(100, 112))  # 3 full blocks of 4


def test_sibling_waits_one_step_then_takes_the_whole_shared_prefix():
    sched = make()
    leader, sib = seq_of(CTX + [1, 2]), seq_of(CTX + [3])
    sched.add(leader)
    sched.add(sib)
    assert step(sched) == {leader.seq_id: 14}  # sib held back: its 3 blocks are being computed
    assert sched.num_held_back == 1
    assert step(sched) == {sib.seq_id: 1}  # 12 tokens from the cache
    assert sib.num_cached_tokens == 12
    bm = sched.block_manager
    assert bm.num_prefix_hit_tokens == 12 and bm.num_prefix_queries_tokens == 14 + 13


def test_later_unrelated_sequences_are_admitted_meanwhile():
    sched = make()
    leader, sib, other = seq_of(CTX + [1]), seq_of(CTX + [2]), seq_of([7] * 9)
    for s in (leader, sib, other):
        sched.add(s)
    assert step(sched) == {leader.seq_id: 13, other.seq_id: 9}
    assert step(sched) == {sib.seq_id: 1}


def test_waits_through_a_chunked_prefill_and_no_longer():
    sched = make(max_num_batched_tokens=6)
    leader, sib = seq_of(CTX + [1]), seq_of(CTX + [2])
    sched.add(leader)
    sched.add(sib)
    assert step(sched) == {leader.seq_id: 6}
    assert step(sched) == {leader.seq_id: 6}
    # the 3rd block was registered at the end of step 2: the wait is over
    assert step(sched) == {leader.seq_id: 1, sib.seq_id: 1}
    assert sib.num_cached_tokens == 12


def test_siblings_admitted_in_the_same_step_wait_for_each_other():
    sched = make()
    a, b, c = seq_of(CTX + [1]), seq_of(CTX + [2]), seq_of(CTX + [3])
    for s in (a, b, c):
        sched.add(s)
    assert step(sched) == {a.seq_id: 13}
    assert step(sched) == {b.seq_id: 1, c.seq_id: 1}


def test_no_wait_when_the_leader_stops_prefilling_or_is_gone():
    sched = make()
    leader, sib = seq_of(CTX + [1]), seq_of(CTX + [2])
    sched.add(leader)
    sched.add(sib)
    out = sched.schedule()  # leader running, sib held back
    assert [s.seq_id for s in out.seqs] == [leader.seq_id]
    sched.finish(leader, "abort")  # before update: its blocks were never registered
    assert step(sched) == {sib.seq_id: 13}  # nothing to wait for: computes it all


def test_preempted_leader_no_longer_holds_the_sibling_back():
    sched = make(max_num_batched_tokens=4)
    leader, sib = seq_of(CTX + [1]), seq_of(CTX + [2])
    sched.add(leader)
    sched.add(sib)
    step(sched)
    sched._preempt(leader)  # as the KV-pressure path does
    out = sched.schedule()
    assert leader.seq_id in {s.seq_id for s in out.seqs}  # first by arrival; one block cached


def test_no_wait_without_prefix_caching():
    sched = make(caching=False)
    leader, sib = seq_of(CTX + [1]), seq_of(CTX + [2])
    sched.add(leader)
    sched.add(sib)
    assert step(sched) == {leader.seq_id: 13, sib.seq_id: 13}
    assert sched.num_held_back == 0


def test_no_wait_for_blocks_the_sequence_may_not_take_from_the_cache():
    sched = make()
    leader, sib = seq_of(CTX + [1]), seq_of(CTX + [2])
    sib.max_cached_tokens = 3  # e.g. prompt logprobs wanted from row 3 on: no block reusable
    sched.add(leader)
    sched.add(sib)
    assert step(sched) == {leader.seq_id: 13, sib.seq_id: 13}


def test_no_wait_for_a_prefix_shorter_than_one_block():
    sched = make()
    leader, sib = seq_of([5, 6, 7, 1, 1, 1]), seq_of([5, 6, 7, 2, 2, 2])
    sched.add(leader)
    sched.add(sib)
    assert step(sched) == {leader.seq_id: 6, sib.seq_id: 6}


def test_many_siblings_every_token_once_then_from_the_cache():
    """lm-eval's shape: contexts with several continuations, more than fit in one step."""
    sched = make(max_num_batched_tokens=40, num_blocks=256)
    contexts = [[1000 * c + i for i in range(10)] for c in range(12)]  # 2 full blocks each
    seqs = [seq_of(ctx + [c, j]) for c, ctx in enumerate(contexts) for j in range(3)]
    for s in seqs:
        sched.add(s)
    num_prompt_tokens = sum(len(s) for s in seqs)
    computed = 0
    while sched.has_unfinished():
        computed += sum(step(sched).values())
    # each context's 8 block tokens once; everything else once per sequence
    assert computed == num_prompt_tokens - 8 * 2 * len(contexts)
    assert all(s.num_cached_tokens == (0 if i % 3 == 0 else 8) for i, s in enumerate(seqs))
