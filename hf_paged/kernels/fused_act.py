"""``silu(gate) * up`` over a fused ``[gate | up]`` projection (Triton kernel + torch reference).

Grid ``(num_rows, cdiv(I, BLOCK))``: a program reads ``BLOCK`` gate and up values of one row
and writes ``BLOCK`` outputs, one launch instead of three (chunk views are free; silu, mul).
No argument depends on the row count, so the launch is CUDA-graph safe.

Numerics follow torch's: ``silu(g) = g / (1 + exp(-g))`` in fp32, rounded to the activation
dtype, then the product with ``up`` rounded again (exact in fp32 for bf16/fp16 operands). The
kernel's ``exp`` may differ from torch's in the last fp32 ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.kernels import fused_enabled
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the reference is usable
    triton = None

BLOCK = 1024  # outputs per program


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_and_mul`: [..., 2I] -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _problem(x: torch.Tensor) -> str | None:
    if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] % 2:
        return f"x must be a float [..., 2I] tensor, got {x.dtype} {tuple(x.shape)}"
    return None


def supports(x: torch.Tensor) -> bool:
    """Whether to dispatch to the Triton kernel: triton installed, a CUDA tensor it takes."""
    if not fused_enabled():
        return False
    return triton is not None and x.is_cuda and _problem(x) is None


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr,
        out_ptr,
        stride_x,  # row strides (the last dim is contiguous)
        stride_o,
        inter,  # I: width of gate, up and out
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        dt = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)  # torch's silu, rounded to the dtype
        out = act.to(tl.float32) * up
        tl.store(out_ptr + row * stride_o + cols, out.to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` in one launch: [..., 2I] -> new contiguous [..., I].

    Raises:
        ValueError: a non-float ``x`` or an odd last dim.
    """
    problem = _problem(x)
    if problem is not None:
        raise ValueError(f"unsupported input for the fused silu_and_mul: {problem}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0] > 0 and inter > 0:
        grid = (x2.shape[0], triton.cdiv(inter, BLOCK))
        _silu_and_mul_kernel[grid](
            x2,
            out2,
            x2.stride(0),
            out2.stride(0),
            inter,
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_kwargs(x2),
        )
    return out
