"""Recurrent layers in the returned cache: a hybrid model's conv and recurrent states, as stock's
cache holds them after ``generate``.

Stock's hybrid cache (``DynamicCache`` with ``LinearAttentionLayer``s, Qwen3.5 / Qwen3-Next /
OLMo-Hybrid's Gated DeltaNet) holds, per recurrent layer, the convolution's last ``K`` inputs
``[N, C, K]`` and the recurrent state ``[N, H, Dk, Dv]`` after every token but the last. The
engine keeps the last ``K - 1`` inputs per sequence (all the next step reads), so its second
pass over a row (``cache.py``) runs in two steps: the row but its last token, whose window's
oldest input is stock's first column, then the last token, after which the window and the
recurrent state are stock's other columns and state. Rows are independent of the padding: stock
zeroes pad positions' inputs, so a padded row's states are those of its attended tokens.

Served mixers: Gated DeltaNet. Other recurrent layers (Mamba, short convolutions, lightning
attention, RG-LRU) keep their states in layouts of their own and run stock by name.
"""

from __future__ import annotations

import torch

from hf_paged.models.recurrent.registry import MIXERS, recurrent_modules
from hf_paged.refusal import Refusal

_SERVED = {"gated_delta:GatedDeltaNetMixer"}  # mixers whose states map onto stock's layers


def recurrent_refusal(model, passed: bool) -> Refusal | None:
    """Why a model's recurrent layers keep the call from returning or taking
    stock's cache (``passed``: one was passed in), or None (no recurrent layer, or served ones)."""
    found = recurrent_modules(model)
    if not found:
        return None
    name = type(found[0][1]).__name__
    unserved = sorted({type(m).__name__ for _, m in found if MIXERS.get(type(m).__name__)
                       not in _SERVED})  # fmt: skip
    if unserved or not all(isinstance(getattr(m, "layer_idx", None), int) for _, m in found):
        what = "a cache passed in to" if passed else "the returned cache of"
        return Refusal(
            "recurrent_cache",
            f"{what} a model with recurrent layers ({(unserved or [name])[0]}) holds their conv "
            "and recurrent states, which the engine keeps in another form",
        )
    return None


def layer_kinds(model, num_layers: int) -> list[tuple[str, int]]:
    """Per stock cache layer: ``("state", j)`` for the model's ``j``-th recurrent layer, else
    ``("kv", i)`` for the engine's ``i``-th KV layer (attention layers in order)."""
    state_at = {m.layer_idx: j for j, (_, m) in enumerate(recurrent_modules(model))}
    kinds, kv = [], 0
    for idx in range(num_layers):
        if idx in state_at:
            kinds.append(("state", state_at[idx]))
        else:
            kinds.append(("kv", kv))
            kv += 1
    return kinds


def stock_states(first: list[dict], last: list[dict], two_steps: list[bool]) -> list[dict]:
    """Per recurrent layer ``{"conv": [N, C, K], "recurrent": [N, ...]}`` from the engine's
    states after a row but its last token (``first``) and after all of it (``last``); a row of
    one token (``two_steps`` False) ran once: its oldest input is zero."""
    out = []
    for before, after in zip(first, last, strict=True):
        window = after["conv"]  # [N, C, K - 1]
        oldest = before["conv"][:, :, :1].clone()  # [N, C, 1]
        oldest[~torch.tensor(two_steps, device=oldest.device)] = 0
        out.append({"conv": torch.cat([oldest, window], dim=-1), "recurrent": after["recurrent"]})
    return out


def put_states(cache, idx: int, states: dict, length: int) -> None:
    """Layer ``idx`` of stock's cache holds ``states`` after ``length`` tokens: the conv inputs
    go in as stock's prefill gives them (``length`` columns, the last ``K`` real), so the layer
    counts ``length`` tokens and keeps the last ``K``."""
    conv = states["conv"]  # [N, C, K]
    k = conv.shape[-1]
    if length >= k:
        given = conv.new_zeros(*conv.shape[:2], length)
        given[..., -k:] = conv
    else:  # stock pads a short prefill on the left with zeros: the same columns
        given = conv[..., k - length :]
    cache.update_conv_state(given, idx, conv_kernel_size=k)
    cache.update_recurrent_state(states["recurrent"].to(conv.dtype), idx)


__all__ = ["layer_kinds", "put_states", "recurrent_refusal", "stock_states"]
