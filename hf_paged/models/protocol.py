"""The model protocol: what the ModelRunner needs from a model path, and the KV cache it owns.

Provisional copy of the contract (``/work/briefs/protocol.md``); the "protocol" branch owns the
definitive module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from hf_paged.attention.base import AttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's KV cache on this rank."""

    num_kv_heads: int  # on this rank
    head_dim: int  # K head dim
    head_dim_v: int  # V head dim (MLA's naive form: K 192, V 128)
    sliding_window: int | None  # informational (cache still keeps every token)


class KVCache:
    """Owned by the ModelRunner. ``kv_cache[layer] -> (k_cache, v_cache)``, shapes
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` / ``[..., head_dim_v]``. One block id
    addresses the same tokens in every layer. Layers with equal specs share one allocation."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, dtype, device):
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._layers: list[tuple[Tensor, Tensor]] = [None] * len(specs)  # type: ignore[list-item]
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(specs):
            groups.setdefault((s.num_kv_heads, s.head_dim, s.head_dim_v), []).append(i)
        for (heads, d, dv), layers in groups.items():
            n = len(layers)
            if d == dv:  # one tensor [2, n, nb, bs, H, D], like a uniform model's
                kv = torch.zeros(2, n, num_blocks, block_size, heads, d, dtype=dtype, device=device)
                k_all, v_all = kv[0], kv[1]
            else:
                k_all = torch.zeros(n, num_blocks, block_size, heads, d, dtype=dtype, device=device)
                v_all = torch.zeros(
                    n, num_blocks, block_size, heads, dv, dtype=dtype, device=device
                )
            for j, layer in enumerate(layers):
                self._layers[layer] = (k_all[j], v_all[j])

    @staticmethod
    def block_bytes(specs: list[KVCacheSpec], block_size: int, dtype) -> int:
        """Bytes one block takes over every layer, K and V."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return sum(block_size * s.num_kv_heads * (s.head_dim + s.head_dim_v) * elem for s in specs)

    def __getitem__(self, layer: int) -> tuple[Tensor, Tensor]:
        return self._layers[layer]

    def __len__(self) -> int:
        return len(self._layers)

    def release(self) -> None:
        self._layers = []


@runtime_checkable
class PagedModel(Protocol):
    """What the ModelRunner needs from a model path; the engine touches nothing else."""

    kv_cache_specs: list[KVCacheSpec]
    supports_cuda_graph: bool

    def load_weights(self, source) -> None: ...

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor: ...

    def compute_logits(self, hidden: Tensor) -> Tensor | None: ...
