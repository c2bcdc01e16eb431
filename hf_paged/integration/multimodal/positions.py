"""Qwen's multimodal rotary positions (M-RoPE), from stock's ``get_rope_index``, once per call.

Stock's ``generate`` computes ``[3, B, L]`` positions and ``rope_deltas [B, 1]`` with the attention
mask before prefill (``_prepare_position_ids_for_generation``), and decodes at ``t + delta`` where
``t`` counts the row's attended tokens. The same call here gives each row its positions with the
padding stripped, ``[3, L_row]``, and its delta; the engine keeps them per request
(``PromptEmbeds.positions`` / ``position_delta``), so no delta is ever shared between calls.
"""

from __future__ import annotations

import inspect

import torch


def has_mrope(model) -> bool:
    """The model's decoder takes ``[3, T]`` positions (it has stock's ``get_rope_index``)."""
    return callable(getattr(getattr(model, "model", model), "get_rope_index", None))


@torch.no_grad()
def mrope_positions(model, input_ids, attention_mask, mm_inputs: dict):
    """Per row ``(positions [3, L_row], delta)``, or None where stock uses plain positions (no
    image grid or no ``mm_token_type_ids``, as stock's own condition)."""
    if mm_inputs.get("mm_token_type_ids") is None or (
        mm_inputs.get("image_grid_thw") is None and mm_inputs.get("video_grid_thw") is None
    ):
        return None
    fn = getattr(model, "model", model).get_rope_index
    names = set(inspect.signature(fn).parameters) - {"input_ids", "attention_mask", "kwargs"}
    kwargs = {k: v for k, v in mm_inputs.items() if k in names and v is not None}
    pos, deltas = fn(input_ids, attention_mask=attention_mask, **kwargs)  # [3, B, L], [B, 1]
    out = []
    for b in range(input_ids.shape[0]):
        keep = attention_mask[b].bool()
        out.append((pos[:, b, keep].to(torch.int64).cpu(), int(deltas[b].reshape(-1)[0])))
    return out
