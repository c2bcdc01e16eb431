"""Random token-id prompts for the tiny models, and HF-style padded batches of them."""

from __future__ import annotations

import random

import torch

PAD = 0  # tiny_config: pad 0, bos 1, eos 2; prompts draw from 3 up, so no special id occurs


def make_prompts(
    lengths, seed: int = 0, vocab: int = 256, prefix: list[int] | None = None, rng=None
) -> list[list[int]]:
    """One prompt per entry of ``lengths``: ``prefix`` then that many ids drawn from [3, vocab).

    Args:
        lengths: the number of drawn ids of each prompt.
        seed: seeds a ``random.Random`` when ``rng`` is not given.
        vocab: one past the largest id drawn.
        prefix: ids every prompt starts with (a shared prefix, for prefix-cache hits).
        rng: a ``random.Random`` to draw from instead (it goes on where its caller left it).
    """
    rng = rng or random.Random(seed)
    return [list(prefix or []) + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def spread_prompts(
    n: int, lo: int, hi: int, seed: int, vocab: int = 256, prefix: list[int] | None = None
) -> list[list[int]]:
    """``n`` prompts whose drawn parts have 1, ``hi`` and ``lo`` ids, then lengths uniform in
    [lo, hi] (the extremes always occur); see ``make_prompts`` for the other arguments."""
    rng = random.Random(seed)
    lengths = [1, hi, lo] + [rng.randint(lo, hi) for _ in range(n - 3)]
    return make_prompts(lengths[:n], vocab=vocab, prefix=prefix, rng=rng)


def left_pad(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], attention_mask [B, L])`` with pads on the left (as HF batches)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def right_pad(prompts: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], attention_mask [B, L])`` with pads on the right."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask
