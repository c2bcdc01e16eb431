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
"""

from __future__ import annotations

import torch

from hf_paged.kernels.paged_decode import LOG2E, check_attention_inputs
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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q.dtype
    """Torch reference of :func:`paged_prefill` (fp32 math, one sequence at a time)."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
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
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _attend_tile(
        acc,
        l_i,
        m_i,
        q,
        q_pos,  # [BLOCK_M] query positions
        tile_start,
        k_hi,  # keys >= k_hi are past every query of this program
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head_off,
        stride_cb,
        stride_cs,
        scale_log2,
        MASK: tl.constexpr,
        WINDOW: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        d = tl.arange(0, HEAD_DIM)
        k_pos = tile_start + tl.arange(0, TILE_N)
        if MASK:
            k_ok = k_pos < k_hi
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
        kv_off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
        if MASK:
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=k_ok[None, :], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None])  # [D, TILE_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if MASK:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            if WINDOW > 0:
                visible = visible & (q_pos[:, None] - k_pos[None, :] < WINDOW)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
        else:
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :])  # [TILE_N, D]
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
        scale_log2,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_bt,
        WINDOW: tl.constexpr,  # 0 = no sliding window
        GROUP: tl.constexpr,  # query heads per kv head
        BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of 2
        BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x BLOCK_G heads
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
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
        d = tl.arange(0, HEAD_DIM)
        row_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + row_off + d[None, :], mask=row_ok[:, None], other=0.0)
        q_pos = ctx - q_len + tok  # [BLOCK_M]

        # Key runs (all ends multiples of TILE_N except k_hi): [lo, full_lo) masked,
        # [full_lo, full_hi) seen by every row, [full_hi, k_hi) masked (causal diagonal).
        pos_min = ctx - q_len + q_block * BLOCK_Q
        pos_max = tl.minimum(pos_min + BLOCK_Q, ctx) - 1
        k_hi = pos_max + 1
        lo = pos_min * 0
        full_lo = lo
        if WINDOW > 0:
            lo = tl.maximum(pos_min - WINDOW + 1, 0) // TILE_N * TILE_N
            full_lo = tl.cdiv(tl.maximum(pos_max - WINDOW + 1, 0), TILE_N) * TILE_N
            full_lo = tl.minimum(full_lo, k_hi)
        full_hi = tl.maximum((pos_min + 1) // TILE_N * TILE_N, full_lo)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head_off = kv_head.to(tl.int64) * stride_ch
        for start in range(lo, full_lo, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start, k_hi, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head_off, stride_cb, stride_cs, scale_log2, True, WINDOW, HEAD_DIM,
                BLOCK_SIZE, TILE_N, DOT_PRECISION,
            )  # fmt: skip
        for start in range(full_lo, full_hi, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start, k_hi, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head_off, stride_cb, stride_cs, scale_log2, False, WINDOW, HEAD_DIM,
                BLOCK_SIZE, TILE_N, DOT_PRECISION,
            )  # fmt: skip
        for start in range(full_hi, k_hi, TILE_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, start, k_hi, k_cache_ptr, v_cache_ptr, bt_row,
                kv_head_off, stride_cb, stride_cs, scale_log2, True, WINDOW, HEAD_DIM,
                BLOCK_SIZE, TILE_N, DOT_PRECISION,
            )  # fmt: skip

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptr + o_off + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    # H200 sweep, bf16 (evaluation/bench_kernels.py --sweep): d=128 -> 222 TFLOP/s on W1-like
    # prompts, 322 on 512-token chunks over 1536 cached; d=64 -> 229 / 309.
    if dtype == torch.float32:
        return dict(BLOCK_M=64, TILE_N=32, num_warps=4, num_stages=2)
    if head_dim >= 128:
        return dict(BLOCK_M=128, TILE_N=32, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, TILE_N=64, num_warps=4, num_stages=2)


def paged_prefill(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    max_seqlen_q: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a ragged batch of new queries over their paged KV cache.

    Query ``j`` of sequence ``i`` sits at ``context_lens[i] - q_len_i + j`` and sees keys at
    positions ``<=`` its own (and ``> pos - sliding_window`` when set). ``max_seqlen_q`` must be
    ``>= max(q_len_i)`` (it sizes the grid). Tokens not covered by ``cu_seqlens_q`` are not
    written in ``out``. ``config`` overrides ``BLOCK_M`` / ``TILE_N`` / ``num_warps`` /
    ``num_stages`` (benchmarks).

    Raises:
        ValueError: on unsupported head_dim / dtype or mismatched shapes.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_attention_inputs(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, cache_head_dim)
    num_seqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError("cu_seqlens_q must have num_seqs + 1 entries, block_tables num_seqs rows")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or max_seqlen_q == 0:
        return out
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    cfg = {**_prefill_config(head_dim, q.dtype), **(config or {})}
    if block_g > cfg["BLOCK_M"]:
        raise ValueError(f"GQA group {group} larger than the {cfg['BLOCK_M']}-row tile")
    block_q = cfg["BLOCK_M"] // block_g
    grid = (triton.cdiv(max_seqlen_q, block_q), num_kv_heads, num_seqs)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        WINDOW=sliding_window or 0,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
        **pdl_kwargs(q),
    )
    return out
