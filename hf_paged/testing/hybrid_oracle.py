"""The oracle for the hybrid and recurrent families: stock greedy ``generate`` on each prompt
alone (fp32), against one batched, left-padded ``generate(backend="paged")`` call.

Stock's own batched left-padded call is no oracle for these: in some families (MiniMax's
lightning attention, for one) the padding tokens flow through the recurrence, so its rows differ
from the same prompts run alone. The engine has no padding. ``stock_batched_differs`` says for
which families that is so.
"""

from __future__ import annotations

import warnings

import torch

from hf_paged.testing.parity import fallback_warnings, hf_greedy
from hf_paged.testing.prompts import left_pad, make_prompts

PROMPT_LENS = (1, 2, 5, 16, 17, 31, 64, 70)  # 1 to 70 tokens, around 16-token chunks
NEW_TOKENS = 16


def hybrid_prompts(vocab: int, seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    """One prompt per length of ``lens``, ids drawn from [3, vocab)."""
    return make_prompts(lens, seed=seed, vocab=vocab)


def stock_alone(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    """Stock greedy on each prompt alone: the new token ids of each."""
    return hf_greedy(model, prompts, new_tokens)


def _batched(model, prompts, new_tokens, **kwargs) -> list[list[int]]:
    ids, mask = left_pad(prompts)
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


def stock_batched(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    """Stock greedy on all prompts in one left-padded call: the new token ids of each row."""
    return _batched(model, prompts, new_tokens)


def paged_batched(model, prompts, paged_config: dict | None = None, new_tokens=NEW_TOKENS):
    """One left-padded greedy ``generate(backend="paged")`` call.

    Returns:
        ``(new token ids per row, PagedFallbackWarning messages)``.
    """
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        rows = _batched(model, prompts, new_tokens, backend="paged",
                        paged_config=dict(paged_config or {}))  # fmt: skip
    return rows, fallback_warnings(records)


def stock_batched_differs(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> bool:
    """Whether stock's batched left-padded rows differ from the prompts run alone."""
    return stock_batched(model, prompts, new_tokens) != stock_alone(model, prompts, new_tokens)
