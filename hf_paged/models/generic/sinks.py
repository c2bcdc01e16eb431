"""Paged attention with attention sinks (GPT-OSS's ``s_aux``): one learned logit per head that
joins every query's softmax and takes probability mass without contributing a value.

out = sum_j p_j v_j with p = softmax([s_1 .. s_n, sink])[:n], as transformers' eager attention
computes it. The paged backends have no sink input, so these layers run this torch path (the
KV cache is read page by page, like the torch reference backend); decode then runs eagerly.
"""

from __future__ import annotations

import torch

from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.torch_ref import causal_mask, gather_kv
from hf_paged.kernels.kv_store import store_kvcache_ref


def sink_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    sinks: torch.Tensor,  # [H] one logit per query head
    meta: AttentionMetadata,
    layer: int,
    spec: AttentionLayerSpec,
) -> torch.Tensor:  # [T, H, Dv]
    if meta.kv_cache is None:
        raise ValueError("attention with sinks needs the paged KV cache")
    k_cache, v_cache = meta.kv_cache[layer]
    store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    cu = meta.cu_seqlens_q_cpu or meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens_cpu or meta.context_lens.tolist()
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    group = spec.num_heads // spec.num_kv_heads
    for i in range(meta.num_seqs):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        keys = gather_kv(k_cache, meta.block_tables[i], ctx[i]).to(q.dtype)  # [ctx, Hkv, D]
        vals = gather_kv(v_cache, meta.block_tables[i], ctx[i]).to(q.dtype)
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], keys) * spec.scale  # [H, q_len, ctx]
        if spec.softcap is not None:
            scores = spec.softcap * torch.tanh(scores / spec.softcap)
        mask = causal_mask(e - s, ctx[i], spec.sliding_window, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, e - s, 1)  # [H, q_len, 1]
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :-1]  # [H, q_len, ctx]
        out[s:e] = torch.einsum("hqk,khd->qhd", probs.to(vals.dtype), vals)
    return out
