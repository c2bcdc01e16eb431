"""Bloom: ALiBi attention computed by hand in ``BloomAttention``.

HF computes ``alibi + q.k / sqrt(d)`` (``baddbmm`` with beta 1), so the slopes are the model's
own, unscaled. The module also adds the residual (``dropout_add``) before returning, and with
``pretraining_tp > 1`` and ``slow_but_exact`` it runs the output projection slice by slice
(without its bias, as HF does); both are kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.bloom import modeling_bloom as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters.alibi import cached_slopes, slopes_from_bias_builder
from hf_paged.models.generic.attention import paged_attention_forward


def _dense(self: hf.BloomAttention, context: torch.Tensor) -> torch.Tensor:
    """The output projection as ``BloomAttention.forward`` runs it: [1, T, hidden]."""
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        out = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * slices), int((i + 1) * slices)
            out = out + F.linear(context[:, :, lo:hi], self.dense.weight[:, lo:hi])
        return out
    return self.dense(context)


def forward(
    self: hf.BloomAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    residual: torch.Tensor,  # [1, T, hidden]
    alibi: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    layer_past=None,
    use_cache: bool = False,
    output_attentions: bool = False,
    **kwargs,
):
    """``BloomAttention.forward`` on the paged attention: (output + residual, None)."""
    t, d = hidden_states.shape[1], self.head_dim
    qkv = self.query_key_value(hidden_states).view(1, t, -1, 3, d)  # [1, T, H, 3, D]
    q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # [1, H, T, D] each
    slopes = cached_slopes(
        self, lambda: slopes_from_bias_builder(hf.build_alibi_tensor, self.num_heads)
    )
    out, _ = paged_attention_forward(
        self, q, k, v, None, scaling=self.inv_norm_factor, alibi_slopes=slopes
    )  # [1, T, H, D]
    out = _dense(self, out.reshape(1, t, -1))
    return hf.dropout_add(out, residual, self.hidden_dropout, self.training), None


register(model_classes=(hf.BloomForCausalLM,), adapters={hf.BloomAttention: forward})
