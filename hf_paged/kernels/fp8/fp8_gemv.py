"""FP8 weight-streaming GEMV for decode: ``y = dequant(x_q) @ dequant(w).T`` for M <= 16 rows,
block-scaled weights (transformers' fine-grained FP8), activations per token and K group.

The skinny GEMM's pattern (``skinny_gemm.py``) with float8 weights: each program owns
``BLOCK_N`` weight rows and walks the whole K range one scale group (``GROUP_K`` columns) at a
time, so every weight byte is read by exactly one program with no split-K reduction and the
kernel is bound by reading ``N * K`` bytes (half of bf16's). ``x`` is padded to 16 rows in
registers so each group is one fp8 tensor-core ``tl.dot``; its fp32 partial product is scaled
once by ``x_s[:, g] * w_s[n // GROUP_N, g]``, the same order of operations as the block GEMM.
Each loop iteration issues the loads of ``K_TILES`` groups (unrolled), so enough weight bytes
are in flight per SM when N / BLOCK_N programs are few.

Activation scales may have any strides (row- or column-major), so the quantization feeding
cuBLASLt feeds this kernel too. No argument depends on data values: CUDA-graph safe. The torch
reference is ``fp8_gemm.w8a8_matmul_ref``.
"""

from __future__ import annotations

import torch

from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16  # x rows the kernel takes (one tl.dot M tile)
# (BLOCK_N, K_TILES, num_warps, num_stages); the path table (kernels/fp8/fp8_paths.json) may name
# another per shape
DEFAULT_CONFIG = (32, 2, 4, 4)


def problem(x_q, x_s, weight, w_s, block) -> str | None:
    """Why :func:`fp8_gemv` cannot take these inputs (device aside), or None."""
    bn, bk = block
    if bk < 16 or bk & (bk - 1):
        return f"weight_block_size[1]={bk}: the kernel takes powers of 2 >= 16"
    if x_q.dim() != 2 or not 0 < x_q.shape[0] <= MAX_ROWS:
        return f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {tuple(x_q.shape)}"
    if weight.dim() != 2 or weight.shape[1] != x_q.shape[1]:
        return f"weight {tuple(weight.shape)} must be [N, K={x_q.shape[1]}]"
    if x_q.stride(1) != 1 or weight.stride(1) != 1 or w_s.stride(1) != 1:
        return "x, weight and the weight scales need a contiguous K dim"
    m, k = x_q.shape
    n = weight.shape[0]
    if tuple(x_s.shape) != (m, -(-k // bk)) or tuple(w_s.shape) != (-(-n // bn), -(-k // bk)):
        return f"scales {tuple(x_s.shape)} / {tuple(w_s.shape)} do not fit block {tuple(block)}"
    return None


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit(do_not_specialize=["M", "stride_xsg"])  # one variant for every row count
    def _fp8_gemv_kernel(
        x_ptr,  # [M, K] fp8
        xs_ptr,  # [M, ceil(K / GROUP_K)] fp32, any strides
        w_ptr,  # [N, K] fp8
        ws_ptr,  # [ceil(N / GROUP_N), ceil(K / GROUP_K)] fp32
        b_ptr,
        y_ptr,  # [M, N]
        M,
        N,
        K,
        stride_xm,
        stride_xsm,
        stride_xsg,
        stride_wn,
        stride_wsn,
        stride_ym,
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        K_TILES: tl.constexpr,  # scale groups per loop iteration (more bytes in flight)
        USE_PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, GROUP_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        xs_ptrs = xs_ptr + rm * stride_xsm
        ws_ptrs = ws_ptr + (rn // GROUP_N).to(tl.int64) * stride_wsn
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        num_groups = tl.cdiv(K, GROUP_K)
        for g0 in range(0, num_groups, K_TILES):
            for j in tl.static_range(K_TILES):  # K_TILES groups' loads issued per iteration
                g = g0 + j
                k_ok = g * GROUP_K + rk < K  # also false past the last group
                w = tl.load(w_ptrs + j * GROUP_K, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_ptrs + j * GROUP_K, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                gs = tl.minimum(g, num_groups - 1)  # past the last group x and w load as 0
                x_s = tl.load(xs_ptrs + gs * stride_xsg, mask=m_ok, other=0.0)
                w_s = tl.load(ws_ptrs + gs, mask=n_ok, other=0.0)
                acc += tl.dot(x, tl.trans(w)) * x_s[:, None] * w_s[None, :]
            x_ptrs += K_TILES * GROUP_K
            w_ptrs += K_TILES * GROUP_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemv(
    x_q: torch.Tensor,  # [M, K] fp8, M <= MAX_ROWS
    x_s: torch.Tensor,  # [M, ceil(K / bk)] fp32
    weight: torch.Tensor,  # [N, K] fp8
    w_s: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] fp32
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_N, K_TILES, warps, stages)
) -> torch.Tensor:  # [M, N] out_dtype
    """Block-scale FP8 GEMV (see the module docstring).

    Raises:
        ValueError: inputs the kernel does not take (:func:`problem`).
    """
    why = problem(x_q, x_s, weight, w_s, block)
    if why is not None:
        raise ValueError(f"fp8_gemv: {why}")
    m, k = x_q.shape
    n = weight.shape[0]
    block_n, k_tiles, warps, stages = config or DEFAULT_CONFIG
    y = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x_q, x_s, weight, w_s, bias if bias is not None else y, y,
        m, n, k, x_q.stride(0), x_s.stride(0), x_s.stride(1), weight.stride(0), w_s.stride(0),
        y.stride(0), GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, K_TILES=k_tiles, num_warps=warps, num_stages=stages,
        **pdl_kwargs(x_q),
    )  # fmt: skip
    return y
