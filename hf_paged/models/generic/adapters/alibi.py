"""ALiBi slopes for the adapters (Bloom, Falcon, MPT), taken from the model's own code.

HF models add ``slope_h * k_pos`` to the scores, with ``k_pos`` counted from the first real
token of the row (``attention_mask.cumsum - 1``); the paged attention adds
``slope_h * (k_pos - q_pos)``, which differs by a constant per query row, so softmax gives the
same probabilities. The slopes come from the modeling file's own builder (run on two positions)
so that any rounding it applies (Falcon rounds them to bfloat16) is kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

_SLOPES_ATTR = "_hf_paged_alibi_slopes"  # per module: [H] float32 slopes, computed once


def cached_slopes(module: nn.Module, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``build()`` ([H] slopes) the first time, then the same tensor: the slopes depend on the
    config alone, and a forward (maybe a captured CUDA graph) should not rebuild them."""
    slopes = module.__dict__.get(_SLOPES_ATTR)
    if slopes is None:
        slopes = build().float().flatten()
        module.__dict__[_SLOPES_ATTR] = slopes
    return slopes


def slopes_from_bias_builder(build_alibi_tensor: Callable, num_heads: int) -> torch.Tensor:
    """[H] slopes from a Bloom-style ``build_alibi_tensor(mask, num_heads, dtype)`` (returns
    ``[B * H, 1, T]`` with ``slope_h * k_pos``): its value at position 1 of a 2-token row."""
    mask = torch.ones(1, 2, dtype=torch.long)
    return build_alibi_tensor(mask, num_heads, torch.float32)[:, 0, 1]
