"""The profile pass: one tiny forward whose attention calls are recorded, not served.

Per attention module it records the local query and KV heads, the K and V head dims, the scale,
the sliding window and the softcap the module passes, and how often it was called. From that
come the KV cache specs (one per attention module, in call order) and each module's
``AttentionLayerSpec``. Whatever the paged attention cannot reproduce exactly (a mask the model
built itself, attention sinks, a second call per layer, a non-causal module, keys that are not
the new tokens' own...) is collected as a named reason and raised as ``UnsupportedModelError``.

The recorded calls return plain causal attention over the T profile tokens (with the window and
softcap), so the forward's output is a real one: ``GenericForCausalLM`` compares its split
backbone + head logits with the HF model's own forward on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.attention.base import AttentionLayerSpec
from hf_paged.models.generic.support import UnsupportedModelError
from hf_paged.models.protocol import KVCacheSpec

# kwargs HF models pass to the attention function that do not change its math here (positions
# and lengths of the flattened batch are ours; flash-attention varlen hints are unused)
_IGNORED_KWARGS = {
    "position_ids", "cache_position", "use_cache", "output_attentions", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "position_embeddings", "layer_idx",
    "output_hidden_states", "return_dict", "past_key_values", "cache", "is_causal",
    "output_router_logits", "logits_to_keep",
}  # fmt: skip
_READ_KWARGS = {"sliding_window", "softcap"}


@dataclass
class LayerRecord:
    module_name: str
    num_calls: int
    spec: AttentionLayerSpec


class Recorder:
    """Collects one ``LayerRecord`` per attention module, in first-call order."""

    def __init__(self, module_names: dict[int, str]):
        self.names = module_names  # id(module) -> qualified name
        self.records: dict[int, LayerRecord] = {}
        self.reasons: list[str] = []

    def refuse(self, name: str, why: str) -> None:
        msg = f"{name}: {why}"
        if msg not in self.reasons:
            self.reasons.append(msg)

    def record(self, module, query, key, value, mask, scaling, dropout, kwargs):
        name = self.names.get(id(module), type(module).__name__)
        rec = self.records.get(id(module))
        if rec is not None:
            rec.num_calls += 1
            self.refuse(name, f"{rec.num_calls} attention calls in one forward (one is served)")
            return _reference(query, key, value, rec.spec), None
        spec = self._spec(name, module, query, key, value, mask, scaling, dropout, kwargs)
        self.records[id(module)] = LayerRecord(name, 1, spec)
        return _reference(query, key, value, spec), None

    def _spec(self, name, module, query, key, value, mask, scaling, dropout, kwargs):
        if query.dim() != 4 or query.shape[0] != 1:
            self.refuse(name, f"query of shape {tuple(query.shape)}, expected [1, H, T, D]")
        if mask is not None:
            self.refuse(name, "the model builds its own attention mask")
        if dropout:
            self.refuse(name, f"attention dropout {dropout}")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            self.refuse(name, "non-causal attention")
        if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
            self.refuse(name, "keys are not the new tokens' own (KV sharing or a memory)")
        if key.shape[-1] != query.shape[-1]:
            self.refuse(name, f"query head dim {query.shape[-1]} != key head dim {key.shape[-1]}")
        if query.shape[1] % key.shape[1]:
            self.refuse(name, f"{query.shape[1]} query heads over {key.shape[1]} KV heads")
        for k, val in kwargs.items():
            if k not in _IGNORED_KWARGS and k not in _READ_KWARGS and val is not None:
                what = "attention sinks" if k in ("s_aux", "sinks") else "an attention input"
                self.refuse(name, f"{what} the paged backends do not implement ({k}=...)")
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        dim, dim_v = query.shape[-1], value.shape[-1]
        return AttentionLayerSpec(
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=dim,
            scale=float(scaling) if scaling is not None else dim**-0.5,
            sliding_window=int(window) if window else None,
            head_dim_v=dim_v if dim_v != dim else None,
            softcap=float(softcap) if softcap else None,
        )

    def result(self) -> list[LayerRecord]:
        """The records in call order. Raises UnsupportedModelError with every reason found."""
        if not self.records:
            self.reasons.append("no attention call reached hf_paged's attention function")
        if self.reasons:
            raise UnsupportedModelError("; ".join(self.reasons))
        return list(self.records.values())


def kv_cache_spec(spec: AttentionLayerSpec) -> KVCacheSpec:
    return KVCacheSpec(
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v or spec.head_dim,
        sliding_window=spec.sliding_window,
    )


def _reference(query, key, value, spec: AttentionLayerSpec) -> torch.Tensor:
    """Causal attention over the T tokens of one sequence: [1, H, T, D] -> [1, T, H, Dv]."""
    q, k, v = query[0].float(), key[0].float(), value[0].float()
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    t = q.shape[1]
    pos = torch.arange(t, device=q.device)
    mask = pos[None, :] <= pos[:, None]  # [Tq, Tk]
    if spec.sliding_window is not None:
        mask &= (pos[:, None] - pos[None, :]) < spec.sliding_window
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v).transpose(0, 1).unsqueeze(0).to(query.dtype).contiguous()
