"""Each row's bidirectional ranges, for families whose stock mask opens an image's tokens to
each other (``models/image_masks.py``): found once, from the row of type ids the call passed
(``token_type_ids`` for Gemma 3), with the row's left padding stripped."""

from __future__ import annotations

import torch

from hf_paged.models.image_masks import ImageMaskRule, bidirectional_ranges, image_mask_rule


def mask_rule(model) -> ImageMaskRule | None:
    """``model``'s rule (None: causal; the route has refused the families it cannot serve)."""
    rule = image_mask_rule(model.config)
    return rule if isinstance(rule, ImageMaskRule) else None


def type_ids_keys(model) -> tuple[str, ...]:
    """The keyword of the type ids the rule reads (nothing for a causal family)."""
    rule = mask_rule(model)
    return () if rule is None else (rule.type_ids_key,)


def row_ranges(model, attention_mask: torch.Tensor, mm_inputs: dict) -> list | None:
    """Per row of ``attention_mask`` [B, L], its ranges ``[(start, end), ...]`` in the row's
    attended tokens; None when the family is causal or the call passed no type ids (stock's
    mask is causal then).

    Raises:
        ValueError: the type ids' shape is not ``attention_mask``'s, or they make blocks the
            ranges cannot express (named).
    """
    rule = mask_rule(model)
    types = None if rule is None else mm_inputs.get(rule.type_ids_key)
    if types is None:
        return None
    if tuple(types.shape) != tuple(attention_mask.shape):
        raise ValueError(
            f"{rule.type_ids_key} of shape {tuple(types.shape)} is not allowed: must be "
            f"input_ids' shape {tuple(attention_mask.shape)}"
        )
    out = []
    for row, m in zip(types, attention_mask, strict=True):
        ranges = bidirectional_ranges(rule, row[m.bool()].tolist())
        if not isinstance(ranges, list):
            raise ValueError(f"{rule.type_ids_key}: {ranges.detail}")
        out.append(ranges)
    return out
