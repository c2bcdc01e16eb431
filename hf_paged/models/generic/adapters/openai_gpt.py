"""OpenAI GPT (GPT-1): attention computed by hand in ``Attention``, Conv1D projections.

The model builds its blocks with ``scale=True`` (scores divided by sqrt(head_dim)); a module
built with ``scale=False`` gets scale 1. HF masks future keys with -1e4 rather than -inf: the
softmax weight ``exp(-1e4)`` of such a key is 0 in float32, bfloat16 and float16 alike, so
causal masking is the same.
"""

from __future__ import annotations

import torch
from transformers.models.openai import modeling_openai as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.attention import paged_attention_forward


def forward(self: hf.Attention, x: torch.Tensor, *args, **kwargs):
    """``Attention.forward`` on the paged attention: ``[output [1, T, hidden]]`` (a list, as
    HF's, which the block indexes)."""
    t = x.shape[1]
    q, k, v = self.c_attn(x).split(self.split_size, dim=2)  # [1, T, hidden] each
    q, k, v = (y.view(1, t, self.n_head, -1).transpose(1, 2) for y in (q, k, v))  # [1, H, T, D]
    scale = q.shape[-1] ** -0.5 if self.scale else 1.0
    out, _ = paged_attention_forward(self, q, k, v, None, scaling=scale)  # [1, T, H, D]
    return [self.resid_dropout(self.c_proj(out.reshape(1, t, -1)))]


register(model_classes=(hf.OpenAIGPTLMHeadModel,), adapters={hf.Attention: forward})
