"""Paged attention layer: holds one layer's KV cache and hands the math to the backend."""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
from hf_paged.models.context import ModelContext


class Attention(nn.Module):
    """One layer's attention over the paged KV cache.

    ``k_cache`` / ``v_cache`` ([num_blocks, block_size, num_kv_heads, head_dim]) are assigned by
    the ModelRunner after it allocates the cache; until then they are empty tensors. They are
    plain attributes, not buffers, so ``state_dict`` and ``.to()`` never touch them.

    Args:
        spec: this layer's static facts (heads on this rank, head_dim, scale, sliding window).
        ctx: the model context; its ``attn_backend`` does the computation.
    """

    def __init__(self, spec: AttentionLayerSpec, ctx: ModelContext):
        super().__init__()
        self.spec = spec
        self.ctx = ctx  # backend read at each forward, so the runner may swap it
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim] or [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """``kv_stored``: k and v are already in the cache (written with the rotary kernel)."""
        s = self.spec
        q = q.reshape(-1, s.num_heads, s.head_dim)
        k = k.reshape(-1, s.num_kv_heads, s.head_dim)
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        backend = self.ctx.attn_backend
        o = backend.forward(q, k, v, self.k_cache, self.v_cache, meta, s, kv_stored=kv_stored)
        return o.reshape(-1, s.num_heads * s.head_dim)

    def kv_cache_write(self, v: torch.Tensor, meta: AttentionMetadata) -> tuple | None:
        """``(v, k_cache, v_cache, slot_mapping)`` for a kernel that can write this layer's new
        K/V into the cache as it makes them; None when the backend stores them itself (the
        torch reference) or there is no cache yet (warm-up)."""
        if not self.ctx.attn_backend.accepts_stored_kv or self.k_cache.numel() == 0:
            return None
        return (v, self.k_cache, self.v_cache, meta.slot_mapping)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}, "
            f"sliding_window={s.sliding_window}, backend={self.ctx.attn_backend.name}"
        )
