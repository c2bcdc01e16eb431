"""Reference attention backend: write K/V into the paged cache, gather each sequence's pages and
run SDPA with an explicit causal mask (OR'd with the sequence's bidirectional ranges, then AND'd
with the sliding window, as stock's Gemma 3 masks are built). Correct for every case (prefill,
prefill over a cached prefix, chunked prefill, decode, mixed); serves the CPU and is the oracle
the GPU kernels are tested against. Loops over sequences on the host, so it is not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from hf_paged.kernels.attention.kv_store import store_kvcache_ref


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence: [context_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:context_len]


def causal_mask(
    q_len: int,
    context_len: int,
    sliding_window: int | None,
    device: torch.device,
    bidirectional_ranges: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """[q_len, context_len] bool, True = attend. Query j sits at position context_len-q_len+j.

    ``AND(window, OR(causal, same range))``: a query and a key inside one bidirectional range
    ``[start, end)`` see each other whatever their order; the window bounds both."""
    q_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    for start, end in bidirectional_ranges or ():
        mask |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def alibi_bias(
    slopes: tuple[float, ...], q_len: int, context_len: int, device: torch.device
) -> torch.Tensor:  # [H, q_len, context_len] fp32
    """``slope_h * (k_pos - q_pos)``; query j sits at position ``context_len - q_len + j``."""
    q_pos = torch.arange(context_len - q_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    rel = (k_pos - q_pos).float()  # [q_len, ctx]
    return torch.tensor(slopes, dtype=torch.float32, device=device).view(-1, 1, 1) * rel


def attend(
    q: torch.Tensor,  # [H, q_len, D]
    keys: torch.Tensor,  # [H, ctx, D]
    vals: torch.Tensor,  # [H, ctx, Dv]
    mask: torch.Tensor,  # [q_len, ctx] bool, True = attend
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [H] one logit per head (GPT-OSS's ``s_aux``)
    alibi_slopes: tuple[float, ...] | None = None,  # [H] ALiBi slope per head
) -> torch.Tensor:  # [H, q_len, Dv]
    """Masked softmax attention; with ``softcap`` the scores are ``c * tanh(s / c)`` first,
    then ALiBi adds ``slope_h * (k_pos - q_pos)`` (queries are the last ``q_len`` of ``ctx``
    positions). A sink logit joins each query's softmax and takes probability mass without a
    value: ``p = softmax([s_1 .. s_n, sink])[:n]``, as transformers' eager attention computes it."""
    if softcap is None and sinks is None and alibi_slopes is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [H, q_len, ctx]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q.shape[1], keys.shape[1], scores.device)
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)  # [H, q_len, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(vals.dtype), vals)


class TorchRefBackend(AttentionBackend):
    """Every layer spec (GQA, sliding window, softcap, ALiBi, V head dim != K head dim) and
    bidirectional ranges; host loop."""

    name = "torch"
    supports_cuda_graph = False
    accepts_sinks = True
    accepts_bidirectional = True

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        kv_stored: bool = False,
        sinks: torch.Tensor | None = None,  # [H]: attention sinks
    ) -> torch.Tensor:  # [T, H, Dv]
        has_cache = k_cache is not None and v_cache is not None
        if has_cache and not kv_stored:
            store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        cu = meta.cu_seqlens_q_cpu or meta.cu_seqlens_q.tolist()
        ctx = meta.context_lens_cpu or meta.context_lens.tolist()
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        group = spec.num_heads // spec.num_kv_heads
        for i in range(meta.num_seqs):
            s, e = cu[i], cu[i + 1]
            if e == s:
                continue
            if ctx[i] == e - s:  # nothing cached before this chunk: use k/v as computed
                keys, vals = k[s:e], v[s:e]
            elif not has_cache:
                raise ValueError(
                    f"sequence {i} has {ctx[i] - (e - s)} cached tokens but meta.kv_cache is "
                    "None: without a cache only whole prompts can be attended"
                )
            else:
                keys = gather_kv(k_cache, meta.block_tables[i], ctx[i]).to(q.dtype)
                vals = gather_kv(v_cache, meta.block_tables[i], ctx[i]).to(q.dtype)
            if group > 1:  # GQA: each kv head serves `group` consecutive q heads
                keys = keys.repeat_interleave(group, dim=1)
                vals = vals.repeat_interleave(group, dim=1)
            ranges = None
            if meta.bidirectional_ranges and spec.bidirectional:
                ranges = meta.bidirectional_ranges[i]
            mask = causal_mask(e - s, ctx[i], spec.sliding_window, q.device, ranges)
            o = attend(
                q[s:e].transpose(0, 1),  # [H, q_len, D]
                keys.transpose(0, 1),  # [H, ctx, D]
                vals.transpose(0, 1),  # [H, ctx, Dv]
                mask,
                spec.scale,
                spec.softcap,
                sinks,
                spec.alibi_slopes,
            )
            out[s:e] = o.transpose(0, 1)
        return out
