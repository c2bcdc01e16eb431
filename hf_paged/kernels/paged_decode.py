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
``exp2``; partial maxima are kept in that domain. Accumulation is fp32.
"""

from __future__ import annotations

import functools

import torch

from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the reference is usable
    triton = None

LOG2E = 1.4426950408889634
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
        part_out_ptr,  # [num_seqs, num_heads, NUM_PARTITIONS, HEAD_DIM] fp32
        part_m_ptr,  # [num_seqs, num_heads, NUM_PARTITIONS] fp32 (log2 domain)
        part_l_ptr,  # [num_seqs, num_heads, NUM_PARTITIONS] fp32
        scale_log2,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_bt,
        num_heads,
        WINDOW: tl.constexpr,  # 0 = no sliding window
        GROUP: tl.constexpr,  # query heads per kv head
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
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
        d = tl.arange(0, HEAD_DIM)
        head = kv_head * GROUP + g  # [BLOCK_G]
        g_mask = g < GROUP
        q_off = seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]

        # finite init: a fully masked tile then gives p = 0, alpha = 1 instead of NaN
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_head_off = kv_head.to(tl.int64) * stride_ch
        for tile_start in range(start, end, TILE_N):
            k_pos = tile_start + tl.arange(0, TILE_N)
            valid = k_pos < end
            blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_off = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=valid[None, :], other=0.0)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, TILE_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        if NUM_PARTITIONS == 1:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # no keys (padding sequence) -> zeros
            o_off = seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
            o = acc / l_safe[:, None]
            tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            row = (seq.to(tl.int64) * num_heads + head) * NUM_PARTITIONS + part  # [BLOCK_G]
            tl.store(part_m_ptr + row, m_i, mask=g_mask)
            tl.store(part_l_ptr + row, l_i, mask=g_mask)
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])

    @triton.jit
    def _paged_decode_reduce_kernel(
        out_ptr,
        part_out_ptr,
        part_m_ptr,
        part_l_ptr,
        context_lens_ptr,
        stride_ot,
        stride_oh,
        num_heads,
        WINDOW: tl.constexpr,
        HEAD_DIM: tl.constexpr,
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
        w = tl.where(p_mask, tl.exp2(m - m_max), 0.0)
        l_sum = tl.sum(w * l_part, 0)
        d = tl.arange(0, HEAD_DIM)
        acc = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=p_mask[:, None])
        acc = tl.where(p_mask[:, None], acc, 0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0.0, l_sum, 1.0)  # [HEAD_DIM]
        o_off = seq.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh + d
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


def _decode_config(head_dim: int, dtype: torch.dtype) -> dict:
    # Memory-bound: 64-key tiles pipelined 3 deep, 2 warps (more programs resident per SM).
    # H200 sweep (evaluation/bench_kernels.py --sweep, batch 256, ctx ~600, bf16): 4.10 TB/s at
    # d=128 and 3.82 TB/s at d=64, against 3.89 / 3.64 with 4 warps.
    if dtype == torch.float32:
        return dict(TILE_N=32, num_warps=4, num_stages=2)
    return dict(TILE_N=64, num_warps=2, num_stages=3)


def paged_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [>= num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [>= num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    num_partitions: int | None = None,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new query token per sequence over its paged KV cache.

    Sequence ``i``'s query sits at position ``context_lens[i] - 1`` and sees keys
    ``[max(0, context_lens[i] - sliding_window), context_lens[i])``; a sequence with
    ``context_lens[i] == 0`` (CUDA-graph padding) gets zeros. No host sync, no value-dependent
    shapes: safe inside CUDA-graph capture.

    Args:
        num_partitions: split-K factor; default picks one from the shapes and the SM count.
        out: optional preallocated output (may be a strided view with contiguous head_dim).
        config: tuning override of ``TILE_N`` / ``num_warps`` / ``num_stages`` (benchmarks).

    Raises:
        ValueError: on unsupported head_dim / block_size / dtype or mismatched shapes.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_attention_inputs(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, cache_head_dim)
    if block_tables.shape[0] < num_seqs or context_lens.shape[0] < num_seqs:
        raise ValueError("block_tables / context_lens have fewer rows than q")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_partitions is None:
        max_context = block_tables.shape[1] * block_size
        num_partitions = default_num_partitions(num_seqs, num_kv_heads, max_context, q.device)
    if not 1 <= num_partitions <= 2 * MAX_PARTITIONS:
        raise ValueError(f"num_partitions must be in [1, {2 * MAX_PARTITIONS}]: {num_partitions}")
    group = num_heads // num_kv_heads
    cfg = {**_decode_config(head_dim, q.dtype), **(config or {})}
    if num_partitions > 1:
        part_out = q.new_empty(num_seqs, num_heads, num_partitions, head_dim, dtype=torch.float32)
        part_m = q.new_empty(num_seqs, num_heads, num_partitions, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel
        part_out = part_m = part_l = out
    window = sliding_window or 0
    pdl_args = pdl_kwargs(q)
    min_part = triton.cdiv(MIN_PARTITION, cfg["TILE_N"]) * cfg["TILE_N"]
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_m,
        part_l,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        WINDOW=window,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_PARTITIONS=num_partitions,
        MIN_PART=min_part,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **cfg,
        **pdl_args,
    )
    if num_partitions > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_m,
            part_l,
            context_lens,
            out.stride(0),
            out.stride(1),
            num_heads,
            WINDOW=window,
            HEAD_DIM=head_dim,
            TILE_N=cfg["TILE_N"],
            NUM_PARTITIONS=num_partitions,
            MIN_PART=min_part,
            BLOCK_P=triton.next_power_of_2(num_partitions),
            num_warps=4,
            **pdl_args,
        )
    return out


def check_attention_inputs(
    q, k_cache, v_cache, num_heads, num_kv_heads, head_dim, cache_head_dim
) -> None:
    """Shared argument checks of the paged attention kernels (decode and prefill)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use the *_ref functions")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    block_size = k_cache.shape[1]
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2 >= 8, got {block_size}")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of 2 >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype:
        raise ValueError(
            f"q/cache dtypes must match and be fp16/bf16/fp32: {q.dtype}, {k_cache.dtype}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dim of q and the caches")
