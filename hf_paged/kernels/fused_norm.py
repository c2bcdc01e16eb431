"""RMSNorm, with and without a fused residual add (Triton kernels + torch references).

One program normalizes one row ``[H]`` (``H <= MAX_HIDDEN``) held whole in registers
(``BLOCK = next_power_of_2(H)``), so each norm is one launch instead of ~9 elementwise kernels.
The grid is ``(num_rows,)`` and no argument depends on the row count, so the launch is CUDA-graph
safe and one compiled kernel serves every batch size.

Numerics follow HF's ``LlamaRMSNorm`` (the references below are that exact torch code): statistics
in fp32, ``normalized.to(x.dtype)``, then ``weight * normalized`` in the promoted dtype; the
residual add is rounded to the input dtype before it is normalized. The kernel does the same
roundings (a product of two bf16/fp16 values is exact in fp32, so the weight multiply rounds
exactly as torch's does); only the fp32 sum of squares may differ in summation order.
"""

from __future__ import annotations

import torch

from hf_paged.kernels import fused_enabled
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None

MAX_HIDDEN = 8192  # largest row the one-row-per-program kernel is built and tested for


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of :func:`rms_norm` (HF's LlamaRMSNorm, op for op)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`fused_add_rms_norm`: ``h = x + residual; (norm(h), h)``."""
    h = x + residual
    return rms_norm_ref(h, weight, eps), h


def _problem(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these inputs (device aside), or None."""
    if not x.is_floating_point() or x.dim() == 0:
        return f"x must be a float tensor with a hidden dim, got {x.dtype} {tuple(x.shape)}"
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden {x.shape[-1]} > MAX_HIDDEN={MAX_HIDDEN}"
    if weight.shape != (x.shape[-1],):
        return f"weight {tuple(weight.shape)} does not match hidden {x.shape[-1]}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        # torch would broadcast / promote: those cases stay on the torch path
        return f"residual {residual.dtype} {tuple(residual.shape)} is not like x"
    return None


def problem(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    """Why the kernels cannot take these inputs (device aside), or None (public: the FP8
    producers in ``fp8_fused_quant`` share the rules)."""
    return _problem(x, weight, residual)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether to dispatch to the Triton kernels: triton installed, CUDA tensors they take."""
    if not fused_enabled():
        return False
    return (
        triton is not None
        and x.is_cuda
        and weight.is_cuda
        and _problem(x, weight, residual) is None
    )


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,  # read only when HAS_RESIDUAL
        weight_ptr,
        out_ptr,
        new_residual_ptr,  # written only when HAS_RESIDUAL
        stride_x,  # row strides (the hidden dim is contiguous)
        stride_r,
        stride_o,
        stride_nr,
        hidden,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            # the add rounds to the input dtype, as torch's ``x + residual`` does
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / hidden
        h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # HF: h.to(input dtype)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * h.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, H] with a contiguous last dim (a view when the strides allow it)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def num_warps(block: int) -> int:
    """Warps for one row of ``block`` elements (also the FP8 producers' choice)."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    problem = _problem(x, weight, residual)
    if problem is not None:
        raise ValueError(f"unsupported inputs for the fused RMSNorm: {problem}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        nr2 = new_res.view(-1, hidden)
    else:
        r2, new_res, nr2 = x2, None, x2  # placeholders, never touched
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out2,
            nr2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            nr2.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps(block),
            **pdl_kwargs(x2),
        )
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` [..., H] in one launch; out-of-place.

    Args:
        x: activations, last dim contiguous or not (rows are gathered if needed).
        weight: [H] scale.
        eps: added to the mean square.

    Returns:
        ``weight * normalize(x)`` in ``promote_types(weight.dtype, x.dtype)``, shaped like ``x``.

    Raises:
        ValueError: a non-float ``x``, H > MAX_HIDDEN, or a weight that is not [H].
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (in x's dtype), then ``(rms_norm(h), h)``, in one launch.

    Out-of-place: ``x`` and ``residual`` are left as they are.

    Raises:
        ValueError: as :func:`rms_norm`, or a ``residual`` of another shape or dtype than ``x``.
    """
    return _launch(x, residual, weight, eps)
