"""Each row's engine prompt for a prepared ``generate`` call: its attended input ids, or, for
``inputs_embeds``, a ``PromptEmbeds`` over its attended positions with placeholder ids.

Stock prefills ``inputs_embeds`` and decodes from ids; the engine does the same with the rows
as the prompt's embeddings (``engine/core/prompt_embeds.py``). The ids under the rows are the
caller's ``input_ids`` when they were passed with the embeddings (stock's output starts with
them), else placeholders that no processor sees (stock's loop holds ``[B, 0]`` ids). Each row's
key is its own (the call's number and the row): the returned cache's second pass over the same
rows finds their KV in the prefix cache, and no other call shares it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hf_paged.engine.core.prompt_embeds import PromptEmbeds

_calls = itertools.count()
_PLACEHOLDER = 0  # an id every vocabulary has; never embedded (its row replaces it)


@dataclass
class PromptRows:
    """The engine's prompt of every row of a call."""

    prompts: list[list[int]]  # per row: the ids the engine holds (attended positions)
    prompt_embeds: list[PromptEmbeds] | None  # per row, with inputs_embeds; else None


def prompt_rows(input_ids: torch.Tensor, keep: torch.Tensor, embeds: torch.Tensor | None):
    """``PromptRows`` of ``input_ids`` ``[B, L]`` (``[B, 0]`` with embeddings alone) whose
    attended positions are ``keep`` ``[B, L]`` bool, and of ``embeds`` ``[B, L, hidden]`` or
    None."""
    if embeds is None:
        return PromptRows([row[k].tolist() for row, k in zip(input_ids, keep, strict=True)], None)
    with_ids = input_ids.shape[1] == embeds.shape[1]
    call = next(_calls)
    prompts, rows = [], []
    for i, k in enumerate(keep):
        prompts.append(input_ids[i][k].tolist() if with_ids else [_PLACEHOLDER] * int(k.sum()))
        rows.append(PromptEmbeds.dense(embeds[i][k], key=("inputs_embeds", call, i)))
    return PromptRows(prompts, rows)


__all__ = ["PromptRows", "prompt_rows"]
