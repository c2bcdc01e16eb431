"""MPT: ALiBi attention computed by hand in ``MptAttention``.

``MptModel`` builds one bias for all layers, ``position_bias [H, 1, max_seq_len]`` holding
``slope_h * (j - (max_seq_len - 1))`` for key column j, and every layer adds its last
``kv_length`` columns to the scores: ``slope_h * k`` up to a constant per query row, which is
the paged attention's ``slope_h * (k_pos - q_pos)`` after softmax. The slopes are read off the
bias the model passes (its last two columns), so they are exactly the model's.

``MptModel.forward`` calls ``create_causal_mask(...).to(torch.bool)``; for hf_paged's attention
implementation transformers builds no mask (it returns None), so this module gives the MPT
modeling file a ``create_causal_mask`` that returns an empty placeholder for that
implementation only (every other call goes to transformers' function unchanged). The adapter
never reads it: the paged attention is causal within each sequence by construction.
"""

from __future__ import annotations

import torch
from transformers.models.mpt import modeling_mpt as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters.alibi import cached_slopes
from hf_paged.models.generic.attention import ATTN_IMPL, paged_attention_forward


def forward(
    self: hf.MptAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    position_bias: torch.Tensor | None = None,  # [H, 1, max_seq_len]
    *args,
    **kwargs,
):
    """``MptAttention.forward`` on the paged attention: (output [1, T, hidden], None)."""
    if position_bias is None:
        raise ValueError("MptAttention adapter: MptModel passed no ALiBi position_bias")
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    t, d = hidden_states.shape[1], self.head_dim
    q, k, v = (x.reshape(1, t, -1, d).transpose(1, 2) for x in qkv.chunk(3, dim=2))
    slopes = cached_slopes(self, lambda: position_bias[:, 0, -1] - position_bias[:, 0, -2])
    out, _ = paged_attention_forward(
        self, q, k, v, None, scaling=self.softmax_scale, alibi_slopes=slopes
    )  # [1, T, H, D]
    return self.out_proj(out.reshape(1, t, -1)), None


_create_causal_mask = hf.create_causal_mask


def _causal_mask(config, *args, **kwargs):
    if getattr(config, "_attn_implementation", None) == ATTN_IMPL:
        return torch.zeros((), dtype=torch.bool)  # unused: the adapter ignores the mask
    return _create_causal_mask(config, *args, **kwargs)


hf.create_causal_mask = _causal_mask  # this module runs once (imported on first use)

register(model_classes=(hf.MptForCausalLM,), adapters={hf.MptAttention: forward})
