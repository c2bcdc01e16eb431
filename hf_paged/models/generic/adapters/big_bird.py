"""BigBird as a causal LM: its decoder runs full attention (``original_full``), never the
block-sparse one, which is bidirectional and which stock ``generate`` leaves as soon as it has a
KV cache.

The adapter replaces the ``BigBirdAttention`` wrapper, whose ``self`` is a
``BigBirdSelfAttention`` or a ``BigBirdBlockSparseAttention`` with the same ``query`` / ``key``
/ ``value`` projections: it runs causal full attention through them (scale 1 / sqrt(D)), then
the wrapper's ``output`` block. The base model switches a block-sparse model to full attention
for good on its first forward shorter than its block-sparse minimum (the profile pass's);
a forward of a layer still block-sparse is refused, never served.
"""

from __future__ import annotations

import torch
from transformers import BigBirdForCausalLM, BigBirdModel
from transformers.models.big_bird.modeling_big_bird import BigBirdAttention

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._bert_style import (
    attend,
    bidirectional_refusal,
    check_causal_self_attention,
    project_heads,
)
from hf_paged.models.protocol import UnsupportedModelError


def attention(
    module: BigBirdAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    attention_mask=None,
    encoder_hidden_states=None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    reason = bidirectional_refusal(BigBirdModel)
    is_decoder = module.config.is_decoder
    check_causal_self_attention(module, encoder_hidden_states, reason, is_decoder)
    if module.attention_type != "original_full":
        raise UnsupportedModelError(
            f"BigBird block-sparse attention (attention_type={module.attention_type!r}) at "
            f"{hidden_states.shape[1]} tokens: bidirectional"
        )
    inner = module.self
    context, _ = attend(module, *project_heads(inner, hidden_states))  # [1, T, H * D]
    return module.output(context, hidden_states), None


register(model_classes=(BigBirdForCausalLM,), adapters={BigBirdAttention: attention})
