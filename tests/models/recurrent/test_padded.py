"""The padded view of a step (``padded.py``): rows to ``[N, L]`` and back, and the split of a
mixed step into its prefill chunks and its decodes."""

from __future__ import annotations

import torch

from hf_paged.models.recurrent.padded import PaddedLayout, split_step
from tests.models.recurrent.ssm_cases import make_meta


def test_pack_unpack():
    meta = make_meta([(3, 4, False), (1, 1, True), (2, 2, True)], num_prefills=1)
    x = torch.arange(7.0)[:, None].expand(7, 2)  # row r holds r
    layout = PaddedLayout.build(meta, 7)
    packed = layout.pack(x)
    assert packed[..., 0].tolist() == [[0, 1, 2, 3], [4, 0, 0, 0], [5, 6, 0, 0]]
    assert layout.valid.tolist() == [[True] * 4, [True] + [False] * 3, [True] * 2 + [False] * 2]
    assert torch.equal(layout.unpack(packed), x)


def test_split_step_contiguous():
    """Chunks first, then single tokens: two slices, metas as views."""
    meta = make_meta([(3, 4, False), (5, 2, True), (1, 1, True), (2, 1, True)], num_prefills=2)
    (rows0, pre), (rows1, dec) = split_step(meta)
    assert (rows0, rows1) == (slice(0, 6), slice(6, 8))
    assert pre.cu_seqlens.tolist() == [0, 4, 6] and dec.cu_seqlens.tolist() == [0, 1, 2]
    assert pre.state_indices.tolist() == [3, 5] and dec.state_indices.tolist() == [1, 2]
    assert pre.has_initial_state.tolist() == [False, True]
    assert (pre.num_prefills, pre.seq_lens, dec.num_prefills, dec.seq_lens) == (
        2,
        [4, 2],
        0,
        [1, 1],
    )


def test_split_step_interleaved():
    """Decodes and chunks interleaved (the scheduler's order): row indices per part."""
    meta = make_meta([(1, 1, True), (3, 3, False), (2, 1, True), (5, 2, True)], num_prefills=2)
    (rows0, pre), (rows1, dec) = split_step(meta)
    assert rows0.tolist() == [1, 2, 3, 5, 6] and rows1.tolist() == [0, 4]
    assert pre.cu_seqlens.tolist() == [0, 3, 5] and dec.cu_seqlens.tolist() == [0, 1, 2]
    assert pre.state_indices.tolist() == [3, 5] and dec.state_indices.tolist() == [1, 2]
    assert pre.has_initial_state.tolist() == [False, True] and pre.seq_lens == [3, 2]


def test_split_step_one_kind():
    for chunks in ([(1, 1, True), (2, 1, True)], [(1, 3, True), (2, 5, False)]):
        meta = make_meta(chunks, num_prefills=0)
        assert split_step(meta) == [(slice(0, sum(n for _, n, _ in chunks)), meta)]
