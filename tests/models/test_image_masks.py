"""Which VLM families attend bidirectionally inside an image: the ranges each family's rule
finds, through the torch reference's mask, equal the family's own stock masks (full and sliding
layers), and what ranges cannot express is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING

from hf_paged.attention.base import AttentionLayerSpec
from hf_paged.attention.torch_ref import causal_mask
from hf_paged.models.image_masks import (
    ImageMaskRule,
    bidirectional_ranges,
    image_mask_rule,
    layer_specs_for,
)
from hf_paged.refusal import Refusal

CPU = torch.device("cpu")


def _stock(create, text_config, types, pad, **kw):
    """Stock's masks for left-padded rows: ``create(config=..., ...)``'s dict or tensor."""
    text_config._attn_implementation = "sdpa"
    types = torch.tensor(types)
    attention_mask = torch.ones_like(types)
    for b, n in enumerate(pad):
        attention_mask[b, :n] = 0
    return create(
        config=text_config, inputs_embeds=torch.zeros(*types.shape, 8),
        attention_mask=attention_mask, cache=None,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0), **kw,
    )  # fmt: skip


ROWS = [[0, 0, 1, 1, 1, 0, 2, 2, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]]
PAD = [0, 2]


def _check(mask, rows, pad, ranges_of, window):
    for b, row in enumerate(rows):
        n = len(row) - pad[b]
        got = causal_mask(n, n, window, CPU, ranges_of(row[pad[b] :]))
        assert torch.equal(got, mask[b, 0, pad[b] :, pad[b] :]), (b, ranges_of(row[pad[b] :]))


def test_gemma3_rule_equals_stock():
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    config = CONFIG_MAPPING["gemma3"]()
    rule = image_mask_rule(config)
    text = config.get_text_config()
    text.sliding_window = 3
    types = [[int(t == 1) for t in row] for row in ROWS]
    masks = _stock(create_masks_for_vision_model, text, types, PAD,
                   block_sequence_ids=get_block_sequence_ids_for_mask(torch.tensor(types)))  # fmt: skip
    _check(masks["full_attention"], types, PAD, lambda r: bidirectional_ranges(rule, r), None)
    _check(masks["sliding_attention"], types, PAD, lambda r: bidirectional_ranges(rule, r), 3)
    assert bidirectional_ranges(rule, None) == []  # no token_type_ids: stock is causal


def test_gemma4_rule_opens_sliding_layers_only():
    from transformers.models.gemma4.modeling_gemma4 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    config = CONFIG_MAPPING["gemma4_unified"]()
    rule = image_mask_rule(config)
    assert isinstance(rule, ImageMaskRule) and rule.sliding_only
    text = config.get_text_config()
    text.sliding_window = 3
    ids = get_block_sequence_ids_for_mask(torch.tensor(ROWS), CPU)
    masks = _stock(create_masks_for_vision_model, text, ROWS, PAD, block_sequence_ids=ids)
    full, sliding = (AttentionLayerSpec(2, 1, 8, 1.0, sliding_window=w) for w in (None, 3))
    full, sliding = layer_specs_for(rule, [full, sliding])
    assert (full.bidirectional, sliding.bidirectional) == (False, True)
    _check(masks["full_attention"], ROWS, PAD, lambda r: [], None)
    _check(masks["sliding_attention"], ROWS, PAD, lambda r: bidirectional_ranges(rule, r), 3)
    # image (1) and video (2) tokens back to back are one block, as stock's ids make them
    assert bidirectional_ranges(rule, [0, 1, 1, 2, 0]) == [(1, 4)]
    off = CONFIG_MAPPING["gemma4"]()  # use_bidirectional_attention unset: causal
    assert image_mask_rule(off) is None


def test_paligemma_prefix_is_one_block():
    from transformers.masking_utils import create_causal_mask

    config = CONFIG_MAPPING["paligemma"]()
    rule = image_mask_rule(config)
    # prefix (image + prompt) 0, a suffix 1 after it; left pads are 0 too in the processor's rows
    types = [[0, 0, 0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    pad = [0, 3]
    ids = torch.where(torch.tensor(types) == 0, 0, -1)
    mask = _stock(create_causal_mask, config.get_text_config(), types, pad, block_sequence_ids=ids)
    _check(mask, types, pad, lambda r: bidirectional_ranges(rule, r), None)
    split = bidirectional_ranges(rule, [0, 0, 1, 0])  # prefix tokens after suffix ones
    assert isinstance(split, Refusal) and "2 separate runs" in split.detail


@pytest.mark.parametrize("model_type", ["molmo2", "git"])
def test_other_block_masks_are_refused(model_type):
    refusal = image_mask_rule(CONFIG_MAPPING[model_type]())
    assert isinstance(refusal, Refusal) and refusal.reason == "bidirectional_mask"
    assert model_type in refusal.detail


def test_paligemma2_sliding_layers_are_refused():
    config = CONFIG_MAPPING["paligemma"](text_config={"model_type": "gemma2", "sliding_window": 8})
    refusal = image_mask_rule(config)
    assert isinstance(refusal, Refusal) and "PaliGemma 2" in refusal.detail


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl", "idefics3"])
def test_causal_families_have_no_rule(model_type):
    assert image_mask_rule(CONFIG_MAPPING[model_type]()) is None
