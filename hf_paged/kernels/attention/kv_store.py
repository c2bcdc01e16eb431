"""Write new keys/values into the paged KV cache (Triton kernel + torch reference).

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` goes to
flat slot ``slot_mapping[t] = block_id * block_size + offset``; slot -1 means "skip" (padding
tokens of a captured CUDA graph, prefix-cached tokens). One program per token copies all of its
kv heads at once; shapes are static so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch

from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the reference is usable
    triton = None


def store_kvcache_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Torch reference of :func:`store_kvcache`; writes in place. A float8 cache (scale 1.0)
    stores values clamped to +-448 (out-of-range values would become NaN)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = _to_cache(k[keep], k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = _to_cache(v[keep], v_cache.dtype)


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _store_kvcache_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,  # cache strides: block, slot-in-block, head (head_dim is contiguous)
        stride_cs,
        stride_ch,
        stride_vcb,  # V-cache strides (its head dim may differ from K's)
        stride_vcs,
        stride_vch,
        num_kv_heads,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_V: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        FP8_CACHE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token)  # int64
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
        if FP8_CACHE:  # scale 1.0: clamp into e4m3's range, then round
            k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        dv = tl.arange(0, BLOCK_DV)[None, :]
        mask_v = (h < num_kv_heads) & (dv < HEAD_DIM_V)
        v = tl.load(v_ptr + token * stride_vt + h * stride_vh + dv, mask=mask_v)
        dst_v = block * stride_vcb + offset * stride_vcs + h * stride_vch + dv
        if FP8_CACHE:
            v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
        tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask_v)


def store_kvcache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim_v]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Scatter ``k``/``v`` into the paged caches at ``slot_mapping`` (in place, no host sync).

    ``k``/``v`` may be strided views (e.g. slices of a fused qkv projection) as long as their
    last dim is contiguous. ``v`` / ``v_cache`` may have a head dim other than ``k``'s.

    Raises:
        ValueError: on mismatched shapes or a non-contiguous head dim.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    head_dim_v = v.shape[-1]
    if v.shape[:2] != k.shape[:2] or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"shape mismatch: k {k.shape} v {v.shape} caches {k_cache.shape}")
    if k_cache.shape[2:] != (num_kv_heads, head_dim) or v_cache.shape[3] != head_dim_v:
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match k "
            f"{tuple(k.shape)} / v {tuple(v.shape)}"
        )
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("head_dim must be the contiguous dim of k, v and the caches")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} < {num_tokens} entries")
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(head_dim_v),
        FP8_CACHE=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        **pdl_kwargs(k),
    )
