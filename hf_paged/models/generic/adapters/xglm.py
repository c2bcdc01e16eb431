"""XGLM: attention computed by hand in ``XGLMAttention`` (query scaled before the product).

HF multiplies the projected query by 1/sqrt(head_dim) and then takes plain dot products; the
adapter does the same and passes scale 1, so the rounding matches. The cross-attention a
config with ``add_cross_attention`` adds is never called on the generic path (no encoder
states); the adapter refuses ``key_value_states`` rather than ignore them.
"""

from __future__ import annotations

import torch
from transformers.models.xglm import modeling_xglm as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.attention import paged_attention_forward


def forward(
    self: hf.XGLMAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    key_value_states: torch.Tensor | None = None,
    *args,
    **kwargs,
):
    """``XGLMAttention.forward`` on the paged attention: (output [1, T, hidden], None)."""
    if key_value_states is not None:
        raise ValueError("XGLMAttention adapter: cross-attention (key_value_states) is not served")
    t, d = hidden_states.shape[1], self.head_dim
    q = (self.q_proj(hidden_states) * self.scaling).view(1, t, -1, d).transpose(1, 2)
    k = self.k_proj(hidden_states).view(1, t, -1, d).transpose(1, 2)  # [1, H, T, D]
    v = self.v_proj(hidden_states).view(1, t, -1, d).transpose(1, 2)
    out, _ = paged_attention_forward(self, q, k, v, None, scaling=1.0)  # [1, T, H, D]
    return self.out_proj(out.reshape(1, t, -1)), None


register(model_classes=(hf.XGLMForCausalLM,), adapters={hf.XGLMAttention: forward})
