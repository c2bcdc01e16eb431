"""CPM-Ant: refused with its reason. Every attention score gets a learned bias looked up per
(relative-position bucket, query segment, key segment) (``CpmAntSegmentPositionEmbedding``);
the paged attention kernels have no learned position bias, only ALiBi's linear one."""

from __future__ import annotations

from transformers import CpmAntForCausalLM
from transformers.models.cpmant.modeling_cpmant import CpmAntAttention

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._refuse import refusing

REASON = (
    "it adds a learned bias per relative-position bucket and segment pair to every attention "
    "score (CpmAntSegmentPositionEmbedding); the paged attention has no learned position bias"
)

register(model_classes=(CpmAntForCausalLM,), adapters={CpmAntAttention: refusing(REASON)})
