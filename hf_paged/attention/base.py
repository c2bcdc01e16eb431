"""Attention backend interface and the per-forward metadata it reads.

A forward pass covers a ragged batch: sequence i contributes ``q_len_i`` new tokens (a whole
prompt, a prefill chunk over cached tokens, or one decode token) that sit at positions
``[context_len_i - q_len_i, context_len_i)``. Their K/V are first written into the paged cache at
``slot_mapping``; then every new query attends causally to all ``context_len_i`` cached keys of
its sequence (limited to the last ``sliding_window`` keys when the layer has one). A sequence
may name bidirectional ranges (Gemma 3's images): a query inside one also sees the keys after it
up to the range's end; the sliding window still bounds how far back it looks.

KV cache layout per layer: ``k_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` and
``v_cache`` ``[..., head_dim_v]``; token t of a sequence lives in block
``block_tables[i, t // block_size]`` at offset ``t % block_size``; its flat slot is
``block_id * block_size + offset``. The ModelRunner owns the caches (a
``hf_paged.attention.kv_cache.KVCache``) and passes them in ``AttentionMetadata.kv_cache``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from hf_paged.attention.kv_cache import KVCache


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
    # the paged caches, indexed by KV layer: kv_cache[i] -> (k_cache, v_cache). None = no cache
    # (a profile pass): attention then covers the new tokens only, with nothing cached before.
    kv_cache: KVCache | None = None
    # models with recurrent layers (``models/recurrent``): each sequence's state-pool slot
    # ([num_seqs] int64, never 0; padded CUDA-graph rows: 0, the dummy), whether the slot holds
    # a state already ([num_seqs] bool: num_computed_tokens > 0), and the pool's tensors per
    # recurrent layer (name -> [num_slots + 1, ...]). None for models without them.
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    recurrent_states: list[dict[str, torch.Tensor]] | None = None
    # bidirectional ranges (``attention/bidirectional.py``): per sequence, the half-open
    # position ranges [start, end) whose tokens attend to each other both ways (an image of
    # Gemma 3); causal elsewhere. Every range that holds a query ends at or before that
    # sequence's context_len. ``query_key_ends`` [num_tokens] int32 is the same on the device,
    # per new query: one past the last key position it sees (its position + 1 outside a range,
    # the range's end inside one). Both None when every query is causal.
    bidirectional_ranges: list[list[tuple[int, int]]] | None = None
    query_key_ends: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static facts of one attention layer."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # kv heads on this rank
    head_dim: int  # of q and k
    scale: float
    sliding_window: int | None = None  # attend to keys with q_pos - k_pos < sliding_window
    head_dim_v: int | None = None  # of v and the output; None = head_dim
    softcap: float | None = None  # scores = softcap * tanh(scores / softcap), before masking
    # ALiBi: scores[h, q, k] += alibi_slopes[h] * (k_pos - q_pos), after softcap, before masking
    # (one slope per query head on this rank; Bloom's slope * k_pos is the same softmax)
    alibi_slopes: tuple[float, ...] | None = None
    # whether the step's bidirectional ranges apply to this layer (Gemma 4 keeps its full
    # layers causal and opens only the sliding ones); False = causal whatever the metadata says
    bidirectional: bool = True

    @property
    def v_head_dim(self) -> int:
        """The V (and output) head dim, resolved."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


class AttentionBackend(ABC):
    """Computes paged attention for one layer. Stateless apart from what ``__init__`` caches.

    ``forward`` must: (1) write ``k``/``v`` into the caches at ``meta.slot_mapping`` (skipping
    -1) unless ``kv_stored`` says a fused kernel already did (only offered to backends with
    ``accepts_stored_kv``), (2) return the attention output for every query token. With
    ``k_cache``/``v_cache`` None (no cache yet) it attends over the new tokens only and raises
    ``ValueError`` if a sequence has cached tokens before them. Safe to call inside CUDA-graph
    capture when ``meta.is_decode`` (backends that cannot say so via ``supports_cuda_graph``).
    ``problem(spec, ...)`` says, before any call, which layers a backend cannot compute (the
    caller then picks another backend for that layer); it never returns wrong output instead.
    A backend with ``accepts_sinks`` also takes ``forward(..., sinks=[num_heads] tensor)``:
    attention sinks, one logit per head that joins the softmax and contributes no value.
    """

    name: str = "base"
    supports_cuda_graph: bool = False
    accepts_stored_kv: bool = False  # may the caller write the KV cache before ``forward``?
    accepts_sinks: bool = False  # does ``forward`` take ``sinks=``?
    # does ``forward`` honor ``meta.bidirectional_ranges`` / ``query_key_ends``? A step with
    # ranges gives the layers of a backend that does not to the torch reference
    accepts_bidirectional: bool = False

    def problem(self, spec: AttentionLayerSpec, dtype: torch.dtype, block_size: int) -> str | None:
        """Why this backend cannot compute a layer of ``spec`` (None = it can)."""
        return None

    def release(self) -> None:  # noqa: B027 - optional hook: most backends keep nothing
        """Drop the device tensors ``forward`` made and kept (the engine is closing)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim_v]
        ...
