"""RemBERT: BERT's self-attention (query / key / value projections, scale 1 / sqrt(D));
absolute position embeddings come from ``position_ids`` in the embeddings, outside attention."""

from __future__ import annotations

from transformers import RemBertForCausalLM, RemBertModel
from transformers.models.rembert.modeling_rembert import RemBertSelfAttention

from hf_paged.models.generic.adapters._bert_style import serve_bert_self_attention

serve_bert_self_attention(RemBertForCausalLM, RemBertModel, RemBertSelfAttention)
