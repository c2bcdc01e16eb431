"""Paged attention with attention sinks (GPT-OSS's ``s_aux``): one learned logit per head that
joins every query's softmax and takes probability mass without contributing a value.

out = sum_j p_j v_j with p = softmax([s_1 .. s_n, sink])[:n], as transformers' eager attention
computes it. The layer's own backend computes it when it takes sinks (``accepts_sinks``: the
Triton kernels, graph-safe, and the torch reference); any other backend hands these layers to
the torch reference, whose decode then runs eagerly.
"""

from __future__ import annotations

import torch

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.torch_ref import TorchRefBackend

_REFERENCE = TorchRefBackend()


def sink_backend(backend: AttentionBackend) -> AttentionBackend:
    """The backend that runs a sink layer served by ``backend``."""
    return backend if backend.accepts_sinks else _REFERENCE


def sink_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    sinks: torch.Tensor,  # [H] one logit per query head
    meta: AttentionMetadata,
    layer: int,
    spec: AttentionLayerSpec,
    backend: AttentionBackend = _REFERENCE,  # the layer's backend
) -> torch.Tensor:  # [T, H, Dv]
    if meta.kv_cache is None:
        raise ValueError("attention with sinks needs the paged KV cache")
    k_cache, v_cache = meta.kv_cache[layer]
    return sink_backend(backend).forward(q, k, v, k_cache, v_cache, meta, spec, sinks=sinks)
