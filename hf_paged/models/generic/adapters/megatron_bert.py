"""MegatronBERT: BERT's self-attention (query / key / value projections, scale 1 / sqrt(D));
absolute position embeddings come from ``position_ids`` in the embeddings, outside attention."""

from __future__ import annotations

import torch
from transformers import MegatronBertForCausalLM, MegatronBertModel
from transformers.models.megatron_bert.modeling_megatron_bert import MegatronBertSelfAttention

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._bert_style import (
    attend,
    bidirectional_reason,
    check_causal_self_attention,
    project_heads,
)


def self_attention(
    module: MegatronBertSelfAttention,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    attention_mask=None,
    encoder_hidden_states=None,
    *args,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    reason = bidirectional_reason(MegatronBertModel)
    check_causal_self_attention(module, encoder_hidden_states, reason)
    return attend(module, *project_heads(module, hidden_states))


register(
    model_classes=(MegatronBertForCausalLM,),
    adapters={MegatronBertSelfAttention: self_attention},
)
