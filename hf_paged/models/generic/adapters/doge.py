"""Doge: refused with its reason. ``DogeAttention.prepare_dynamic_mask`` builds the "mask" it
passes to the attention function from the values: every score gets an additive bias per key and
KV head, ``exp(A * softplus(dt_proj(v)))``, and past ``keep_window_size`` keys only the top ones
by that bias stay attended. That is not the plain causal mask the paged attention applies (an
exact port would fold the bias into an extra query / key dimension and refuse contexts longer
than the window)."""

from __future__ import annotations

from transformers import DogeForCausalLM
from transformers.models.doge.modeling_doge import DogeAttention

from hf_paged.models.generic.adapters import register
from hf_paged.models.generic.adapters._refuse import refusing

REASON = (
    "its attention mask is a per-key bias computed from the values (dynamic mask attention: "
    "exp(A * softplus(dt_proj(v)))), top-k sparsified past keep_window_size, not a causal mask"
)

register(model_classes=(DogeForCausalLM,), adapters={DogeAttention: refusing(REASON)})
