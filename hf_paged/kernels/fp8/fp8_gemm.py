"""FP8 GEMMs: ``y = dequant(x_q) @ dequant(w).T (+ bias)`` (Triton block-scale kernel, a
``torch._scaled_mm`` wrapper for row-wise scales, and the torch references).

Weights are float8_e4m3fn ``[N, K]`` whose float32 scales multiply them back:

* block scales ``w_s [ceil(N / bn), ceil(K / bk)]`` (transformers' fine-grained FP8), with
  activations quantized per token in groups of ``bk`` (``x_s [M, ceil(K / bk)]``): the Triton
  kernel below. Each K tile lies inside one scale group, so a tile's partial product is scaled
  once, ``acc += dot(x_tile, w_tile) * x_s[:, g] * w_s[n // bn, g]``, in fp32.
* row-wise scales ``w_s [N, 1]`` (per channel; per tensor is the same value in every row) with
  activations per token (``x_s [M, 1]``): ``torch._scaled_mm`` (cuBLASLt, Hopper / Ada).

The block kernel takes activation scales of any strides, so the column-major scales written for
cuBLASLt's block-wise GEMM (``fp8_scaled_mm.py``) serve it too.

The references dequantize in fp32 and multiply; ``dequantize_ref`` is also what the layers run
on devices without FP8 GEMMs (and equals transformers' own ``Fp8Dequantize``).
"""

from __future__ import annotations

import torch

from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]):
    """Block scales ``[ceil(N / bn), ceil(K / bk)]`` -> one per element ``[N, K]`` (fp32)."""
    n, k = shape
    bn, bk = block
    s = scale.float().repeat_interleave(bn, dim=0)[:n]
    return s.repeat_interleave(bk, dim=1)[:, :k]


def dequantize_ref(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # block [ceil(N/bn), ceil(K/bk)], row-wise [N, 1] or per tensor
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K] dtype
    """``(weight.float() * scale).to(dtype)``, scales broadcast over their blocks or rows."""
    w = weight.float()
    if block is not None:
        return (w * expand_block_scales(scale, tuple(w.shape), block)).to(dtype)
    return (w * scale.float()).to(dtype)


def w8a8_matmul_ref(
    x_q: torch.Tensor,  # [M, K] fp8
    x_s: torch.Tensor,  # [M, ceil(K / bk)] (block) or [M, 1] / per tensor (row-wise)
    weight: torch.Tensor,  # [N, K] fp8
    w_s: torch.Tensor,
    block: tuple[int, int] | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """Torch reference of both FP8 GEMMs (fp32 math)."""
    m, k = x_q.shape
    if block is not None:
        xs = x_s.float().repeat_interleave(block[1], dim=1)[:, :k]
    else:
        xs = x_s.float()
    x = x_q.float() * xs
    y = x @ dequantize_ref(weight, w_s, block, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit(do_not_specialize=["M", "stride_asg"])
    def _block_fp8_gemm_kernel(
        a_ptr,  # [M, K] fp8
        b_ptr,  # [N, K] fp8
        c_ptr,  # [M, N]
        as_ptr,  # [M, ceil(K / GROUP_K)] fp32
        bs_ptr,  # [ceil(N / GROUP_N), ceil(K / GROUP_K)] fp32
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_bn,
        stride_cm,
        stride_asm,
        stride_asg,  # 1 for row-major scales, M for column-major (cuBLASLt's layout)
        stride_bsn,
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # divides GROUP_K: a K tile never spans two scale groups
        GROUP_M: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n  # programs of GROUP_M row blocks: B tiles reused in L2
        first_m = (pid // per_group) * GROUP_M
        rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N]
        as_ptrs = as_ptr + rm.to(tl.int64) * stride_asm
        bs_ptrs = bs_ptr + (rn // GROUP_N).to(tl.int64) * stride_bsn
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            g = k0 // GROUP_K
            a_s = tl.load(as_ptrs + g * stride_asg, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptrs + g, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_gemm_config(m: int, n: int, group_k: int) -> dict:
    """Tiles by row count, where the path table (``kernels/fp8/fp8_paths.json``, written by
    ``evaluation/bench_fp8_gemm.py``) names none for the shape. Decode: 16-row tiles and narrow
    N tiles, so that N / BLOCK_N programs fill the SMs; prefill: 64 x 128 tiles."""
    block_k = min(group_k, 128)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=3)


def block_gemm_problem(
    x_q: torch.Tensor, x_s: torch.Tensor, weight: torch.Tensor, w_s: torch.Tensor, block
) -> str | None:
    """Why :func:`w8a8_block_matmul` cannot take these inputs (device aside), or None."""
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        return f"weight_block_size[1]={bk}: the kernel takes powers of 2 >= 16"
    if x_q.dim() != 2 or weight.dim() != 2 or x_q.shape[1] != weight.shape[1]:
        return f"x {tuple(x_q.shape)} and weight {tuple(weight.shape)} must be [M, K] / [N, K]"
    if x_q.stride(1) != 1 or weight.stride(1) != 1:
        return "x and weight need a contiguous K dim"
    m, k = x_q.shape
    n = weight.shape[0]
    if tuple(x_s.shape) != (m, -(-k // bk)) or tuple(w_s.shape) != (-(-n // bn), -(-k // bk)):
        return f"scales {tuple(x_s.shape)} / {tuple(w_s.shape)} do not fit block {block}"
    return None


def w8a8_block_matmul(
    x_q: torch.Tensor,  # [M, K] fp8
    x_s: torch.Tensor,  # [M, ceil(K / bk)] fp32
    weight: torch.Tensor,  # [N, K] fp8
    w_s: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] fp32
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """Block-scale FP8 GEMM (see the module docstring). ``config`` overrides the tiles.

    Raises:
        ValueError: inputs the kernel does not take (``block_gemm_problem``).
    """
    problem = block_gemm_problem(x_q, x_s, weight, w_s, block)
    if problem is not None:
        raise ValueError(f"w8a8_block_matmul: {problem}")
    m, k = x_q.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    cfg = {**block_gemm_config(m, n, block[1]), **(config or {})}
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _block_fp8_gemm_kernel[grid](
        x_q, weight, out, x_s, w_s, bias if bias is not None else out,
        m, n, k, x_q.stride(0), weight.stride(0), out.stride(0), x_s.stride(0), x_s.stride(1),
        w_s.stride(0),
        GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None, **cfg, **pdl_kwargs(x_q),
    )  # fmt: skip
    return out


def scaled_mm_problem(x_q: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`w8a8_rowwise_matmul` cannot take these shapes, or None (cuBLASLt needs K and N
    multiples of 16)."""
    k, n = x_q.shape[1], weight.shape[0]
    if k % 16 or n % 16:
        return f"K={k} and N={n} must be multiples of 16 for torch._scaled_mm"
    return None


def w8a8_rowwise_matmul(
    x_q: torch.Tensor,  # [M, K] fp8
    x_s: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [N, K] fp8
    w_s: torch.Tensor,  # [N, 1] fp32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """``torch._scaled_mm`` with row-wise scales (per token x per output channel)."""
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_s, scale_b=w_s.view(1, -1), out_dtype=out_dtype)
    return y if bias is None else y + bias
