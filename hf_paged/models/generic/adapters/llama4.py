"""Llama 4 text: ``Llama4TextAttention`` calls the attention interface, but its NoPE layers'
temperature tuning reads token positions from the row it runs (``arange`` over the row), which
on the flattened batch mixes sequences.

The generic path serves Llama 4 only while every position is below ``floor_scale - 1``
(``support.length_refusal`` refuses the rest by name), where stock's scale is exactly 1; the
adapter turns the tuning off on hf_paged's own copy of the module (never the caller's model)
and runs the module's forward, so the scale is 1 on any row length.
"""

from __future__ import annotations

from transformers.models.llama4 import modeling_llama4 as hf

from hf_paged.models.generic.adapters import register


def forward(self: hf.Llama4TextAttention, *args, **kwargs):
    """``Llama4TextAttention.forward`` with temperature tuning off (scale 1, as stock's is
    for the lengths the engine serves)."""
    self.attn_temperature_tuning = False
    return hf.Llama4TextAttention.forward(self, *args, **kwargs)


register(model_classes=(hf.Llama4ForCausalLM,), adapters={hf.Llama4TextAttention: forward})
