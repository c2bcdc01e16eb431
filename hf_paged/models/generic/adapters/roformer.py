"""RoFormer: BERT-style self-attention with rotary position embeddings on query and key.

The encoder computes one sinusoidal table row per index of the (padded) input row and hands it
to every layer as ``sinusoidal_pos``. On the flattened row those indices are not the tokens'
positions, so the table module's adapter returns its whole table ``[P, D]`` and the attention
adapter picks each token's row by ``position_ids``. Stock ``generate`` counts left pads into
RoFormer's positions (its forward takes no ``position_ids``); rotary scores depend only on
``q_pos - k_pos`` when the table is the sinusoid (``create_weight``), so a per-row offset
changes nothing; a checkpoint whose table is anything else, or ``rotary_value=True`` (values
rotated by their absolute position), would depend on the padding, and is refused.
"""

from __future__ import annotations

import torch
from transformers import RoFormerForCausalLM, RoFormerModel
from transformers.models.roformer.modeling_roformer import (
    RoFormerSelfAttention,
    RoFormerSinusoidalPositionalEmbedding,
)

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._bert_style import (
    attend,
    bidirectional_refusal,
    check_causal_self_attention,
    project_heads,
)
from hf_paged.models.protocol import UnsupportedModelError

_CHECKED_ATTR = "_hf_paged_sinusoid_checked"


def sinusoidal_table(module: RoFormerSinusoidalPositionalEmbedding, *args, **kwargs):
    """The whole sinusoidal table ``[P, D]`` (sin half, cos half), whatever the input shape.

    Raises:
        UnsupportedModelError: the loaded table is not the sinusoid (checked once).
    """
    table = module.weight
    if not module.__dict__.get(_CHECKED_ATTR):
        want = module.create_weight().to(table.device, torch.float32)
        tol = 1e-5 if table.dtype == torch.float32 else 1e-2
        if not torch.allclose(table.float(), want, rtol=0.0, atol=tol):
            raise UnsupportedModelError(
                "RoFormer's position table (encoder.embed_positions.weight) is not the sinusoid "
                "its rotary embeddings are relative with; stock's tokens would depend on the "
                "batch's left padding"
            )
        module.__dict__[_CHECKED_ATTR] = True
    return table


def self_attention(
    module: RoFormerSelfAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    attention_mask=None,
    sinusoidal_pos: torch.Tensor | None = None,  # [1, 1, P, D]: the table (see above)
    encoder_hidden_states=None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    check_causal_self_attention(module, encoder_hidden_states, bidirectional_refusal(RoFormerModel))
    if module.rotary_value:
        raise UnsupportedModelError(
            "RoFormer with rotary_value=True: values are rotated by their absolute position, "
            "which stock generate counts from the batch's left padding"
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None or sinusoidal_pos is None:
        raise UnsupportedModelError("RoFormer attention got no position_ids or sinusoidal table")
    query, key, value = project_heads(module, hidden_states)  # [1, H, T, D]
    table = sinusoidal_pos.reshape(-1, sinusoidal_pos.shape[-1])  # [P, D]
    pos = table[position_ids.reshape(-1)][None, None]  # [1, 1, T, D]
    query, key = module.apply_rotary_position_embeddings(pos, query, key)
    return attend(module, query, key, value)


register(
    model_classes=(RoFormerForCausalLM,),
    adapters={
        RoFormerSelfAttention: self_attention,
        RoFormerSinusoidalPositionalEmbedding: sinusoidal_table,
    },
)
