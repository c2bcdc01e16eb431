"""The model protocol: what the engine needs from a model path.

A model path (the native decoders in ``models/llama.py``, or the generic path over HF's own
modules) implements :class:`PagedModel`; the ModelRunner touches nothing else. The runner sizes
and allocates a :class:`KVCache` from ``model.kv_cache_specs`` and passes it to every forward in
``AttentionMetadata.kv_cache``; an attention layer with KV layer index ``i`` reads
``meta.kv_cache[i]``. Nothing is hung on modules.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hf_paged.attention.base import AttentionMetadata
from hf_paged.attention.kv_cache import KVCacheSpec


class UnsupportedModelError(ValueError):
    """A model path cannot reproduce this model exactly; the message says why (the integration
    turns it into a named fallback to stock)."""


@runtime_checkable
class PagedModel(Protocol):
    """What the ModelRunner needs from a model path; the engine touches nothing else.

    Attributes:
        kv_cache_specs: one ``KVCacheSpec`` per KV layer index 0..L-1, on this rank, known after
            construction (the generic path: after its profile pass).
        supports_cuda_graph: False makes decode run eagerly (the runner checks it); a reason
            string may live in ``cuda_graph_reason``.

    Optional: ``refresh_weights(weights, dry_run=False) -> int`` copies ``(HF name, full
    tensor)`` pairs into the tensors ``load_weights`` fills from those names (this rank's part),
    in place (``dry_run``: raises ValueError for a bad pair, writes nothing); a model without it
    is rebuilt when an in-memory source's weights change.

    Calls the runner makes, in order: ``load_weights`` once; ``forward`` + ``compute_logits``
    for warm-up, CUDA-graph capture (decode only, when ``supports_cuda_graph``) and every step.
    ``forward`` must read the KV cache only through ``meta.kv_cache`` and must not sync the host
    when ``meta.is_decode`` and CUDA graphs are on.
    """

    kv_cache_specs: list[KVCacheSpec]
    supports_cuda_graph: bool

    def load_weights(self, source) -> None:
        """Fill the parameters from a checkpoint dir (str/Path) or an in-memory HF model
        (sharing storage where layouts allow). Raises ValueError for missing/unexpected
        weights."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, flattened ragged batch
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        embeds=None,
    ) -> torch.Tensor:  # hidden [T, H]
        """Hidden states of a step. ``embeds`` (a ``StepEmbeds``, prefill steps only) holds
        rows to feed instead of the embeddings of some ids (``embeds.scatter``); the runner
        passes it only when a chunk has prompt embeddings. ``positions`` is ``[3, T]`` on an
        M-RoPE model's prefill steps with multimodal positions."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, H] -> [N, V] logits on rank 0; None on other tensor-parallel ranks."""
        ...
