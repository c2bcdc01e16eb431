"""Skinny GEMM for decode at small batch: ``y = x @ W.T (+ bias)`` with few rows in ``x``.

At batch 1-16 a linear layer is a matrix-vector product bound by reading ``W`` once. The kernel
gives each program ``BLOCK_N`` rows of ``W`` and the whole K loop, so every weight byte is read
by exactly one program with no split-K reduction, and ``N / BLOCK_N`` programs fill the GPU
(N = 4096 at BLOCK_N = 16: 256 programs). ``x`` is padded to 16 rows in registers so the product
is one tensor-core ``tl.dot`` per K tile (the tensor cores are idle anyway; the bound is memory).
Accumulation is fp32, the output rounds once to the activation dtype, like cuBLAS.

No argument depends on data values, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged import envs
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16  # x rows the kernel takes (one tl.dot M tile)

# (BLOCK_N, BLOCK_K, num_warps, num_stages); chosen per shape by ``_config``
DEFAULT_CONFIG = (32, 128, 4, 3)
# The layers use the kernel only where it is faster than cuBLAS: few rows, no bias (cuBLAS
# rounds a bias differently), and large weights with a long K loop (H200, bf16, one row:
# evaluation/bench_gemv.py). Small matrices (e.g. Qwen3-0.6B's) stay on cuBLAS.
# HF_PAGED_SKINNY_GEMM=0 keeps every linear layer on cuBLAS (hf_paged/envs.py).
DISPATCH_MAX_ROWS = 4
DISPATCH_MIN_K = 4096
DISPATCH_MIN_ELEMENTS = 16 * 2**20


def _problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these inputs (device aside), or None."""
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        return f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}"
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return f"x and weight must both be fp16 or bf16, got {x.dtype} and {weight.dtype}"
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.stride(1) != 1:
        return f"weight must be [N, K={x.shape[1]}] with unit K stride, got {tuple(weight.shape)}"
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (weight.shape[0],)):
        return f"bias must be [N={weight.shape[0]}] of {x.dtype}, got {tuple(bias.shape)}"
    if x.shape[1] % 8 or weight.stride(0) % 8:
        return f"K ({x.shape[1]}) and weight's row stride ({weight.stride(0)}) must be % 8"
    return None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether to dispatch to the kernel: triton installed, CUDA inputs it takes."""
    if not envs.HF_PAGED_SKINNY_GEMM or triton is None or not x.is_cuda:
        return False
    return _problem(x, weight, bias) is None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` for the model's layers: the skinny kernel for a few rows on CUDA, else
    ``F.linear`` (cuBLAS, or the CPU)."""
    if (
        bias is None
        and x.dim() == 2
        and x.shape[0] <= DISPATCH_MAX_ROWS
        and weight.dim() == 2
        and weight.shape[1] >= DISPATCH_MIN_K
        and weight.numel() >= DISPATCH_MIN_ELEMENTS
        and supports(x, weight)
    ):
        return skinny_gemm(x, weight)
    return F.linear(x, weight, bias)


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit(do_not_specialize=["M"])  # one compiled variant per weight for every row count
    def _skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = 0
        if PREFETCH:
            # The weights do not depend on the kernel before: under PDL the first K tile is
            # loaded while that kernel finishes, then the loop starts at the second tile.
            w0 = tl.load(w_ptrs, mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
            pdl_enter(USE_PDL)
            x0 = tl.load(x_ptrs, mask=m_mask[:, None] & (rk < K)[None, :], other=0.0)
            acc = tl.dot(x0, tl.trans(w0), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            k_start = BLOCK_K
        else:
            pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        for k0 in range(k_start, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _config(n: int, k: int) -> tuple[int, int, int, int]:
    """Tile config by weight shape, from the H200 sweep at one row (bench_gemv.py --sweep):
    Llama-3-8B's o_proj (4096 x 4096) 7.8 us vs cuBLAS 10.5 + split-K reduce; down
    (4096 x 14336) 29.5 vs 31.8 + reduce; gate_up (28672 x 4096) 55.8 vs 58.7; lm_head
    (128256 x 4096) 231 vs 239; qkv (6144 x 4096) 13.7 vs 13.3."""
    if n <= 4096:  # few row blocks: long K tiles keep enough bytes in flight per program
        return (32, 512, 4, 4 if k >= 8192 else 3)
    if n >= 65536:
        return (64, 128, 4, 4)
    if n <= 8192:
        return (64, 128, 4, 6)
    return DEFAULT_CONFIG


def skinny_gemm(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T + bias`` for a few rows of ``x`` (see the module docstring)."""
    problem = _problem(x, weight, bias)
    if problem is not None:
        raise ValueError(f"unsupported inputs for skinny_gemm: {problem}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or _config(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    pdl_args = pdl_kwargs(x)
    prefetch = envs.HF_PAGED_PDL_PREFETCH and pdl_args["USE_PDL"]
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages, PREFETCH=prefetch,
        **pdl_args,
    )  # fmt: skip
    return y
