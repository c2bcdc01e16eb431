"""PromptEmbeds sliced per chunk (a chunk may split a range), M-RoPE positions per chunk, and the
prefix-cache extra keys of a block."""

from __future__ import annotations

import torch

from hf_paged.engine.core.prompt_embeds import (
    EmbedRange,
    PromptEmbeds,
    block_extra_keys,
    chunk_embeds,
    chunk_positions,
)


def _pe(**kw):
    rows = torch.arange(10.0)[:, None].expand(10, 2)  # row i holds i
    return PromptEmbeds([EmbedRange(2, 4, "x"), EmbedRange(8, 6, "y")], rows, **kw)


def test_chunks_take_the_rows_inside_their_window():
    pe = _pe()
    assert chunk_embeds(pe, 0, 2) is None
    c = chunk_embeds(pe, 0, 4)  # positions 2, 3 of range x
    assert c.offsets == [2, 3] and c.rows[:, 0].tolist() == [0, 1]
    c = chunk_embeds(pe, 4, 6)  # x's last two (4, 5) and y's first two (8, 9)
    assert c.offsets == [0, 1, 4, 5] and c.rows[:, 0].tolist() == [2, 3, 4, 5]
    c = chunk_embeds(pe, 13, 3)  # y's last row, then positions past every range
    assert c.offsets == [0] and c.rows[:, 0].tolist() == [9]


def test_deepstack_rows_follow_their_rows():
    ds = torch.arange(20.0).view(2, 10, 1).expand(2, 10, 2)
    c = chunk_embeds(_pe(deepstack=ds), 5, 4)  # x's row 3, y's row 0
    assert c.deepstack[:, :, 0].tolist() == [[3, 4], [13, 14]]


def test_positions_of_prompt_and_generated_tokens():
    pos = torch.tensor([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 3, 4, 5]])
    pe = PromptEmbeds([], torch.zeros(0, 2), positions=pos, position_delta=-2)
    assert chunk_positions(pe, 6, 1, 3).tolist() == pos[:, 1:4].tolist()
    got = chunk_positions(pe, 6, 4, 4)  # two prompt positions, then 6 - 2, 7 - 2 on all rows
    assert got.tolist() == [[2, 5, 4, 5], [3, 5, 4, 5], [4, 5, 4, 5]]
    assert chunk_positions(None, 6, 0, 2) is None


def test_block_keys_name_the_ranges_they_overlap():
    pe = _pe()
    assert block_extra_keys(pe, 0, 2) == ()
    assert block_extra_keys(pe, 0, 4) == (("embeds", "x", 2),)
    assert block_extra_keys(pe, 4, 8) == (("embeds", "x", -2),)
    assert block_extra_keys(pe, 4, 12) == (("embeds", "x", -2), ("embeds", "y", 4))
    assert block_extra_keys(None, 0, 4) == ()


def test_ranges_without_a_key_are_never_shared():
    a = PromptEmbeds([EmbedRange(0, 2)], torch.zeros(2, 2))
    b = PromptEmbeds([EmbedRange(0, 2)], torch.zeros(2, 2))
    assert block_extra_keys(a, 0, 4) != block_extra_keys(b, 0, 4)
