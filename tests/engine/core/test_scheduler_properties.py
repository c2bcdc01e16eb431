"""Property tests: random adds, steps and aborts on small block pools keep every invariant.

A fake model "writes" each computed token into a fake KV store (block id, slot) -> token, so a
wrong prefix-cache hit, a block shared while being written, or a block reused too early shows up
as a sequence whose KV no longer matches its tokens.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.contracts import SchedulerOutput
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence, SequenceStatus

VOCAB = 3  # tiny vocabulary: prompts and outputs share prefixes, so the prefix cache gets hits


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    max_model_len = draw(st.integers(2, 32))
    # the engine guarantees at start-up that one longest sequence fits in the pool
    num_blocks = -(-max_model_len // block_size) + draw(st.sampled_from([0, 0, 1, 2, 5]))
    config = dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 16)),
        caching=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    base = draw(st.lists(st.integers(0, VOCAB - 1), min_size=max_model_len, max_size=max_model_len))
    request = st.tuples(
        st.integers(0, max_model_len - 1),  # prompt length taken from the shared base ...
        st.lists(st.integers(0, VOCAB - 1), max_size=6),  # ... then its own tail
        st.one_of(st.just(max_model_len), st.integers(1, max_model_len)),  # stop length
    )
    op = st.one_of(
        st.tuples(st.just("add"), request),
        st.tuples(st.just("step"), st.none()),
        st.tuples(st.just("abort"), st.integers(0, 100)),
    )
    first = draw(st.lists(st.tuples(st.just("add"), request), min_size=1, max_size=6))
    ops = first + draw(st.lists(op, min_size=4, max_size=40))
    return config, base, ops


class Harness:
    def __init__(self, config):
        self.cfg = config
        self.bm = BlockManager(
            config["num_blocks"], config["block_size"], enable_prefix_caching=config["caching"]
        )
        self.sched = Scheduler(
            self.bm,
            config["max_num_seqs"],
            config["max_num_batched_tokens"],
            config["max_model_len"],
        )
        self.rng = random.Random(config["seed"])
        self.seqs: list[Sequence] = []
        self.stop_len: dict[int, int] = {}
        self.num_finishes: Counter[int] = Counter()
        self.kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token whose KV is there

    def add(self, base, prompt_len, tail, stop_len):
        tokens = (base[:prompt_len] + tail)[: self.cfg["max_model_len"] - 1] or [0]
        seq = Sequence(tokens, SamplingParams(max_tokens=1))
        self.seqs.append(seq)
        self.stop_len[seq.seq_id] = min(max(stop_len, len(tokens) + 1), self.cfg["max_model_len"])
        self.sched.add(seq)

    def finish(self, seq, reason):
        self.num_finishes[seq.seq_id] += 1
        self.sched.finish(seq, reason)

    def abort(self, k):
        live = [s for s in self.seqs if not s.is_finished]
        if live:
            self.finish(live[k % len(live)], "abort")

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_output(out)
        sampled = []
        bs = self.bm.block_size
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[(seq.block_table[pos // bs], pos % bs)] = seq.token_ids[pos]
            ends = seq.num_computed_tokens + n == len(seq)
            sampled.append(self.rng.randrange(VOCAB) if ends else None)
        self.sched.update(out, sampled)
        for seq, token in zip(out.seqs, sampled, strict=True):
            if token is not None and len(seq) >= self.stop_len[seq.seq_id]:
                self.finish(seq, "length")
        self.check_state()
        return out

    def check_output(self, out: SchedulerOutput):
        cfg, bs = self.cfg, self.bm.block_size
        assert len(out.seqs) == len(out.num_new_tokens)
        assert len(out.seqs) <= cfg["max_num_seqs"]
        assert sum(out.num_new_tokens) <= cfg["max_num_batched_tokens"]
        assert all(n >= 1 for n in out.num_new_tokens)
        assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
        assert not {s.seq_id for s in out.preempted} & {s.seq_id for s in out.seqs}
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            assert seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens + n <= len(seq)
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + n
        if self.sched.has_unfinished():
            assert not out.is_empty  # progress: a pool that fits the longest sequence never stalls

    def check_state(self):
        bm, sched, bs = self.bm, self.sched, self.bm.block_size
        running, waiting = sched.running, list(sched.waiting)
        assert len(running) <= self.cfg["max_num_seqs"]
        assert [s.arrival for s in waiting] == sorted(s.arrival for s in waiting)
        ids = [s.seq_id for s in running + waiting]
        assert len(ids) == len(set(ids))
        assert set(ids) == {s.seq_id for s in self.seqs if not s.is_finished}
        # ref counts == holders; free, evictable and referenced blocks partition the pool
        holders = Counter(b for s in running for b in s.block_table)
        assert all(len(set(s.block_table)) == len(s.block_table) for s in running)
        assert bm.ref_counts == [holders[b] for b in range(bm.num_blocks)]
        free, evictable = list(bm._free_ids), list(bm._evictable)
        unreferenced = free + evictable
        assert len(unreferenced) == len(set(unreferenced)) == bm.num_free_blocks
        assert not set(unreferenced) & set(holders)
        assert len(unreferenced) + len(holders) == bm.num_blocks
        assert all(bm._block_hash[b] is not None for b in evictable)
        assert all(bm._block_hash[b] is None for b in free)
        registered = {b: h for b, h in enumerate(bm._block_hash) if h is not None}
        assert registered == {b: h for h, b in bm._cached.items()}
        for s in running:
            assert len(s.block_table) * bs >= s.num_computed_tokens
            assert s.num_computed_tokens <= len(s)
            assert len(s.block_hashes) <= s.num_computed_tokens // bs
            for pos in range(s.num_computed_tokens):  # the KV really holds this seq's tokens
                assert self.kv.get((s.block_table[pos // bs], pos % bs)) == s.token_ids[pos]
        for s in waiting:
            assert s.status == SequenceStatus.WAITING and s.num_computed_tokens == 0
            assert s.block_table == [] and s.block_hashes == []
        for s in self.seqs:
            if s.is_finished:
                assert s.block_table == [] and s.finish_reason in ("length", "abort")


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_operations_keep_invariants(scenario):
    config, base, ops = scenario
    h = Harness(config)
    for kind, arg in ops:
        if kind == "add":
            h.add(base, *arg)
        elif kind == "step":
            h.step()
        else:
            h.abort(arg)
    # drain: bounded, since a pool that fits one longest sequence always lets the oldest advance
    max_steps = 4 * config["max_model_len"] * max(1, len(h.seqs)) ** 2 + 10
    for _ in range(max_steps):
        if not h.sched.has_unfinished():
            break
        h.step()
    assert not h.sched.has_unfinished()
    assert all(h.num_finishes[s.seq_id] == 1 and s.is_finished for s in h.seqs)
    for s in h.seqs:
        if s.finish_reason == "length":
            assert len(s) == h.stop_len[s.seq_id]
    assert h.bm.num_free_blocks == h.bm.num_blocks
    assert h.bm.ref_counts == [0] * h.bm.num_blocks
