"""Paged prefill attention over a ragged batch (Triton kernel + torch reference).

Sequence ``i`` has ``q_len_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` new queries at positions
``[context_lens[i] - q_len_i, context_lens[i])`` and reads all its keys from the paged cache, so
one kernel serves plain prefill, prefill over a prefix-cached prompt and chunked prefill. The new
tokens' K/V must already be in the cache (``store_kvcache`` first).

Grid: ``(cdiv(max_seqlen_q, BLOCK_Q), num_kv_heads, num_seqs)``. A program's ``BLOCK_M`` rows are
``BLOCK_Q`` query tokens x ``BLOCK_G`` query heads of one kv head (row ``r`` = token
``r // BLOCK_G``, head ``r % BLOCK_G``), so each KV tile feeds the whole GQA group. Key tiles are
visited in three runs: a masked run at the lower sliding-window edge, an unmasked run of tiles
every row sees in full (no mask math, no load masks), and a masked run on the causal diagonal.
With ``query_key_ends`` (bidirectional ranges, ``attention/bidirectional.py``) each query sees
keys below its own end instead of through its own position, and the diagonal run reaches the
largest end among the program's rows.
Score softcap, ALiBi, attention sinks (the running max starts at the sink, the running sum at
1), head dims that are not powers of 2 and a V head dim != K's are compile-time options
(``attention_common.py``).
"""

from __future__ import annotations

import torch

from hf_paged.kernels.attention.attention_common import (
    LOG2E,
    check_attention_inputs,
    dim_args,
    score_args,
)
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the reference is usable
    triton = None


def paged_prefill_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    query_key_ends: torch.Tensor | None = None,  # [num_tokens] int32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim_v], q.dtype
    """Torch reference of :func:`paged_prefill` without score modifiers (fp32 math, one sequence
    at a time); with softcap / ALiBi / sinks the oracle is ``attention.torch_ref``."""
    key_ends = None if query_key_ends is None else query_key_ends.tolist()
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = q.new_zeros(*q.shape[:2], v_cache.shape[-1])  # [num_tokens, num_heads, head_dim_v]
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        q_len = cu[i + 1] - cu[i]
        if q_len == 0:
            continue
        blocks = block_tables[i, : -(-ctx // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        qi = q[cu[i] : cu[i + 1]].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if key_ends is not None:
            ends = torch.tensor(key_ends[cu[i] : cu[i + 1]], device=q.device)[:, None]
            visible = k_pos < ends
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


if triton is not None:
    from hf_paged.kernels.attention.attention_common import load_tile, per_head_log2, scores_log2
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _attend_tile(
        acc,
        l_i,
        m_i,
        q,
        q_pos,  # [BLOCK_M] query positions
        key_end,  # [BLOCK_M] one past the last key each row sees (q_pos + 1 when causal)
        slope,  # [BLOCK_M] ALiBi slope * log2(e) per row (read only with ALIBI)
        tile_start,
        k_hi,  # keys >= k_hi are past every query of this program
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head_off,
        v_head_off,
        stride_cb,
        stride_cs,
        stride_vb,
        stride_vs,
        scale_log2,
        softcap_scale,
        softcap_log2,
        MASK: tl.constexpr,
        WINDOW: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM_V: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        SEPARATE_V: tl.constexpr,
        SOFTCAP: tl.constexpr,
        ALIBI: tl.constexpr,
        TANH_LIBDEVICE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        k_pos = tile_start + tl.arange(0, TILE_N)
        k_ok = k_pos < k_hi
        if MASK:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        kv_off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
        k = load_tile(
            k_cache_ptr + kv_off[None, :] + d[:, None],
            k_ok[None, :],
            (d < HEAD_DIM)[:, None],
            MASK,
            BLOCK_D != HEAD_DIM,
        ).to(q.dtype)  # [D, TILE_N]; an fp8 cache (scale 1.0) is read in q's dtype
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N]
        rel = (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        s = scores_log2(qk, rel, slope, scale_log2, softcap_scale, softcap_log2, SOFTCAP, ALIBI,
                        TANH_LIBDEVICE)  # fmt: skip
        if MASK:
            visible = (k_pos[None, :] < key_end[:, None]) & k_ok[None, :]
            if WINDOW > 0:
                visible = visible & (q_pos[:, None] - k_pos[None, :] < WINDOW)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = kv_off
        if SEPARATE_V:
            v_off = blk * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs + v_head_off
        v = load_tile(
            v_cache_ptr + v_off[:, None] + dv[None, :],
            k_ok[:, None],
            (dv < HEAD_DIM_V)[None, :],
            MASK,
            BLOCK_DV != HEAD_DIM_V,
        ).to(q.dtype)  # [TILE_N, Dv]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return acc, l_i, m_new

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_tables_ptr,
        cu_seqlens_q_ptr,
        context_lens_ptr,
        key_ends_ptr,  # [num_tokens] int32 key end per query (read only with BIDIR)
        alibi_ptr,  # [num_heads] ALiBi slopes (read only with ALIBI)
        sinks_ptr,  # [num_heads] sink logits (read only with SINKS)
        scale_log2,
        softcap_scale,  # scale / softcap (read only with SOFTCAP)
        softcap_log2,  # softcap * log2(e)
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_vb,  # V-cache strides (read only with SEPARATE_V; else K's)
        stride_vs,
        stride_vh,
        stride_bt,
        WINDOW: tl.constexpr,  # 0 = no sliding window
        BIDIR: tl.constexpr,  # read per-query key ends (bidirectional ranges)
        GROUP: tl.constexpr,  # query heads per kv head
        BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of 2
        BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x BLOCK_G heads
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of 2
        HEAD_DIM_V: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        SEPARATE_V: tl.constexpr,  # V cache strides differ from K's
        SOFTCAP: tl.constexpr,
        ALIBI: tl.constexpr,
        SINKS: tl.constexpr,
        TANH_LIBDEVICE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (last) blocks start first
        kv_head = tl.program_id(1)
        seq = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= q_len:
            return
        ctx = tl.load(context_lens_ptr + seq)

        r = tl.arange(0, BLOCK_M)
        tok = q_block * BLOCK_Q + r // BLOCK_G  # [BLOCK_M] token index within the sequence
        g = r % BLOCK_G
        row_ok = (tok < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        row_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = load_tile(q_ptr + row_off + d[None, :], row_ok[:, None], (d < HEAD_DIM)[None, :],
                      True, BLOCK_D != HEAD_DIM)  # fmt: skip
        q_pos = ctx - q_len + tok  # [BLOCK_M]
        key_end = q_pos + 1  # [BLOCK_M]
        if BIDIR:
            key_end = tl.load(key_ends_ptr + q_start + tok, mask=row_ok, other=0)
            key_end = tl.where(row_ok, key_end, q_pos + 1)
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ALIBI:
            slope = per_head_log2(alibi_ptr, head, row_ok)

        # Key runs (all ends multiples of TILE_N except k_hi): [lo, full_lo) masked,
        # [full_lo, full_hi) seen by every row, [full_hi, k_hi) masked (causal diagonal).
        pos_min = ctx - q_len + q_block * BLOCK_Q
        pos_max = tl.minimum(pos_min + BLOCK_Q, ctx) - 1
        k_hi = pos_max + 1
        if BIDIR:  # a row inside a range sees past the diagonal, up to the range's end
            k_hi = tl.maximum(k_hi, tl.max(tl.where(row_ok, key_end, 0), 0))
        lo = pos_min * 0
        full_lo = lo
        if WINDOW > 0:
            lo = tl.maximum(pos_min - WINDOW + 1, 0) // TILE_N * TILE_N
            full_lo = tl.cdiv(tl.maximum(pos_max - WINDOW + 1, 0), TILE_N) * TILE_N
            full_lo = tl.minimum(full_lo, k_hi)
        full_hi = tl.maximum((pos_min + 1) // TILE_N * TILE_N, full_lo)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if SINKS:  # the sink as one more key: weight exp(sink), no value
            m_i = per_head_log2(sinks_ptr, head, row_ok)
            l_i = l_i + 1.0
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head_off = kv_head.to(tl.int64) * stride_ch
        v_head_off = kv_head.to(tl.int64) * stride_vh
        for start in range(lo, full_lo, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, key_end, slope, start, k_hi, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head_off, v_head_off, stride_cb, stride_cs, stride_vb, stride_vs, scale_log2,
                softcap_scale, softcap_log2, True, WINDOW, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                BLOCK_DV, SEPARATE_V, SOFTCAP, ALIBI, TANH_LIBDEVICE, BLOCK_SIZE, TILE_N,
                DOT_PRECISION,
            )  # fmt: skip
        for start in range(full_lo, full_hi, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, key_end, slope, start, k_hi, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head_off, v_head_off, stride_cb, stride_cs, stride_vb, stride_vs, scale_log2,
                softcap_scale, softcap_log2, False, WINDOW, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                BLOCK_DV, SEPARATE_V, SOFTCAP, ALIBI, TANH_LIBDEVICE, BLOCK_SIZE, TILE_N,
                DOT_PRECISION,
            )  # fmt: skip
        for start in range(full_hi, k_hi, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, key_end, slope, start, k_hi, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head_off, v_head_off, stride_cb, stride_cs, stride_vb, stride_vs, scale_log2,
                softcap_scale, softcap_log2, True, WINDOW, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                BLOCK_DV, SEPARATE_V, SOFTCAP, ALIBI, TANH_LIBDEVICE, BLOCK_SIZE, TILE_N,
                DOT_PRECISION,
            )  # fmt: skip

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        dv = tl.arange(0, BLOCK_DV)
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        if BLOCK_DV != HEAD_DIM_V:
            o_mask = row_ok[:, None] & (dv < HEAD_DIM_V)[None, :]
        else:
            o_mask = row_ok[:, None]
        tl.store(out_ptr + o_off + dv[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)


def _prefill_config(block_d: int, dtype: torch.dtype) -> dict:
    # H200 sweep, bf16 (evaluation/bench_kernels.py --sweep): d=128 -> 222 TFLOP/s on W1-like
    # prompts, 322 on 512-token chunks over 1536 cached; d=64 -> 229 / 309. Padded dims of 256
    # (Gemma2's 256, MLA's 192) take 64-row tiles so the fp32 accumulator stays in registers.
    if dtype == torch.float32:
        if block_d > 128:
            return dict(BLOCK_M=64, TILE_N=16, num_warps=4, num_stages=2)
        return dict(BLOCK_M=64, TILE_N=32, num_warps=4, num_stages=2)
    if block_d > 128:
        return dict(BLOCK_M=64, TILE_N=32, num_warps=8, num_stages=2)
    if block_d >= 128:
        return dict(BLOCK_M=128, TILE_N=32, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, TILE_N=64, num_warps=4, num_stages=2)


def paged_prefill(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    max_seqlen_q: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    sinks: torch.Tensor | None = None,  # [num_heads] float
    query_key_ends: torch.Tensor | None = None,  # [num_tokens] int32
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim_v]
    """Causal attention of a ragged batch of new queries over their paged KV cache.

    Query ``j`` of sequence ``i`` sits at ``context_lens[i] - q_len_i + j`` and sees keys at
    positions ``<=`` its own (and ``> pos - sliding_window`` when set). ``max_seqlen_q`` must be
    ``>= max(q_len_i)`` (it sizes the grid). Tokens not covered by ``cu_seqlens_q`` are not
    written in ``out``. ``softcap`` / ``alibi_slopes`` / ``sinks`` as in :func:`paged_decode`.
    With ``query_key_ends`` (``attention/bidirectional.py``) query ``t`` sees keys below
    ``query_key_ends[t]`` instead (never past its sequence's context), still within the window.
    ``config`` overrides ``BLOCK_M`` / ``TILE_N`` / ``num_warps`` / ``num_stages`` (benchmarks).

    Raises:
        ValueError: on unsupported head dims / dtype or mismatched shapes.
    """
    num_tokens, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_attention_inputs(q, k_cache, v_cache)
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 entries, block_tables num_seqs rows")
    if query_key_ends is not None and query_key_ends.shape != (num_tokens,):
        raise ValueError(
            f"query_key_ends of shape {tuple(query_key_ends.shape)} is not allowed: must be "
            f"[num_tokens] = [{num_tokens}]"
        )
    v_strides, dims = dim_args(q, k_cache, v_cache)
    mod_args, mods = score_args(q, scale, softcap, alibi_slopes, sinks)
    if out is None:
        out = q.new_empty(num_tokens, num_heads, dims["HEAD_DIM_V"])
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    cfg = {**_prefill_config(max(dims["BLOCK_D"], dims["BLOCK_DV"]), q.dtype), **(config or {})}
    if block_g > cfg["BLOCK_M"]:
        raise ValueError(f"GQA group {group} larger than the {cfg['BLOCK_M']}-row tile")
    block_q = cfg["BLOCK_M"] // block_g
    grid = (triton.cdiv(max_seqlen_q, block_q), num_kv_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        cu_seqlens_q if query_key_ends is None else query_key_ends,  # unread without BIDIR
        mod_args[0], mod_args[1], scale * LOG2E, mod_args[2], mod_args[3],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_strides,
        block_tables.stride(0),
        WINDOW=sliding_window or 0,
        BIDIR=query_key_ends is not None,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **dims,
        **mods,
        **cfg,
        **pdl_kwargs(q),
    )  # fmt: skip
    return out
