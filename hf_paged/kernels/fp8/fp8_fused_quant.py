"""Producers that write FP8 directly: RMSNorm (+ residual add) -> per-token-group quant, and
SiLU-and-mul -> per-token-group quant (Triton kernels + torch references).

Before a block-scaled FP8 linear, the norm's or activation's bf16 output is only read back to
be quantized. These kernels compute that output in registers, round it to the activation dtype
exactly as ``fused_norm`` / ``fused_act`` do, and store float8 values with one fp32 scale per
row and ``group`` columns (``s = max(|v|, EPS) / 448``, ``q = float8(v / s)``: the numerics of
``fp8_quant``), scales column-major (strides ``(1, T)``) as cuBLASLt's block-wise GEMM wants.
One write of 1 byte per element instead of a 2-byte write plus a 2-byte read and a 1-byte write.

References: ``fused_norm``'s / ``fused_act``'s torch references followed by
``fp8_quant.per_token_group_quant_ref``. Both kernels take shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from hf_paged.kernels import fused_enabled, fused_norm
from hf_paged.kernels.fp8.fp8_quant import FP8_DTYPE, empty_scales, per_token_group_quant_ref
from hf_paged.kernels.fused_act import silu_and_mul_ref
from hf_paged.kernels.fused_norm import fused_add_rms_norm_ref, rms_norm_ref
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None

ACT_BLOCK = 1024  # outputs per program of the activation kernel


def rms_norm_quant_ref(x, residual, weight, eps, group):
    """``(q [T, H], scales [T, ceil(H / group)], new residual or None)``: the norm's output
    (with the residual add when given) quantized per token and group."""
    if residual is None:
        out, new_res = rms_norm_ref(x, weight, eps), None
    else:
        out, new_res = fused_add_rms_norm_ref(x, residual, weight, eps)
    q, s = per_token_group_quant_ref(out.reshape(-1, out.shape[-1]), group)
    return q, s, new_res


def silu_and_mul_quant_ref(x, group):
    """``(q [T, I], scales [T, ceil(I / group)])`` of ``silu(gate) * up`` (x = [gate | up])."""
    out = silu_and_mul_ref(x)
    return per_token_group_quant_ref(out.reshape(-1, out.shape[-1]), group)


def _group_ok(group: int) -> bool:
    return 16 <= group <= 1024 and not group & (group - 1)


def norm_supports(x, weight, residual, group: int) -> bool:
    """Whether :func:`rms_norm_quant` takes these CUDA inputs (and the fused kernels are on)."""
    per_token = x.dim() > 0 and group >= x.shape[-1]
    if not fused_enabled() or triton is None or not x.is_cuda:
        return False
    if not (_group_ok(group) or per_token):
        return False
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16):
        return False
    return fused_norm.problem(x, weight, residual) is None and weight.dtype == x.dtype


def act_supports(x, group: int) -> bool:
    """Whether :func:`silu_and_mul_quant` takes this CUDA input (and the fused kernels are on)."""
    if not fused_enabled() or triton is None or not x.is_cuda or not _group_ok(group):
        return False
    return x.dim() == 2 and x.shape[-1] % 2 == 0 and x.dtype in (torch.float16, torch.bfloat16)


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _quant_store(v, cols, mask, q_ptr, s_ptr, row, stride_qm, stride_sg, first_group,
                     n_cols, NUM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
        """Quantize ``v [NUM * GROUP]`` (fp32, zero where masked) per group; store q and the
        scales of groups ``first_group ..`` that start before ``n_cols``."""
        v2 = tl.reshape(v, (NUM, GROUP))
        scale = tl.maximum(tl.max(tl.abs(v2), axis=1), 1e-10) / 448.0  # [NUM]
        q = tl.clamp(v2 / scale[:, None], -448.0, 448.0)
        q = tl.reshape(q, (NUM * GROUP,))
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        g = first_group + tl.arange(0, NUM)
        tl.store(s_ptr + row + g * stride_sg, scale, mask=g * GROUP < n_cols)

    @triton.jit
    def _rms_norm_quant_kernel(
        x_ptr,
        residual_ptr,  # read only when HAS_RESIDUAL
        weight_ptr,
        q_ptr,
        s_ptr,  # [T, G] column-major: element (row, g) at row + g * stride_sg
        new_residual_ptr,  # written only when HAS_RESIDUAL
        stride_x,
        stride_r,
        stride_q,
        stride_sg,
        stride_nr,
        hidden,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,  # a multiple of GROUP covering the row
        GROUP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / hidden
        h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = (w.to(tl.float32) * h.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        out = tl.where(mask, out, 0.0)
        _quant_store(out, cols, mask, q_ptr, s_ptr, row, stride_q, stride_sg, 0, hidden,
                     BLOCK // GROUP, GROUP)  # fmt: skip

    @triton.jit
    def _silu_and_mul_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        stride_x,
        stride_q,
        stride_sg,
        inter,
        BLOCK: tl.constexpr,  # a multiple of GROUP
        GROUP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        dt = x_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)  # torch's silu, rounded to the dtype
        out = (act.to(tl.float32) * up).to(dt).to(tl.float32)
        _quant_store(out, cols, mask, q_ptr, s_ptr, row, stride_q, stride_sg,
                     tl.program_id(1) * (BLOCK // GROUP), inter, BLOCK // GROUP, GROUP)  # fmt: skip


def rms_norm_quant(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm (after ``h = x + residual`` when given) quantized per token and ``group``:
    ``(q [T, H] fp8, scales [T, ceil(H / group)] column-major, new residual h or None)``.
    ``group >= H`` is one scale per token (compressed-tensors' dynamic activations).

    Raises:
        ValueError: inputs the fused RMSNorm does not take, or a ``group`` below H that is not
            a power of 2 in [16, 1024].
    """
    problem = fused_norm.problem(x, weight, residual)
    per_token = x.dim() == 2 and group >= x.shape[-1]
    if problem is None and not (_group_ok(group) or per_token):
        problem = f"group={group} must be a power of 2 in [16, 1024], or >= the hidden size"
    if problem is None and x.dim() != 2:
        problem = f"x must be [T, H], got {tuple(x.shape)}"
    if problem is not None:
        raise ValueError(f"rms_norm_quant: {problem}")
    t, hidden = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(t, hidden, dtype=FP8_DTYPE, device=x.device)
    s = empty_scales(t, 1 if per_token else -(-hidden // group), True, x.device)
    new_res = None
    if residual is not None:
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        new_res = torch.empty_like(x)
    if t > 0:
        block = triton.next_power_of_2(hidden)
        tile_group = block if per_token else group  # per token: the row is one masked group
        block = max(block, tile_group)
        r, nr = (residual, new_res) if residual is not None else (x, x)
        _rms_norm_quant_kernel[(t,)](
            x, r, weight, q, s, nr, x.stride(0), r.stride(0), q.stride(0), s.stride(1),
            nr.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            GROUP=tile_group, num_warps=fused_norm.num_warps(block), **pdl_kwargs(x),
        )  # fmt: skip
    return q, s, new_res


def silu_and_mul_quant(
    x: torch.Tensor,  # [T, 2I]
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, I] fp8, [T, ceil(I / group)] column-major
    """``silu(x[:, :I]) * x[:, I:]`` quantized per token and ``group``.

    Raises:
        ValueError: not a float [T, 2I] tensor, or a ``group`` not a power of 2 in [16, 1024].
    """
    if x.dim() != 2 or x.shape[-1] % 2 or not x.is_floating_point() or not _group_ok(group):
        raise ValueError(
            f"silu_and_mul_quant: x {x.dtype} {tuple(x.shape)} must be a float [T, 2I] tensor "
            f"and group={group} a power of 2 in [16, 1024]"
        )
    t, inter = x.shape[0], x.shape[1] // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(t, inter, dtype=FP8_DTYPE, device=x.device)
    s = empty_scales(t, -(-inter // group), True, x.device)
    if t > 0 and inter > 0:
        block = max(ACT_BLOCK, group)
        _silu_and_mul_quant_kernel[(t, triton.cdiv(inter, block))](
            x, q, s, x.stride(0), q.stride(0), s.stride(1), inter, BLOCK=block, GROUP=group,
            num_warps=4, **pdl_kwargs(x),
        )  # fmt: skip
    return q, s
