"""MegatronBERT: BERT's self-attention (query / key / value projections, scale 1 / sqrt(D));
absolute position embeddings come from ``position_ids`` in the embeddings, outside attention."""

from __future__ import annotations

from transformers import MegatronBertForCausalLM, MegatronBertModel
from transformers.models.megatron_bert.modeling_megatron_bert import MegatronBertSelfAttention

from hf_paged.models.generic.adapters._bert_style import serve_bert_self_attention

serve_bert_self_attention(MegatronBertForCausalLM, MegatronBertModel, MegatronBertSelfAttention)
