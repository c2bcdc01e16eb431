"""GPT-Neo: attention computed by hand in ``GPTNeoSelfAttention`` (unscaled scores, global or
local layers).

A local layer masks keys more than ``config.window_size - 1`` positions back (HF's mask keeps
``0 <= q_pos - k_pos < window_size``), which is the paged attention's ``sliding_window``
exactly. Scores are not divided by sqrt(head_dim): scale 1.
"""

from __future__ import annotations

import torch
from transformers.models.gpt_neo import modeling_gpt_neo as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.attention import ATTN_IMPL, paged_attention_forward


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[1, T, H * D] -> [1, H, T, D] (-1 heads: the module's own count, also when sharded)."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


def forward(self: hf.GPTNeoSelfAttention, hidden_states: torch.Tensor, *args, **kwargs):
    """``GPTNeoSelfAttention.forward`` on the paged attention: (output [1, T, hidden], None)."""
    q = _heads(self.q_proj(hidden_states), self.head_dim)  # [1, H, T, D]
    k = _heads(self.k_proj(hidden_states), self.head_dim)
    v = _heads(self.v_proj(hidden_states), self.head_dim)
    extra = {"sliding_window": self.config.window_size} if self.attention_type == "local" else {}
    out, _ = paged_attention_forward(self, q, k, v, None, scaling=1.0, **extra)  # [1, T, H, D]
    out = self.out_proj(out.reshape(*hidden_states.shape[:-1], -1))
    return self.resid_dropout(out), None


# GPTNeoAttention picks its attention class by ``config._attn_implementation``: the module
# hf_paged's name builds is the eager one, whose forward the adapter replaces
if hasattr(hf, "GPT_NEO_ATTENTION_CLASSES"):
    hf.GPT_NEO_ATTENTION_CLASSES.setdefault(ATTN_IMPL, hf.GPTNeoSelfAttention)

register(model_classes=(hf.GPTNeoForCausalLM,), adapters={hf.GPTNeoSelfAttention: forward})
