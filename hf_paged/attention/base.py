"""Attention backend interface and the per-forward metadata it reads.

A forward pass covers a ragged batch: sequence i contributes ``q_len_i`` new tokens (a whole
prompt, a prefill chunk over cached tokens, or one decode token) that sit at positions
``[context_len_i - q_len_i, context_len_i)``. Their K/V are first written into the paged cache at
``slot_mapping``; then every new query attends causally to all ``context_len_i`` cached keys of
its sequence (limited to the last ``sliding_window`` keys when the layer has one).

KV cache layout per layer: ``k_cache``, ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token t of a sequence lives in block
``block_tables[i, t // block_size]`` at offset ``t % block_size``; its flat slot is
``block_id * block_size + offset``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-forward batch layout, built by the ModelRunner and passed down explicitly."""

    is_decode: bool  # every sequence has q_len == 1
    num_seqs: int
    slot_mapping: torch.Tensor  # [num_tokens] int64; flat cache slot per new token, -1 = skip
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32; query token offsets
    context_lens: torch.Tensor  # [num_seqs] int32; cached + new tokens per sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32; padded with 0
    max_seqlen_q: int
    max_context_len: int
    # host copies of cu_seqlens_q / context_lens (reference backend loops over them)
    cu_seqlens_q_cpu: list[int] | None = None
    context_lens_cpu: list[int] | None = None
    # the paged KV cache (hf_paged.models.protocol.KVCache); layer i reads kv_cache[i]
    kv_cache: object | None = None


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static facts of one attention layer."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # kv heads on this rank
    head_dim: int
    scale: float
    sliding_window: int | None = None  # attend to keys with q_pos - k_pos < sliding_window
    head_dim_v: int | None = None  # V head dim; None = head_dim
    softcap: float | None = None  # scores = softcap * tanh(scores / softcap) before masking


class AttentionBackend(ABC):
    """Computes paged attention for one layer. Stateless apart from what ``__init__`` caches.

    ``forward`` must: (1) write ``k``/``v`` into the caches at ``meta.slot_mapping`` (skipping
    -1) unless ``kv_stored`` says a fused kernel already did (only offered to backends with
    ``accepts_stored_kv``), (2) return the attention output for every query token. Safe to call inside CUDA-graph
    capture when ``meta.is_decode`` (backends that cannot say so via ``supports_cuda_graph``).
    """

    name: str = "base"
    supports_cuda_graph: bool = False
    accepts_stored_kv: bool = False  # may the model write the KV cache before ``forward``?

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
