"""Paged decode attention: one query token per sequence (Triton kernels + torch reference).

Grid of the main kernel: ``(num_seqs, num_kv_heads, num_partitions)``. One program handles all
``num_heads // num_kv_heads`` query heads that share a kv head (padded to >= 16 rows for
``tl.dot``), so each KV tile is read from HBM once per group. The keys of a sequence
(``[max(0, ctx - sliding_window), ctx)``) are split into ``num_partitions`` equal, tile-aligned
partitions whose length is computed in-kernel from ``context_lens``; ``num_partitions`` itself
depends only on tensor shapes, so the launch is CUDA-graph safe. With more than one partition,
each writes a partial (max, sum, acc) and a reduce kernel merges them (split-K / flash-decoding);
with one partition the main kernel writes the output directly.

Softmax runs in base 2: scores are multiplied by ``scale * log2(e)`` and exponentiated with
``exp2``; partial maxima are kept in that domain. Accumulation is fp32. Score softcap, ALiBi,
attention sinks, head dims that are not powers of 2 and a V head dim != K's are compile-time
options (``attention_common.py``); a sink joins the softmax as one more key of weight
``exp(sink)`` with no value, in the main kernel without split-K and in the reduce with it.
"""

from __future__ import annotations

import functools

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

MIN_PARTITION = 64  # fewest keys a split-K partition covers: one bf16 tile (batch-1 latency)
MAX_PARTITIONS = 64  # bound on the split; keeps the reduce kernel's tile in registers


def paged_decode_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], q.dtype
    """Torch reference of :func:`paged_decode` (fp32 math; sequences with no keys give zeros)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    bt = block_tables[:num_seqs].long()
    # [B, max_blocks * block_size, Hkv, D] -> [B, Hq, Lmax, D]
    k = k_cache[bt].flatten(1, 2).float().repeat_interleave(group, dim=2).transpose(1, 2)
    v = v_cache[bt].flatten(1, 2).float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    pos = torch.arange(k.shape[2], device=q.device)[None, :]  # [1, Lmax]
    ctx = context_lens[:num_seqs].long()[:, None]  # [B, 1]
    visible = pos < ctx
    if sliding_window is not None:
        visible &= pos >= ctx - sliding_window  # q_pos = ctx - 1; q_pos - k_pos < window
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.einsum("bhl,bhld->bhd", probs, v).to(q.dtype)


if triton is not None:
    from hf_paged.kernels.attention.attention_common import load_tile, per_head_log2, scores_log2
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _partition_bounds(
        ctx, NUM_PARTITIONS: tl.constexpr, TILE_N: tl.constexpr, MIN_PART: tl.constexpr, WINDOW
    ):
        # Keys [kv_start, ctx) split into partitions of part_len (a multiple of TILE_N).
        kv_start = ctx * 0
        if WINDOW > 0:
            kv_start = tl.maximum(ctx - WINDOW, 0)
        part_len = tl.cdiv(tl.cdiv(ctx - kv_start, NUM_PARTITIONS), TILE_N) * TILE_N
        part_len = tl.maximum(part_len, MIN_PART)  # MIN_PART is a multiple of TILE_N
        return kv_start, part_len

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        out_ptr,
        part_out_ptr,  # [num_seqs, num_heads, NUM_PARTITIONS, HEAD_DIM_V] fp32
        part_m_ptr,  # [num_seqs, num_heads, NUM_PARTITIONS] fp32 (log2 domain)
        part_l_ptr,  # [num_seqs, num_heads, NUM_PARTITIONS] fp32
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
        num_heads,
        WINDOW: tl.constexpr,  # 0 = no sliding window
        GROUP: tl.constexpr,  # query heads per kv head
        BLOCK_G: tl.constexpr,
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
        NUM_PARTITIONS: tl.constexpr,
        MIN_PART: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        # Before the wait (kernels/pdl.py): the context length comes from the step's metadata
        # copy, not from the kernel right before (which writes q and this token's K/V).
        ctx = tl.load(context_lens_ptr + seq)
        kv_start, part_len = _partition_bounds(ctx, NUM_PARTITIONS, TILE_N, MIN_PART, WINDOW)
        start = kv_start + part * part_len
        end = tl.minimum(start + part_len, ctx)
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        if NUM_PARTITIONS > 1:
            if start >= end:  # empty partition: the reduce kernel never reads it
                return

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        head = kv_head * GROUP + g  # [BLOCK_G]
        g_mask = g < GROUP
        q_off = seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = load_tile(q_ptr + q_off, g_mask[:, None], (d < HEAD_DIM)[None, :], True,
                      BLOCK_D != HEAD_DIM)  # fmt: skip
        slope = tl.zeros([BLOCK_G], dtype=tl.float32)
        if ALIBI:
            slope = per_head_log2(alibi_ptr, head, g_mask)

        # finite init: a fully masked tile then gives p = 0, alpha = 1 instead of NaN
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        if SINKS:
            if NUM_PARTITIONS == 1:  # the sink as one more key: weight exp(sink), no value
                m_i = per_head_log2(sinks_ptr, head, g_mask)
                l_i = l_i + 1.0
        acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head_off = kv_head.to(tl.int64) * stride_ch
        v_head_off = kv_head.to(tl.int64) * stride_vh
        for tile_start in range(start, end, TILE_N):
            k_pos = tile_start + tl.arange(0, TILE_N)
            valid = k_pos < end
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
            k = load_tile(k_cache_ptr + kv_off[None, :] + d[:, None], valid[None, :],
                          (d < HEAD_DIM)[:, None], True, BLOCK_D != HEAD_DIM)  # fmt: skip
            k = k.to(q.dtype)  # an fp8 cache (scale 1.0) is read back in q's dtype; else a no-op
            qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_G, TILE_N]
            rel = (k_pos - (ctx - 1)).to(tl.float32)[None, :]
            s = scores_log2(qk, rel, slope, scale_log2, softcap_scale, softcap_log2,
                            SOFTCAP, ALIBI, TANH_LIBDEVICE)  # fmt: skip
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = kv_off
            if SEPARATE_V:
                v_off = blk * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs + v_head_off
            v = load_tile(v_cache_ptr + v_off[:, None] + dv[None, :], valid[:, None],
                          (dv < HEAD_DIM_V)[None, :], True, BLOCK_DV != HEAD_DIM_V)  # fmt: skip
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        dv_ok = (dv < HEAD_DIM_V)[None, :]
        if NUM_PARTITIONS == 1:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # no keys (padding sequence) -> zeros
            o_off = seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dv[None, :]
            o = acc / l_safe[:, None]
            if BLOCK_DV != HEAD_DIM_V:
                o_mask = g_mask[:, None] & dv_ok
            else:
                o_mask = g_mask[:, None]
            tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            row = (seq.to(tl.int64) * num_heads + head) * NUM_PARTITIONS + part  # [BLOCK_G]
            tl.store(part_m_ptr + row, m_i, mask=g_mask)
            tl.store(part_l_ptr + row, l_i, mask=g_mask)
            part_off = row[:, None] * HEAD_DIM_V + dv[None, :]
            if BLOCK_DV != HEAD_DIM_V:
                tl.store(part_out_ptr + part_off, acc, mask=g_mask[:, None] & dv_ok)
            else:
                tl.store(part_out_ptr + part_off, acc, mask=g_mask[:, None])

    @triton.jit
    def _paged_decode_reduce_kernel(
        out_ptr,
        part_out_ptr,
        part_m_ptr,
        part_l_ptr,
        context_lens_ptr,
        sinks_ptr,  # [num_heads] sink logits (read only with SINKS)
        stride_ot,
        stride_oh,
        num_heads,
        WINDOW: tl.constexpr,
        HEAD_DIM_V: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        SINKS: tl.constexpr,
        TILE_N: tl.constexpr,
        NUM_PARTITIONS: tl.constexpr,
        MIN_PART: tl.constexpr,
        BLOCK_P: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        ctx = tl.load(context_lens_ptr + seq)  # not written by the kernel before: before the wait
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        kv_start, part_len = _partition_bounds(ctx, NUM_PARTITIONS, TILE_N, MIN_PART, WINDOW)
        num_active = tl.cdiv(ctx - kv_start, part_len)  # partitions the main kernel wrote
        p = tl.arange(0, BLOCK_P)
        p_mask = p < num_active
        row = (seq.to(tl.int64) * num_heads + head) * NUM_PARTITIONS + p  # [BLOCK_P]
        m = tl.load(part_m_ptr + row, mask=p_mask, other=float("-inf"))
        l_part = tl.load(part_l_ptr + row, mask=p_mask, other=0.0)
        m_max = tl.maximum(tl.max(m, 0), -1.0e30)  # finite even when no partition is active
        if SINKS:  # the sink joins the denominator here: weight exp(sink), no value
            sink = per_head_log2(sinks_ptr, head, head >= 0)
            m_max = tl.maximum(m_max, sink)
        w = tl.where(p_mask, tl.exp2(m - m_max), 0.0)
        l_sum = tl.sum(w * l_part, 0)
        if SINKS:
            l_sum = l_sum + tl.exp2(sink - m_max)
        d = tl.arange(0, BLOCK_DV)
        d_ok = d < HEAD_DIM_V
        part_ptrs = part_out_ptr + row[:, None] * HEAD_DIM_V + d[None, :]
        if BLOCK_DV != HEAD_DIM_V:
            acc = tl.load(part_ptrs, mask=p_mask[:, None] & d_ok[None, :], other=0.0)
        else:
            acc = tl.load(part_ptrs, mask=p_mask[:, None])
        acc = tl.where(p_mask[:, None], acc, 0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0.0, l_sum, 1.0)  # [BLOCK_DV]
        o_off = seq.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh + d
        if BLOCK_DV != HEAD_DIM_V:
            tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=d_ok)
        else:
            tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_partitions(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Split-K factor from static shapes only (CUDA-graph safe): aim for ~4 programs per SM."""
    if device.type != "cuda":
        return 1
    target = 4 * _sm_count(device.index if device.index is not None else 0)
    want = triton.cdiv(target, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, triton.cdiv(max_context, MIN_PARTITION), MAX_PARTITIONS))


def _decode_config(block_d: int, dtype: torch.dtype) -> dict:
    # Memory-bound: 64-key tiles pipelined 3 deep, 2 warps (more programs resident per SM).
    # H200 sweep (evaluation/bench_kernels.py --sweep, batch 256, ctx ~600, bf16): 4.10 TB/s at
    # d=128 and 3.82 TB/s at d=64, against 3.89 / 3.64 with 4 warps. Padded dims of 256 halve
    # the tile and its pipeline depth so K and V tiles stay within shared memory.
    if dtype == torch.float32:
        return dict(TILE_N=32, num_warps=4, num_stages=2)
    if block_d > 128:
        return dict(TILE_N=32, num_warps=4, num_stages=2)
    return dict(TILE_N=64, num_warps=2, num_stages=3)


def paged_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads] float
    sinks: torch.Tensor | None = None,  # [num_heads] float
    num_partitions: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim_v]
    """Attention of one new query token per sequence over its paged KV cache.

    Sequence ``i``'s query sits at position ``context_lens[i] - 1`` and sees keys
    ``[max(0, context_lens[i] - sliding_window), context_lens[i])``; a sequence with
    ``context_lens[i] == 0`` (CUDA-graph padding) gets zeros. No host sync, no value-dependent
    shapes: safe inside CUDA-graph capture. Score modifiers as in ``attention_common``.

    Args:
        softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma2).
        alibi_slopes: ALiBi, ``scores += slope_h * (k_pos - q_pos)``, one slope per query head.
        sinks: one logit per query head that joins the softmax and gives no value (GPT-OSS).
        num_partitions: split-K factor; default picks one from the shapes and the SM count.
        out: optional preallocated output (may be a strided view with contiguous head_dim).
        config: tuning override of ``TILE_N`` / ``num_warps`` / ``num_stages`` (benchmarks).

    Raises:
        ValueError: on unsupported head dims / block_size / dtype or mismatched shapes.
    """
    num_seqs, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_attention_inputs(q, k_cache, v_cache)
    if block_tables.shape[0] < num_seqs or context_lens.shape[0] < num_seqs:
        raise ValueError("block_tables / context_lens have fewer rows than q")
    v_strides, dims = dim_args(q, k_cache, v_cache)
    mod_args, mods = score_args(q, scale, softcap, alibi_slopes, sinks)
    head_dim_v = dims["HEAD_DIM_V"]
    if out is None:
        out = q.new_empty(num_seqs, num_heads, head_dim_v)
    if num_seqs == 0:
        return out
    if num_partitions is None:
        max_context = block_tables.shape[1] * block_size
        num_partitions = default_num_partitions(num_seqs, num_kv_heads, max_context, q.device)
    if not 1 <= num_partitions <= 2 * MAX_PARTITIONS:
        raise ValueError(f"num_partitions must be in [1, {2 * MAX_PARTITIONS}]: {num_partitions}")
    group = num_heads // num_kv_heads
    cfg = {**_decode_config(dims["BLOCK_D"], q.dtype), **(config or {})}
    if num_partitions > 1:
        part_out = q.new_empty(num_seqs, num_heads, num_partitions, head_dim_v,
                               dtype=torch.float32)  # fmt: skip
        part_m = q.new_empty(num_seqs, num_heads, num_partitions, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel
        part_out = part_m = part_l = out
    window = sliding_window or 0
    pdl_args = pdl_kwargs(q)
    min_part = triton.cdiv(MIN_PARTITION, cfg["TILE_N"]) * cfg["TILE_N"]
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_m, part_l,
        mod_args[0], mod_args[1], scale * LOG2E, mod_args[2], mod_args[3],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *v_strides,
        block_tables.stride(0), num_heads,
        WINDOW=window,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        NUM_PARTITIONS=num_partitions,
        MIN_PART=min_part,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **dims,
        **mods,
        **cfg,
        **pdl_args,
    )  # fmt: skip
    if num_partitions > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_m, part_l, context_lens, mod_args[1],
            out.stride(0), out.stride(1), num_heads,
            WINDOW=window,
            HEAD_DIM_V=head_dim_v,
            BLOCK_DV=dims["BLOCK_DV"],
            SINKS=mods["SINKS"],
            TILE_N=cfg["TILE_N"],
            NUM_PARTITIONS=num_partitions,
            MIN_PART=min_part,
            BLOCK_P=triton.next_power_of_2(num_partitions),
            num_warps=4,
            **pdl_args,
        )  # fmt: skip
    return out
