"""Scheduling bidirectional ranges (Gemma 3's images): a prefill chunk never ends inside one; it
stops before the range or takes the whole range, past the token budget if it must. No torch."""

from __future__ import annotations

import random

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.scheduler import Scheduler, whole_ranges
from hf_paged.engine.core.sequence import Sequence


def make(budget, num_blocks=64, block_size=4, max_num_seqs=8):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(bm, max_num_seqs, budget, max_model_len=1024)


def seq_of(tokens, ranges=()) -> Sequence:
    seq = Sequence(list(tokens), SamplingParams())
    seq.bidirectional_ranges = list(ranges)
    return seq


def step(sched: Scheduler):
    """One step with a fake model that samples token 0 when a chunk ends its sequence; the
    (sequence, start, num_new) of each chunk."""
    out = sched.schedule()
    chunks = [(s, s.num_computed_tokens, n) for s, n in zip(out.seqs, out.num_new_tokens)]
    sampled = [0 if s.num_computed_tokens + n == len(s) else None for s, _, n in chunks]
    sched.update(out, sampled)
    return chunks


def prefill_chunks(sched: Scheduler, seq: Sequence) -> list[tuple[int, int]]:
    """Run until ``seq``'s prompt is computed: its chunks as (start, end)."""
    got = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        got += [(a, a + n) for s, a, n in step(sched) if s is seq]
    return got


@pytest.mark.parametrize(
    ("budget", "ranges", "want"),
    [
        (8, [(5, 12)], [(0, 5), (5, 13), (13, 20)]),  # stops before the range, then takes it
        (8, [(8, 16)], [(0, 8), (8, 16), (16, 20)]),  # ranges on chunk edges: nothing moves
        (8, [(4, 19)], [(0, 4), (4, 19), (19, 20)]),  # a range longer than the budget: whole
        (8, [(0, 11)], [(0, 11), (11, 19), (19, 20)]),  # ... at the start of the prompt
        (8, [(3, 7), (7, 9), (12, 20)], [(0, 7), (7, 12), (12, 20)]),  # back to back; at end
        (1, [(2, 5), (6, 7)], [(0, 1), (1, 2), (2, 5), (5, 6), (6, 7)] + [(i, i + 1) for i in range(7, 20)]),
        (20, [(2, 18)], [(0, 20)]),  # the whole prompt in one chunk
    ],
)  # fmt: skip
def test_chunks_stop_before_a_range_or_take_it_whole(budget, ranges, want):
    sched = make(budget)
    seq = seq_of(range(20), ranges)
    sched.add(seq)
    assert prefill_chunks(sched, seq) == want


def test_a_range_past_the_budget_goes_beside_decodes():
    """A decoding sequence takes 1 token; the image that starts the next chunk goes whole, and
    the step holds budget - 1 + 10 tokens."""
    sched = make(8)
    a = seq_of(range(100, 104))
    sched.add(a)
    step(sched)  # a's prompt, then it decodes
    b = seq_of(range(12), [(0, 10)])
    sched.add(b)
    assert [(s, n) for s, _, n in step(sched)] == [(a, 1), (b, 10)]
    assert [(s, n) for s, _, n in step(sched)] == [(a, 1), (b, 2)]


def test_a_prefix_hit_inside_a_range_runs_to_its_end():
    """The cached blocks end inside the range (the same ids, ranges and range contents were
    computed whole before): the first chunk takes the rest of the range, however small the
    budget. Other ids inside the range: no block overlapping it is shared."""
    sched = make(1)
    first = seq_of(range(24), [(10, 23)])
    sched.add(first)
    prefill_chunks(sched, first)
    sched.finish(first, "stop")
    again = seq_of(range(24), [(10, 23)])
    sched.add(again)
    assert [(s, a, n) for s, a, n in step(sched)] == [(again, 20, 3)]  # 20 cached, mid-range
    sched.finish(again, "stop")
    other = seq_of([*range(15), 99, *range(16, 24)], [(10, 23)])  # differs inside the range
    sched.add(other)
    assert [(s, a, n) for s, a, n in step(sched)] == [(other, 8, 1)]  # blocks 0-1 only
    unranged = seq_of(range(24))
    sched.finish(other, "stop")
    sched.add(unranged)
    assert [(s, a, n) for s, a, n in step(sched)] == [(unranged, 8, 1)]


def test_model_input_carries_the_ranges_that_hold_a_query():
    sched = make(8)
    seq = seq_of(range(30), [(1, 3), (5, 12), (14, 16), (20, 28)])
    sched.add(seq)
    got = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out = sched.schedule()
        inp, _ = out.model_input()
        got.append((inp.chunks[0].start_pos, inp.chunks[0].bidirectional_ranges))
        sampled = [0 if s.num_computed_tokens + n == len(s) else None
                   for s, n in zip(out.seqs, out.num_new_tokens)]  # fmt: skip
        sched.update(out, sampled)
    assert got == [(0, [(1, 3)]), (5, [(5, 12)]), (13, [(14, 16)]), (20, [(20, 28)]),
                   (28, [])]  # fmt: skip


def test_whole_ranges_edges():
    ranges = [(4, 8), (8, 9), (12, 20)]
    assert whole_ranges(ranges, 0, 4) == 4
    assert whole_ranges(ranges, 0, 5) == 4  # cut before (4, 8)
    assert whole_ranges(ranges, 4, 1) == 4  # starts the range: takes it whole
    assert whole_ranges(ranges, 6, 1) == 2  # starts inside it: runs to its end
    assert whole_ranges(ranges, 8, 3) == 3  # ends between ranges
    assert whole_ranges(ranges, 9, 4) == 3  # would cut (12, 20): stops at 12
    assert whole_ranges(ranges, 20, 4) == 4


@pytest.mark.parametrize("seed", range(8))
def test_random_runs_never_split_a_range(seed):
    """Random prompts, ranges, budgets, KV sizes (with preemption) and prefix hits: every
    chunk ends outside its sequence's ranges, every step stays within budget + the longest
    range - 1, and every sequence finishes."""
    rng = random.Random(seed)
    budget = rng.choice([1, 3, 8, 16])
    sched = make(budget, num_blocks=rng.choice([24, 64]), max_num_seqs=rng.choice([2, 8]))
    seqs, longest = [], 1
    for _ in range(6):
        n = rng.randrange(1, 40)
        ranges, pos = [], 0
        while pos < n - 1 and rng.random() < 0.7:
            a = rng.randrange(pos, n)
            b = rng.randrange(a + 1, min(n, a + 30) + 1)
            ranges.append((a, b))
            longest = max(longest, b - a)
            pos = b + rng.choice([0, 1, 3])
        base = rng.choice([0, 1000])  # shared tokens: prefix hits between sequences
        seq = seq_of(range(base, base + n), ranges)
        seq.sampling_params = SamplingParams(max_tokens=3)
        seqs.append(seq)
        sched.add(seq)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        chunks = step(sched)
        assert sum(n for _, _, n in chunks) <= budget + longest - 1
        for s, a, n in chunks:
            assert not any(x < a + n < y for x, y in s.bidirectional_ranges), (s, a, n)
            if s.num_output_tokens >= 3:
                sched.finish(s, "length")
    assert all(s.is_finished for s in seqs)
