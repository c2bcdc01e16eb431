"""Bidirectional ranges (Gemma 3's images): the torch reference's mask equals stock's own masks,
the per-query key ends the kernels read equal that mask, and the step builder hands both over.

The oracle is transformers' ``create_masks_for_vision_model`` (full layers: OR(causal, same
image); sliding layers: AND(window, OR(causal, same image))) on left-padded rows of
``token_type_ids``, each compared with our mask over the row's unpadded positions.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention.bidirectional import check_ranges, query_key_ends, ranges_from_token_types
from hf_paged.attention.torch_ref import causal_mask

# left-padded rows (-1 = pad): images at the start, at the end, back to back (one block in
# stock), one token long, and none at all
ROWS = [
    [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0],
    [-1, -1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0],
    [-1, -1, -1, -1, 1, 1, 1, 0, 1, 0, 0, 1, 1],
    [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
]


def _stock_masks(rows, window):
    """Stock's {layer type: [B, L, L] bool} for left-padded ``rows``."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    cfg = Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, intermediate_size=64,
                           vocab_size=100, sliding_window=window)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    types = torch.tensor(rows).clamp(min=0)
    attention_mask = (torch.tensor(rows) >= 0).long()
    masks = create_masks_for_vision_model(
        config=cfg,
        inputs_embeds=torch.zeros(*types.shape, 64),
        attention_mask=attention_mask,
        cache=None,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
        block_sequence_ids=get_block_sequence_ids_for_mask(types),
    )
    return {name: m[:, 0] for name, m in masks.items()}


@pytest.mark.parametrize("window", [1, 3, 4, 100])
def test_reference_mask_equals_stock(window):
    stock = _stock_masks(ROWS, window)
    for b, row in enumerate(ROWS):
        types = [t for t in row if t >= 0]
        pad, n = len(row) - len(types), len(types)
        ranges = ranges_from_token_types(types)
        for name, layer_window in (("full_attention", None), ("sliding_attention", window)):
            want = stock[name][b, pad:, pad:]
            got = causal_mask(n, n, layer_window, torch.device("cpu"), ranges)
            assert torch.equal(got, want), (name, b, ranges)
            # a chunk ending outside every range sees the same rows as the whole prompt
            for start in range(n):
                end = next((e for s, e in ranges if s < start < e), start)
                got = causal_mask(n - end, n, layer_window, torch.device("cpu"), ranges)
                assert torch.equal(got, want[end:]), (name, b, start)


def test_ranges_from_token_types_are_stocks_blocks():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    for row in ROWS:
        types = [max(t, 0) for t in row]
        ids = get_block_sequence_ids_for_mask(torch.tensor([types]))[0].tolist()
        blocks: dict[int, list[int]] = {}
        for pos, g in enumerate(ids):
            if g >= 0:
                blocks.setdefault(g, []).append(pos)
        want = [(p[0], p[-1] + 1) for _, p in sorted(blocks.items())]
        assert ranges_from_token_types(types) == want
    assert ranges_from_token_types([]) == []
    assert ranges_from_token_types([2, 2, 0, 2], kind=2) == [(0, 2), (3, 4)]


@pytest.mark.parametrize("start", [0, 2, 6, 9, 10, 11, 13])  # chunk starts outside a range
def test_query_key_ends_are_the_masks_last_keys(start):
    ranges = [[(2, 6), (6, 9), (11, 14)], [], [(0, 1)]]
    ctx, q_lens = [14, 7, 3], [14 - start, 7, 1]
    cu = [0, q_lens[0], q_lens[0] + 7, q_lens[0] + 8]
    want = []
    for i in range(3):
        mask = causal_mask(q_lens[i], ctx[i], None, torch.device("cpu"), ranges[i])
        want += [int(r.nonzero().max()) + 1 for r in mask]
    assert query_key_ends(ranges, cu, ctx) == want


def test_query_key_ends_without_ranges_holding_a_query_is_none():
    assert query_key_ends([[], []], [0, 3, 4], [3, 9]) is None
    assert query_key_ends([[(0, 4)]], [0, 2], [10]) is None  # wholly before the chunk


def test_query_key_ends_refuses_a_split_range():
    with pytest.raises(ValueError, match=r"\[4, 12\) of sequence 1 .* ends past its context"):
        query_key_ends([[], [(4, 12)]], [0, 2, 8], [2, 10])


@pytest.mark.parametrize("bad", [[(3, 3)], [(4, 6), (5, 7)], [(5, 7), (1, 2)], [(-1, 2)]])
def test_check_ranges_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"bidirectional_ranges=.* is not allowed"):
        check_ranges(bad)


def test_step_inputs_hand_the_ranges_to_the_backends():
    """A prefill step carries each chunk's ranges and the per-query ends; a chunk whose ranges
    hold no query (wholly cached) leaves the batch causal."""
    from hf_paged.engine.core.contracts import ModelInput, ScheduledChunk
    from hf_paged.engine.worker.step_inputs import StepInputs

    inputs = StepInputs(torch.device("cpu"), 4)
    chunks = [
        ScheduledChunk(0, [1] * 6, 2, [0, 1], True, bidirectional_ranges=[(3, 6)]),
        ScheduledChunk(1, [1] * 2, 0, [2], False),
    ]
    _, _, meta, _ = inputs.build(ModelInput(chunks), None)
    assert meta.bidirectional_ranges == [[(3, 6)], []]
    assert meta.query_key_ends.dtype == torch.int32
    assert meta.query_key_ends.tolist() == [3, 6, 6, 6, 7, 8, 1, 2]
    cached = [ScheduledChunk(0, [1] * 2, 6, [0, 1], True, bidirectional_ranges=[])]
    _, _, meta, _ = inputs.build(ModelInput(cached), None)
    assert meta.bidirectional_ranges is None and meta.query_key_ends is None
