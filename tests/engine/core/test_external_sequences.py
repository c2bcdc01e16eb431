"""ExternalSequences on the pure core (no model, no torch): pausing, parking the newest holder,
a provided token resuming a running or a parked sequence, the refusals that change nothing, and
beams forked and dropped with exact block ids and ref counts."""

from __future__ import annotations

import pytest

from hf_paged.config import SamplingParams
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.external_sequences import ExternalSequences
from hf_paged.engine.core.request_state import RequestState, RequestTable
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import SequenceStatus

VOCAB, MAX_LEN = 100, 64


def setup(num_blocks: int = 16):
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=MAX_LEN)
    table = RequestTable(lambda seed: None)
    return bm, sched, table, ExternalSequences(sched, bm, table, VOCAB, MAX_LEN)


def add(table, sched, rid, prompt, beam_search=False):
    req = RequestState.build(rid, None, list(prompt), SamplingParams(), True, (), None)
    req.beam_search = beam_search
    table.add(req)
    for seq in req.seqs:
        sched.add(seq)
    return req


def step_and_pause(sched, ext):
    """One step that computes every scheduled chunk; the sampled ones pause (their logits out)."""
    out = sched.schedule()
    sched.update(out, [None] * len(out.seqs))
    for seq in out.seqs:
        if seq.num_computed_tokens == len(seq):
            ext.pause(seq)
    return out


def test_pause_park_and_resume():
    bm, sched, table, ext = setup()
    a = add(table, sched, "a", range(1, 9)).seqs[0]  # 2 blocks
    b = add(table, sched, "b", range(20, 25)).seqs[0]  # 2 blocks
    step_and_pause(sched, ext)
    assert ext.awaits_token("a") and ext.awaits_token("b") and len(ext) == 2
    assert sched.running == [] and a.block_table and b.block_table
    # the newest holder is parked: its blocks go, it stays paused (status WAITING)
    assert ext.park_newest() and ext.num_parked == 1
    assert b.block_table == [] and b.status == SequenceStatus.WAITING and ext.awaits_token("b")
    assert ext.park_newest() and a.block_table == [] and ext.num_parked == 2
    assert not ext.park_newest()  # none holds blocks any more
    assert bm.num_free_blocks == 16
    # a parked sequence that gets its token is recomputed (waiting), with the token
    seq = ext.take_token("b", 42)
    assert seq is b and b.token_ids[-1] == 42 and not ext.awaits_token("b")
    ext.resume(b)
    assert list(sched.waiting) == [b]


def test_a_running_sequence_resumes_running():
    _, sched, table, ext = setup()
    a = add(table, sched, "a", range(1, 6)).seqs[0]
    step_and_pause(sched, ext)
    ext.resume(ext.take_token("a", 7))
    assert sched.running == [a] and a.token_ids[-1] == 7 and len(ext) == 0


def test_refusals_change_nothing():
    _, sched, table, ext = setup()
    add(table, sched, "a", range(1, 6))
    with pytest.raises(ValueError, match="is not waiting for a token"):
        ext.take_token("a", 3)  # not stepped yet
    step_and_pause(sched, ext)
    with pytest.raises(ValueError, match=r"token_id=100 is not allowed: must be in \[0, 100\)"):
        ext.take_token("a", VOCAB)
    with pytest.raises(ValueError, match="not an open external-sampling request"):
        ext.take_token("nope", 3)
    with pytest.raises(ValueError, match="must start with its prompt"):
        ext.reset_tokens("a", [9, 9, 9])
    assert ext.awaits_token("a") and table.by_id["a"].seqs[0].token_ids == [1, 2, 3, 4, 5]


def test_beams_fork_and_drop():
    bm, sched, table, ext = setup()
    req = add(table, sched, "r", range(1, 7), beam_search=True)  # 6 tokens: blocks 0, 1
    step_and_pause(sched, ext)
    with pytest.raises(ValueError, match="beam search"):
        ext.take_token("r", 1)
    ext.provide_beams(["r"], [[0, 0]], [[11, 12]])  # two beams from the one sequence
    one, two = req.seqs
    assert one.token_ids[-1] == 11 and two.token_ids[-1] == 12
    assert two.block_table == one.block_table == [0, 1] and bm.ref_counts[:2] == [2, 2]
    step_and_pause(sched, ext)  # the shared last block is copied on write
    assert len({tuple(s.block_table) for s in req.seqs}) == 2
    ext.provide_beams(["r"], [[1]], [[13]])  # beam 0 dropped: its references go
    assert req.seqs == [two] and two.token_ids[-2:] == [12, 13] and one.is_finished
    with pytest.raises(ValueError, match="ids must differ"):
        ext.provide_beams(["r", "r"], [[0], [0]], [[1], [1]])
