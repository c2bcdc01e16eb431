"""Per-head RMSNorm (optional, Qwen3's q_norm/k_norm) + neox rotary on q and k, in one launch.

Grid ``(num_tokens, cdiv(num_heads, BLOCK_H) + cdiv(num_kv_heads, BLOCK_H))``: a program takes
``BLOCK_H`` heads of one token, of q for the first head blocks and of k for the rest, and holds
each head as its two halves ``x1 = x[:D/2]``, ``x2 = x[D/2:]`` so ``rotate_half`` needs no
shuffle. No argument depends on the token count, so the launch is CUDA-graph safe.

Numerics follow the torch path (:func:`qk_norm_rope_ref`: ``rms_norm_ref`` then
``rotary_emb_ref``, HF's ops): the norm's statistics are fp32 and its output rounds to the
activation dtype; then ``x * cos`` and ``rotate_half(x) * sin`` each round to the activation
dtype before they are added, as torch's bf16/fp16 ops do (products of two bf16/fp16 values are
exact in fp32). Only the fp32 sum of squares may differ in summation order. The launch turns
off FP fusion, else the compiler contracts ``round(a * b) + c`` into one bf16 FMA.
"""

from __future__ import annotations

import torch

from hf_paged.kernels import fused_enabled
from hf_paged.kernels.fused_norm import rms_norm_ref
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None


def rotary_emb_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by ``cos``/``sin`` [T, D] (same ops as HF's apply_rotary_pos_emb)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def qk_norm_rope_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,  # [D]
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`qk_norm_rope`: optional per-head RMSNorm, then rotary."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return rotary_emb_ref(q, cos, sin), rotary_emb_ref(k, cos, sin)


def _problem(q, k, cos, sin, q_weight, k_weight) -> str | None:
    """Why the kernel cannot take these inputs (device aside), or None."""
    if q.dim() != 3 or k.dim() != 3 or not q.is_floating_point():
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} must be float [T, H, D]"
    num_tokens, _, head_dim = q.shape
    if head_dim % 2 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        return f"q {tuple(q.shape)} and k {tuple(k.shape)}: need matching T and an even D"
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        return f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [T, D]"
    tensors = [q, k, cos, sin]
    if (q_weight is None) != (k_weight is None):
        return "pass both q_weight and k_weight, or neither"
    if q_weight is not None:
        if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
            return f"norm weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} must be [D]"
        tensors += [q_weight, k_weight]
    if any(t.dtype != q.dtype for t in tensors):
        # torch would promote and skip a rounding: mixed dtypes stay on the torch path
        return f"mixed dtypes {[t.dtype for t in tensors]}"
    return None


def kv_cache_problem(k, v, k_cache, v_cache, slot_mapping) -> str | None:
    """Why the kernel cannot also store into these caches, or None: ``v`` like ``k``; caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` of k's dtype, contiguous (a flat slot
    is then one stride), sharing shape; an int64 slot per token."""
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1:
        return f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} {k.dtype}"
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:] or k_cache.dtype != k.dtype:
        return f"cache {tuple(k_cache.shape)} {k_cache.dtype} does not fit k {tuple(k.shape)}"
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        return "k_cache and v_cache must share shape and dtype"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "the caches must be contiguous"
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape[0] < k.shape[0]:
        return f"slot_mapping must be int64 with >= {k.shape[0]} entries"
    return None


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
) -> bool:
    """Whether to dispatch to the Triton kernel: triton installed, CUDA inputs it takes."""
    if triton is None or not q.is_cuda or not fused_enabled():
        return False
    return _problem(q, k, cos, sin, q_weight, k_weight) is None


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _norm_rope_heads(
        x_ptr,
        out_ptr,
        w_ptr,
        cos_ptr,
        sin_ptr,
        token,
        head0,
        num_heads,
        stride_xt,
        stride_xh,
        stride_ot,
        stride_oh,
        stride_ct,
        stride_st,
        eps,
        HEAD_DIM: tl.constexpr,
        HAS_NORM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
    ):
        half: tl.constexpr = HEAD_DIM // 2
        dt = out_ptr.dtype.element_ty
        h = head0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
        dmask = d < half
        mask = (h < num_heads) & dmask
        src = x_ptr + token * stride_xt + h * stride_xh + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
            r = tl.rsqrt(var + eps)[:, None]
            w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + half + d, mask=dmask, other=0.0).to(tl.float32)
            # HF: weight * normalized.to(dtype), the product rounded to dtype
            x1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + token * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + token * stride_ct + half + d, mask=dmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + token * stride_st + d, mask=dmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + token * stride_st + half + d, mask=dmask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product rounds to dt
        o1 = (x1 * c1).to(dt).to(tl.float32) + (-(x2 * s1)).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        dst = out_ptr + token * stride_ot + h * stride_oh + d
        tl.store(dst, o1.to(dt), mask=mask)
        tl.store(dst + half, o2.to(dt), mask=mask)
        return o1.to(dt), o2.to(dt)

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr,
        k_ptr,
        q_out_ptr,
        k_out_ptr,
        q_w_ptr,
        k_w_ptr,
        cos_ptr,
        sin_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_qot,
        stride_qoh,
        stride_kot,
        stride_koh,
        stride_ct,
        stride_st,
        num_heads,
        num_kv_heads,
        num_q_blocks,
        eps,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        stride_vt,
        stride_vh,
        stride_cslot,
        stride_ch,
        HEAD_DIM: tl.constexpr,
        HAS_NORM: tl.constexpr,
        STORE_KV: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        token = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        if block < num_q_blocks:
            _norm_rope_heads(q_ptr, q_out_ptr, q_w_ptr, cos_ptr, sin_ptr, token,
                             block * BLOCK_H, num_heads, stride_qt, stride_qh, stride_qot,
                             stride_qoh, stride_ct, stride_st, eps,
                             HEAD_DIM, HAS_NORM, BLOCK_H, BLOCK_HALF)  # fmt: skip
        else:
            head0 = (block - num_q_blocks) * BLOCK_H
            k1, k2 = _norm_rope_heads(k_ptr, k_out_ptr, k_w_ptr, cos_ptr, sin_ptr, token,
                                      head0, num_kv_heads, stride_kt, stride_kh, stride_kot,
                                      stride_koh, stride_ct, stride_st, eps,
                                      HEAD_DIM, HAS_NORM, BLOCK_H, BLOCK_HALF)  # fmt: skip
            if STORE_KV:  # the rotated k and the raw v into the paged caches (slot -1: skip)
                slot = tl.load(slot_mapping_ptr + token)
                if slot >= 0:
                    half: tl.constexpr = HEAD_DIM // 2
                    h = head0 + tl.arange(0, BLOCK_H)[:, None]
                    d = tl.arange(0, BLOCK_HALF)[None, :]
                    mask = (h < num_kv_heads) & (d < half)
                    dst = slot * stride_cslot + h * stride_ch + d
                    tl.store(k_cache_ptr + dst, k1, mask=mask)
                    tl.store(k_cache_ptr + dst + half, k2, mask=mask)
                    src = v_ptr + token * stride_vt + h * stride_vh + d
                    tl.store(v_cache_ptr + dst, tl.load(src, mask=mask), mask=mask)
                    tl.store(v_cache_ptr + dst + half, tl.load(src + half, mask=mask), mask=mask)


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,  # [D]
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    kv_cache: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm (``q_weight``/``k_weight``, both or neither) + neox rotary.

    ``q``/``k`` may be strided views (slices of a fused qkv projection) and are not modified.
    ``kv_cache = (v, k_cache, v_cache, slot_mapping)`` also writes the rotated k and ``v`` into
    the paged caches at ``slot_mapping`` (-1 = skip), as ``kv_store.store_kvcache`` would, in the
    same launch (see :func:`kv_cache_problem` for what the caches must be).

    Returns:
        new contiguous ``(q, k)`` of the input shapes and dtype.

    Raises:
        ValueError: shapes that do not match, an odd head_dim, one weight without the other, or
            mixed dtypes.
    """
    problem = _problem(q, k, cos, sin, q_weight, k_weight)
    if problem is None and kv_cache is not None:
        problem = kv_cache_problem(k, *kv_cache)
    if problem is not None:
        raise ValueError(f"unsupported inputs for the fused q/k norm + rope: {problem}")
    return launch_checked(q, k, cos, sin, q_weight, k_weight, eps, kv_cache)


def launch_checked(q, k, cos, sin, q_weight, k_weight, eps, kv_cache):
    """:func:`qk_norm_rope` for inputs already checked (``supports`` / ``kv_cache_problem``),
    so a layer's hot path does not check them twice."""
    q, k, cos, sin = (_last_contiguous(t) for t in (q, k, cos, sin))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(head_dim // 2)
    # ~1K elements of a head block per program: 8 heads at D=128, 16 at D=64
    block_h = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(1, 512 // block_half))
    num_q_blocks = triton.cdiv(num_heads, block_h)
    grid = (num_tokens, num_q_blocks + triton.cdiv(num_kv_heads, block_h))
    has_norm = q_weight is not None
    if kv_cache is not None:
        v, k_cache, v_cache, slot_mapping = kv_cache
        store = (v, k_cache, v_cache, slot_mapping, v.stride(0), v.stride(1),
                 k_cache.stride(1), k_cache.stride(2))  # fmt: skip
    else:
        store = (q, q, q, q, 0, 0, 0, 0)  # dummies, never read
    _qk_norm_rope_kernel[grid](
        q, k, q_out, k_out,
        q_weight if has_norm else q, k_weight if has_norm else k,  # dummies when no norm
        cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        num_heads, num_kv_heads, num_q_blocks, eps, *store,
        HEAD_DIM=head_dim, HAS_NORM=has_norm, STORE_KV=kv_cache is not None,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=4,
        # no FMA contraction: it would fuse a rounded product into the add (fma.rn.bf16) and
        # skip the rounding torch does there (checked in the PTX for sm_90)
        enable_fp_fusion=False,
        **pdl_kwargs(q),
    )  # fmt: skip
    return q_out, k_out
