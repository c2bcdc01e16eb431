"""LoRA identity in the pure-Python core: the prefix cache keys every block with its sequence's
adapter (KV computed under one adapter never serves another, nor the base model), and the
scheduler runs at most ``max_loras`` distinct adapters at once, letting later sequences of running
adapters pass one that must wait. No torch."""

from __future__ import annotations

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence

SQL_V1, SQL_V2, CHAT = "sql@aaaa", "sql@bbbb", "chat@cccc"  # a reload of sql is a new key


def seq_of(tokens, lora=None, arrival=None) -> Sequence:
    s = Sequence(list(tokens), SamplingParams(max_tokens=4), arrival=arrival)
    s.lora_key = lora
    return s


def cached(bm: BlockManager, seq: Sequence) -> Sequence:
    assert bm.allocate_slots(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return seq


def test_prefix_cache_is_keyed_by_adapter():
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(10, 23))  # 3 full blocks
    first = cached(bm, seq_of(tokens, SQL_V1))
    assert bm.get_computed_blocks(seq_of(tokens, SQL_V1)) == (first.block_table[:3], 12)
    for other in (SQL_V2, CHAT, None):  # another adapter, a reloaded one, the base model
        assert bm.get_computed_blocks(seq_of(tokens, other)) == ([], 0), other
    base = cached(bm, seq_of(tokens, None))
    assert set(base.block_table).isdisjoint(first.block_table)
    assert bm.get_computed_blocks(seq_of(tokens, None)) == (base.block_table[:3], 12)
    assert bm.get_computed_blocks(seq_of(tokens, SQL_V1)) == (first.block_table[:3], 12)
    # a fork keeps its adapter (beam search): its blocks' hashes chain from the same key
    child = first.fork()
    assert child.lora_key == SQL_V1


def test_scheduler_caps_distinct_adapters_running():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                      max_loras=2)  # fmt: skip
    seqs = [seq_of([5, 6, 7], lora, arrival=i)
            for i, lora in enumerate([SQL_V1, CHAT, SQL_V2, None, CHAT, SQL_V2])]  # fmt: skip
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    running = [s.lora_key for s in out.seqs]
    # SQL_V2 waits (two adapters run); base rows and rows of running adapters pass it
    assert running == [SQL_V1, CHAT, None, CHAT]
    assert len({k for k in running if k is not None}) == 2
    assert [s.lora_key for s in sched.waiting] == [SQL_V2, SQL_V2]
    for s in list(sched.running):
        if s.lora_key == SQL_V1:
            sched.finish(s, "stop")
    out = sched.schedule()
    admitted = [s for s in out.seqs if s.lora_key == SQL_V2]
    assert len(admitted) == 2 and not sched.waiting  # the slot freed: both run now


def test_no_cap_without_adapters():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    for i in range(5):
        sched.add(seq_of([5, 6, 7], None, arrival=i))
    assert len(sched.schedule().seqs) == 5
