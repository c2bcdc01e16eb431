"""Falcon: attention computed by hand (or by SDPA) in ``FalconAttention``, with a fused QKV
projection in three layouts and either rotary positions or ALiBi.

* ``new_decoder_architecture`` (Falcon-40B): ``num_kv_heads`` groups, each packing its query
  heads then one key and one value head. HF broadcasts the key and value to every query head
  of the group; here they stay one KV head per group (grouped-query attention, same result,
  a smaller cache).
* ``multi_query``: all query heads, then one key and one value head.
* otherwise: per head, query, key and value.

Scores are scaled by 1/sqrt(head_dim). With ``alibi`` HF adds the bias before that scale,
``(q.k + slope_h * k_pos) / sqrt(d)``, so the slopes passed are the model's own (rounded to
bfloat16 as HF rounds them) times the scale. HF rounds the product ``slope_h * k_pos`` to
bfloat16 as well; the paged attention adds it in float32, a difference below bfloat16's
precision of the bias (nothing at all when the head count is a power of two up to 8, whose
slopes are powers of two).
"""

from __future__ import annotations

import torch
from transformers.models.falcon import modeling_falcon as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters.alibi import cached_slopes, slopes_from_bias_builder
from hf_paged.models.generic.attention import ATTN_IMPL, paged_attention_forward


def _split(self: hf.FalconAttention, fused: torch.Tensor):
    """[1, T, (H + 2 Hkv) D] -> q [1, H, T, D], k and v [1, Hkv, T, D]."""
    t, d = fused.shape[1], self.head_dim
    if self.new_decoder_architecture:  # [1, T, G, H/G + 2, D]
        qkv = fused.view(1, t, self.num_kv_heads, -1, d)
        q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif self.multi_query:  # [1, T, H + 2, D]
        qkv = fused.view(1, t, -1, d)
        q, k, v = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    else:  # [1, T, H, 3, D]
        qkv = fused.view(1, t, -1, 3, d)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _slopes(self: hf.FalconAttention) -> torch.Tensor:
    """[H] ALiBi slopes in the units of the scaled scores."""
    raw = slopes_from_bias_builder(hf.build_alibi_tensor, self.num_heads)
    return raw * self.inv_norm_factor


def forward(
    self: hf.FalconAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    alibi: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    layer_past=None,
    use_cache: bool = False,
    output_attentions: bool = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
):
    """``FalconAttention.forward`` on the paged attention: (output [1, T, hidden], None)."""
    q, k, v = _split(self, self.query_key_value(hidden_states))
    extra = {}
    if self.config.alibi:
        extra["alibi_slopes"] = cached_slopes(self, lambda: _slopes(self))
    else:
        cos, sin = position_embeddings
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    scale = self.inv_norm_factor
    out, _ = paged_attention_forward(self, q, k, v, None, scaling=scale, **extra)  # [1, T, H, D]
    return self.dense(out.reshape(*hidden_states.shape[:-1], -1)), None


# FalconDecoderLayer picks its attention class by ``config._attn_implementation``: hf_paged's
# name builds the eager/SDPA one, whose forward the adapter replaces
if hasattr(hf, "FALCON_ATTENTION_CLASSES"):
    hf.FALCON_ATTENTION_CLASSES.setdefault(ATTN_IMPL, hf.FalconAttention)


def _no_model_level_alibi(model: hf.FalconModel) -> None:
    """The attention adds ALiBi from the slopes (``config.alibi``): the model's own ALiBi tensor
    and the 4-D mask it folds it into are the padded batch's (and transformers >= 5.25 reads that
    mask from the attention-mask interface, which hf_paged's attention does not fill)."""
    model.use_alibi = False


register(model_classes=(hf.FalconForCausalLM,), adapters={hf.FalconAttention: forward},
         prepare={hf.FalconModel: _no_model_level_alibi})  # fmt: skip
