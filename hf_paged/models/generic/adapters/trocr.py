"""TrOCR: refused with its reason. Its decoder's forward takes no ``position_ids``: learned
position embeddings number the padded row from 0 (left pads shift every real token's
position), sinusoidal ones count pads into decode positions (``cache_length``). So stock's
tokens for a left-padded batch depend on its padding, while the engine numbers every prompt
from 0. (Its attention itself, ``q_proj * scaling`` / ``k_proj`` / ``v_proj`` / ``out_proj``,
would adapt as is.)"""

from __future__ import annotations

from transformers import TrOCRForCausalLM
from transformers.models.trocr.modeling_trocr import TrOCRAttention

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._refuse import refusing

REASON = (
    "it numbers positions over the padded row (its decoder takes no "
    "position_ids), so stock's tokens depend on the batch's left padding; the engine numbers "
    "each prompt from 0"
)

register(model_classes=(TrOCRForCausalLM,), adapters={TrOCRAttention: refusing(REASON)})
