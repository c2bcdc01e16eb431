"""GPT-NeoX-Japanese: attention computed by hand in ``GPTNeoXJapaneseAttention``.

Per head the fused projection packs query, key and value; rotary applies to the first
``rotary_ndims`` dims of query and key. Scores are divided by sqrt(head_size). The module
returns its output bias (set on the last layer) as a third item, added by the layer.
"""

from __future__ import annotations

import torch
from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as hf

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.attention import paged_attention_forward


def _rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary on the first ``rotary_ndims`` dims of q and k [1, H, T, D]; the rest passes."""
    r = self.rotary_ndims
    q_rot, k_rot = hf.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


def forward(
    self: hf.GPTNeoXJapaneseAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    *args,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
):
    """``GPTNeoXJapaneseAttention.forward`` on the paged attention:
    (output [1, T, hidden], None, output bias or None)."""
    t, d = hidden_states.shape[1], self.head_size
    qkv = self.query_key_value(hidden_states).view(1, t, -1, 3 * d)  # [1, T, H, 3D]
    q, k, v = (qkv[..., i * d : (i + 1) * d].transpose(1, 2) for i in range(3))  # [1, H, T, D]
    cos, sin = position_embeddings
    q, k = _rotary(self, q, k, cos, sin)
    out, _ = paged_attention_forward(self, q, k, v, None, scaling=1.0 / self.norm_factor)
    return self.dense(out.reshape(1, t, -1)), None, self.dense_bias


register(
    model_classes=(hf.GPTNeoXJapaneseForCausalLM,),
    adapters={hf.GPTNeoXJapaneseAttention: forward},
)
