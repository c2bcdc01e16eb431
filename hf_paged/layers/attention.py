"""Paged attention layer: applies rope (fused with the KV-cache store when it can), reads its
layer's KV cache from the step's metadata and hands the math to its backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.layers.context import ModelContext
from hf_paged.layers.layernorm import RMSNorm
from hf_paged.layers.rotary import apply_rotary_emb_qk

_REFERENCE = TorchRefBackend()


@dataclass
class RopeInputs:
    """What the layer needs to rotate q and k itself: cos/sin [T, head_dim] and, for models
    with per-head q/k norms applied before rope (Qwen3), both norms."""

    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor  # [T, head_dim]
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None


class Attention(nn.Module):
    """One layer's attention over the paged KV cache.

    The cache is not held here: each forward reads ``meta.kv_cache[layer_idx]`` (the runner's
    ``KVCache``); ``meta.kv_cache is None`` means no cache yet, and then only whole prompts can
    be attended. With ``rope`` given the layer rotates q and k itself, and when the backend lets
    a kernel write the cache (``accepts_stored_kv``) the rotary kernel stores k and v in the
    same launch; model code never deals with that choice.

    Args:
        spec: this layer's static facts (heads on this rank, head dims, scale, window, softcap).
        ctx: the model context; ``ctx.backend_for`` picks the backend that can compute ``spec``.
        layer_idx: this layer's KV layer index (0..L-1, the index into ``meta.kv_cache``).
    """

    def __init__(self, spec: AttentionLayerSpec, ctx: ModelContext, layer_idx: int):
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.backend = ctx.backend_for(layer_idx, spec)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim] or [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads * head_dim_v] or [T, num_kv_heads, head_dim_v]
        meta: AttentionMetadata,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:  # [T, num_heads * head_dim_v]
        """``rope=None``: q and k are already rotated (or the model has no rope)."""
        s = self.spec
        backend = self.backend
        if meta.bidirectional_ranges is not None and s.bidirectional and (
            not backend.accepts_bidirectional
        ):  # a step with bidirectional ranges: the reference takes what the backend cannot
            backend = _REFERENCE
        q = q.reshape(-1, s.num_heads, s.head_dim)
        k = k.reshape(-1, s.num_kv_heads, s.head_dim)
        v = v.reshape(-1, s.num_kv_heads, s.v_head_dim)
        k_cache, v_cache = (None, None) if meta.kv_cache is None else meta.kv_cache[self.layer_idx]
        stored = False
        if rope is not None:
            write = None
            if backend.accepts_stored_kv and k_cache is not None:
                write = (v, k_cache, v_cache, meta.slot_mapping)
            q, k, stored = apply_rotary_emb_qk(
                q, k, rope.cos, rope.sin, rope.q_norm, rope.k_norm, kv_cache=write
            )
        o = backend.forward(q, k, v, k_cache, v_cache, meta, s, kv_stored=stored)
        return o.reshape(-1, s.num_heads * s.v_head_dim)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"layer={self.layer_idx}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, "
            f"head_dim={s.head_dim}, head_dim_v={s.v_head_dim}, "
            f"sliding_window={s.sliding_window}, softcap={s.softcap}, backend={self.backend.name}"
        )
