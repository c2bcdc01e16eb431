"""What the paged decode and prefill kernels share: argument checks, the score modifiers and the
head-dim padding, on the host and in Triton.

Score modifiers, in the torch reference's order (``hf_paged/attention/torch_ref.py``): scores
``s = q.k * scale``; with a softcap ``s = c * tanh(s / c)``; with ALiBi ``s += slope_h * (k_pos -
q_pos)``; then the causal / sliding-window mask; with attention sinks one extra logit per head
joins the softmax denominator and contributes no value. Each is a ``tl.constexpr`` flag, so a
layer without it compiles to the kernel it had before. The kernels keep scores in base 2
(multiplied by ``log2(e)``), so the modifiers are applied in that domain.

Head dims need not be powers of 2, and V's may differ from K's (MLA: K 192, V 128): the kernels
pad ``tl.arange`` to ``BLOCK_D`` / ``BLOCK_DV`` (next power of 2, at least 16 for ``tl.dot``)
and mask loads and stores, again only when padding is needed.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: only the references are usable
    triton = None

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256  # largest K or V head dim the kernels take (register / shared-memory bound)


def padded_dim(head_dim: int) -> int:
    """``tl.arange`` length for a head dim: the next power of 2, at least 16 (``tl.dot``)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Shared argument checks of the paged attention kernels (decode and prefill).

    Raises:
        RuntimeError: triton is not installed.
        ValueError: naming the argument and what is allowed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use the *_ref functions")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
            "[num_blocks, block_size, num_kv_heads, head_dim(_v)] with equal first three dims"
        )
    block_size = k_cache.shape[1]
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2 >= 8, got {block_size}")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    for name, d in (("head_dim", head_dim), ("head_dim_v", v_cache.shape[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}={d} is not allowed: must be in [1, {MAX_HEAD_DIM}]")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    cache_ok = (q.dtype, torch.float8_e4m3fn)  # an fp8 cache is read back in q's dtype
    if q.dtype not in dtypes or k_cache.dtype not in cache_ok or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q must be fp16/bf16/fp32 and the caches of its dtype or float8_e4m3fn: {q.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dim of q and the caches")


def dim_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[tuple, dict]:
    """V-cache strides (block, slot, head) and the head-dim constexprs of a launch."""
    head_dim, head_dim_v = k_cache.shape[3], v_cache.shape[3]
    separate_v = v_cache.stride()[:3] != k_cache.stride()[:3]  # else V offsets = K offsets
    consts = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=padded_dim(head_dim),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=padded_dim(head_dim_v),
        SEPARATE_V=separate_v,
    )
    return (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)), consts


def _check_per_head(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.shape != (q.shape[1],) or not t.is_contiguous() or t.device != q.device:
        raise ValueError(
            f"{name} must be a contiguous [num_heads={q.shape[1]}] tensor on {q.device}, got "
            f"shape {tuple(t.shape)} on {t.device}"
        )
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {t.dtype}")


def score_args(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    scale: float,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,  # [num_heads] float
    sinks: torch.Tensor | None,  # [num_heads] float
) -> tuple[tuple, dict]:
    """Runtime args ``(alibi_ptr, sinks_ptr, softcap_scale, softcap_log2)`` and the
    ``SOFTCAP`` / ``ALIBI`` / ``SINKS`` / ``TANH_LIBDEVICE`` constexprs of a launch; unused
    pointers point at ``q``.

    Raises:
        ValueError: a softcap <= 0, or slopes / sinks not one float per query head on q's device.
    """
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} is not allowed: must be > 0 (or None)")
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None:
            _check_per_head(name, t, q)
    args = (
        q if alibi_slopes is None else alibi_slopes,
        q if sinks is None else sinks,
        scale / softcap if softcap else 0.0,  # s / c = q.k * (scale / c)
        softcap * LOG2E if softcap else 0.0,  # c * tanh(.) in the base-2 score domain
    )
    consts = dict(SOFTCAP=softcap is not None, ALIBI=alibi_slopes is not None,
                  SINKS=sinks is not None, TANH_LIBDEVICE=q.is_cuda)  # fmt: skip
    return args, consts


if triton is not None:

    @triton.jit
    def load_tile(ptrs, rows_ok, cols_ok, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
        """Zero-filled load of a 2-D tile; ``rows_ok`` / ``cols_ok`` (broadcastable to the
        tile) apply only where their flag is set, so an unmasked tile is a plain load."""
        if ROW_MASK:
            if COL_MASK:
                x = tl.load(ptrs, mask=rows_ok & cols_ok, other=0.0)
            else:
                x = tl.load(ptrs, mask=rows_ok, other=0.0)
        else:
            if COL_MASK:
                x = tl.load(ptrs, mask=cols_ok, other=0.0)
            else:
                x = tl.load(ptrs)
        return x

    @triton.jit
    def scores_log2(
        qk,  # [R, N] fp32 raw q.k
        rel,  # [R, N] or [1, N] fp32 k_pos - q_pos (read only with ALIBI)
        slope_log2,  # [R] fp32 ALiBi slope * log2(e) (read only with ALIBI)
        scale_log2,
        softcap_scale,
        softcap_log2,
        SOFTCAP: tl.constexpr,
        ALIBI: tl.constexpr,
        TANH_LIBDEVICE: tl.constexpr,  # CUDA: libdevice's tanh; else 2 * sigmoid(2x) - 1
    ):
        """Base-2 scores: ``(q.k * scale)`` softcapped, plus the ALiBi bias, times log2(e)."""
        if SOFTCAP:  # c * tanh(s / c); the CPU interpreter has no libdevice
            if TANH_LIBDEVICE:
                s = softcap_log2 * libdevice.tanh(qk * softcap_scale)
            else:
                s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * (qk * softcap_scale)) - 1.0)
        else:
            s = qk * scale_log2
        if ALIBI:
            s = s + slope_log2[:, None] * rel
        return s

    @triton.jit
    def per_head_log2(ptr, head, mask):
        """``ptr[head] * log2(e)`` in fp32 (an ALiBi slope or a sink logit per query head)."""
        return tl.load(ptr + head, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
