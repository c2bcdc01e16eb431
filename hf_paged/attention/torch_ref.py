"""Reference attention backend: write K/V into the paged cache, gather each sequence's pages and
run SDPA with an explicit causal (and sliding-window) mask. Correct for every case (prefill,
prefill over a cached prefix, chunked prefill, decode, mixed); serves the CPU and is the oracle
the GPU kernels are tested against. Loops over sequences on the host, so it is not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from hf_paged.kernels.kv_store import store_kvcache_ref


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence: [context_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:context_len]


def causal_mask(
    q_len: int, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, context_len] bool, True = attend. Query j sits at position context_len-q_len+j."""
    q_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


class TorchRefBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graph = False

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        cu = meta.cu_seqlens_q_cpu or meta.cu_seqlens_q.tolist()
        ctx = meta.context_lens_cpu or meta.context_lens.tolist()
        dv = v.shape[-1]
        out = q.new_empty(q.shape[0], q.shape[1], dv)
        group = spec.num_heads // spec.num_kv_heads
        for i in range(meta.num_seqs):
            s, e = cu[i], cu[i + 1]
            if e == s:
                continue
            if ctx[i] == e - s:  # nothing cached before this chunk: use k/v as computed
                keys, vals = k[s:e], v[s:e]
            else:
                keys = gather_kv(k_cache, meta.block_tables[i], ctx[i]).to(q.dtype)
                vals = gather_kv(v_cache, meta.block_tables[i], ctx[i]).to(q.dtype)
            if group > 1:  # GQA: each kv head serves `group` consecutive q heads
                keys = keys.repeat_interleave(group, dim=1)
                vals = vals.repeat_interleave(group, dim=1)
            mask = causal_mask(e - s, ctx[i], spec.sliding_window, q.device)
            qs, ks, vs = q[s:e].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1)
            if spec.softcap is None:  # [H, q_len, D] x [H, ctx, D] -> [H, q_len, Dv]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=spec.scale)
            else:
                o = softcapped_attention(qs, ks, vs, mask, spec.scale, spec.softcap)
            out[s:e] = o.transpose(0, 1)
        return out


def softcapped_attention(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma2's score capping: s = c * tanh(s / c), then mask and softmax.
    q [H, Tq, D], k [H, Tk, D], v [H, Tk, Dv], mask [Tq, Tk] bool -> [H, Tq, Dv]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)
