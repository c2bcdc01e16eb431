"""XLM: refused with its reason. ``XLMWithLMHeadModel.prepare_inputs_for_generation`` appends
a mask token to the whole sequence at every step and the model reruns it without a cache,
predicting the next token from the mask token (bidirectionally unless ``causal=True``); the
mask token's query is never part of the sequence, which a paged causal decoder cannot compute.
Its masks also come from counting pad ids (``lengths``), not from positions in the row."""

from __future__ import annotations

from transformers import XLMWithLMHeadModel
from transformers.models.xlm.modeling_xlm import MultiHeadAttention

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._refuse import refusing

REASON = (
    "it generates by appending a mask token to the whole sequence every step "
    "and rerunning it without a cache (prepare_inputs_for_generation): not a causal decoder "
    "the paged engine can run"
)

register(
    model_classes=(XLMWithLMHeadModel,),
    adapters={MultiHeadAttention: refusing(REASON)},
)
