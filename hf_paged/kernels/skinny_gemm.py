"""Skinny GEMM for decode at small batch: ``y = x @ W.T (+ bias)`` with few rows in ``x``.

At batch 1-16 a linear layer is a matrix-vector product bound by reading ``W`` once. The kernel
gives each program ``BLOCK_N`` rows of ``W`` and the whole K loop, so every weight byte is read
by exactly one program with no split-K reduction, and ``N / BLOCK_N`` programs fill the GPU
(N = 4096 at BLOCK_N = 16: 256 programs). ``x`` is padded to 16 rows in registers so the product
is one tensor-core ``tl.dot`` per K tile (the tensor cores are idle anyway; the bound is memory).
Accumulation is fp32, the output rounds once to the activation dtype, like cuBLAS.

Two prologues fold the elementwise kernel before a decode linear layer into its x loads (one
launch fewer each; x is tiny and L2-resident, so recomputing it per program is free):

* ``silu_mul_gemm``: ``x = silu(gate) * up`` from gate_up_proj's output (before down_proj), with
  ``fused_act``'s roundings: the same bits as the activation kernel then this one.
* ``rms_norm_gemm``: ``x = RMSNorm(h)``, ``h = x + residual`` (before qkv_proj / gate_up_proj).
  Each program first sums ``h^2`` over K per row, then normalizes each x tile as it loads it,
  with ``fused_norm``'s roundings; program 0 writes ``h`` (the new residual). Only the fp32 sum
  of squares differs in order from the norm kernel.

No argument depends on data values, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from hf_paged.kernels import fused_act, fused_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16  # x rows the kernel takes (one tl.dot M tile)
# HF_PAGED_SKINNY_GEMM=0 keeps every linear layer on cuBLAS (A/B measurements); read at import
_ENABLED = os.environ.get("HF_PAGED_SKINNY_GEMM", "1") != "0"
PROLOGUE_NAMES = ("norm", "silu")


def parse_prologues(value: str) -> frozenset[str]:
    """``HF_PAGED_SKINNY_PROLOGUES``: which elementwise kernels the layers fold into the skinny
    GEMM: ``1``/``all`` (both), ``0``/``none``, or a comma list of ``norm``, ``silu``."""
    v = value.strip().lower()
    if v in ("1", "all"):
        return frozenset(PROLOGUE_NAMES)
    if v in ("0", "none", ""):
        return frozenset()
    names = frozenset(x.strip() for x in v.split(",") if x.strip())
    if not names <= set(PROLOGUE_NAMES):
        raise ValueError(
            f"HF_PAGED_SKINNY_PROLOGUES={value!r} is not allowed: use 1, all, 0, none or a comma "
            f"list of {', '.join(PROLOGUE_NAMES)}"
        )
    return names


# read at import; the benchmarks' A/B runs reassign it before building an engine
PROLOGUES = parse_prologues(os.environ.get("HF_PAGED_SKINNY_PROLOGUES", "all"))

# (BLOCK_N, BLOCK_K, num_warps, num_stages); chosen per shape by ``_config``
DEFAULT_CONFIG = (32, 128, 4, 3)
# The layers use the kernel only where it measured faster than cuBLAS: few rows, no bias (cuBLAS
# rounds a bias differently), and large weights with a long K loop (H200, bf16, one row:
# evaluation/bench_gemv.py). Small matrices (e.g. Qwen3-0.6B's) stay on cuBLAS.
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
    if not _ENABLED or triton is None or not x.is_cuda or not fused_enabled():
        return False
    return _problem(x, weight, bias) is None


def dispatches(rows: int, x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """The layers' rule: the kernel for ``rows`` rows against ``weight`` where it measured
    faster than cuBLAS (see DISPATCH_*), on inputs it takes."""
    return (
        bias is None
        and rows <= DISPATCH_MAX_ROWS
        and weight.dim() == 2
        and weight.shape[1] >= DISPATCH_MIN_K
        and weight.numel() >= DISPATCH_MIN_ELEMENTS
        and supports(x, weight)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` for the model's layers: the skinny kernel for a few rows on CUDA, else
    ``F.linear`` (cuBLAS, or the CPU)."""
    if x.dim() == 2 and dispatches(x.shape[0], x, weight, bias):
        return skinny_gemm(x, weight)
    return F.linear(x, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(silu(gate) * up, weight)`` for ``gate_up = [gate | up]``; one launch where
    ``linear`` would take the skinny kernel, else the fused activation then ``linear``."""
    k = weight.shape[-1]
    if "silu" in PROLOGUES and gate_up.dim() == 2 and gate_up.shape[1] == 2 * k:
        if dispatches(gate_up.shape[0], gate_up[:, :k], weight, None):
            return silu_mul_gemm(gate_up, weight)
    return linear(fused_act.silu_and_mul_any(gate_up), weight)


def norm_linear_fusable(x, residual, norm_weight, weight, bias) -> bool:
    """Whether :func:`rms_norm_gemm` serves ``linear(RMSNorm(x + residual), weight, bias)``."""
    return (
        "norm" in PROLOGUES
        and x.dim() == 2
        and dispatches(x.shape[0], x, weight, bias)
        and norm_weight.shape == (x.shape[1],)
        and norm_weight.dtype == x.dtype
        and norm_weight.is_cuda
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
    )


if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # one compiled variant per weight for every row count
    def _skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        r_ptr,  # PROLOGUE == 2 with HAS_RESIDUAL: the residual stream [M, K]
        nw_ptr,  # PROLOGUE == 2: the RMSNorm weight [K]
        nr_ptr,  # PROLOGUE == 2 with HAS_RESIDUAL: out, the new residual x + r [M, K]
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        stride_rm,
        stride_nrm,
        eps,
        HAS_BIAS: tl.constexpr,
        PROLOGUE: tl.constexpr,  # 0: x as is; 1: silu(x[:, :K]) * x[:, K:]; 2: RMSNorm(x (+ r))
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORM_BLOCK: tl.constexpr,  # PROLOGUE == 2: columns per step of the statistics pass
    ):
        pid = tl.program_id(0)
        dt = x_ptr.dtype.element_ty
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PROLOGUE == 2:
            # Statistics pass, one real row at a time (x is tiny and L2-resident): h = x (+ r)
            # rounded to the dtype, as the unfused norm does; program 0 writes it out.
            cols = tl.arange(0, NORM_BLOCK)
            for m in range(M):
                sq = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
                for c0 in range(0, K, NORM_BLOCK):
                    c_mask = (c0 + cols) < K
                    h = tl.load(x_ptr + m * stride_xm + c0 + cols, mask=c_mask, other=0.0)
                    if HAS_RESIDUAL:
                        r = tl.load(r_ptr + m * stride_rm + c0 + cols, mask=c_mask, other=0.0)
                        h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
                        if pid == 0:
                            tl.store(nr_ptr + m * stride_nrm + c0 + cols, h, mask=c_mask)
                    hf = h.to(tl.float32)
                    sq += hf * hf
                var = tl.sum(sq, axis=0) / K
                rstd = tl.where(rm == m, tl.rsqrt(var + eps), rstd)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            xm_mask = m_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptrs, mask=xm_mask, other=0.0)
            if PROLOGUE == 1:  # the fused SiluAndMul's roundings (kernels/fused_act.py)
                up = tl.load(x_ptrs + K, mask=xm_mask, other=0.0).to(tl.float32)
                g = x.to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(dt)
                x = (act.to(tl.float32) * up).to(dt)
            if PROLOGUE == 2:  # the fused RMSNorm's roundings (kernels/fused_norm.py)
                if HAS_RESIDUAL:
                    r = tl.load(r_ptr + rm[:, None] * stride_rm + k0 + rk[None, :], mask=xm_mask,
                                other=0.0)  # fmt: skip
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
                x = (x.to(tl.float32) * rstd[:, None]).to(dt)
                nw = tl.load(nw_ptr + k0 + rk, mask=k_mask, other=0.0).to(tl.float32)
                x = (nw[None, :] * x.to(tl.float32)).to(dt)
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


def _prologue_config(prologue: int, n: int, k: int) -> tuple[int, int, int, int]:
    """``_config``'s tiles, with shorter K tiles / more warps where a prologue transforms x: its
    math runs on all 16 padded rows, and the plain tiles spill registers there (sm_90 cubins:
    the silu prologue at BLOCK_K 512 spilled 3,984 bytes per thread and ran ~15x slower)."""
    block_n, block_k, warps, stages = _config(n, k)
    if prologue == 1:
        return block_n, min(block_k, 256), 8, stages
    if prologue == 2:
        return block_n, min(block_k, 128), 8 if block_n >= 64 else warps, stages
    return block_n, block_k, warps, stages


def _launch(x, weight, bias, config, prologue=0, k=None, norm=None):
    """Launch the kernel on prepared inputs; ``k`` is the GEMM's K (x is [M, 2K] for the gated
    prologue); ``norm`` = (norm_weight, eps, residual, new_residual) for the RMSNorm prologue."""
    m = x.shape[0]
    k = x.shape[1] if k is None else k
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or _prologue_config(prologue, n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    norm_w, eps, res, new_res = norm if norm is not None else (weight, 0.0, None, None)
    has_res = res is not None
    r, nr = (res, new_res) if has_res else (x, x)  # placeholders, never touched
    grid = (triton.cdiv(n, block_n),)
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, y, r, norm_w, nr,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0), r.stride(0), nr.stride(0), eps,
        HAS_BIAS=bias is not None, PROLOGUE=prologue, HAS_RESIDUAL=has_res, BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK=min(triton.next_power_of_2(k), 4096),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


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
    return _launch(x, weight, bias, config)


def silu_mul_gemm(
    gate_up: torch.Tensor,  # [M, 2K]: [gate | up]
    weight: torch.Tensor,  # [N, K]
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # [M, N]
    """``(silu(gate) * up) @ weight.T`` in one launch, with the roundings of
    ``fused_act.silu_and_mul`` followed by :func:`skinny_gemm` (the same bits)."""
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * weight.shape[-1]:
        raise ValueError(
            f"gate_up must be [M, 2K] for a weight [N, K={weight.shape[-1]}], got "
            f"{tuple(gate_up.shape)}"
        )
    k = weight.shape[1]
    problem = _problem(gate_up[:, :k], weight, None)
    if problem is not None:
        raise ValueError(f"unsupported inputs for silu_mul_gemm: {problem}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    return _launch(gate_up, weight, None, config, prologue=1, k=k)


def rms_norm_gemm(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K] or None
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # y [M, N], new residual [M, K] or None
    """``RMSNorm(x + residual) @ weight.T + bias`` in one launch, with the roundings of
    ``fused_norm.fused_add_rms_norm`` (``fused_norm.rms_norm`` when ``residual`` is None); only
    the fp32 sum of squares may differ in summation order. Returns ``(y, x + residual)``."""
    problem = _problem(x, weight, bias)
    if problem is None and (norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype):
        problem = (
            f"norm weight {norm_weight.dtype} {tuple(norm_weight.shape)} is not [K] of x's dtype"
        )
    if (
        problem is None
        and residual is not None
        and (residual.shape != x.shape or residual.dtype != x.dtype)
    ):
        problem = f"residual {residual.dtype} {tuple(residual.shape)} is not like x"
    if problem is not None:
        raise ValueError(f"unsupported inputs for rms_norm_gemm: {problem}")
    x = x if x.stride(1) == 1 else x.contiguous()
    new_res = None
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        new_res = torch.empty_like(x, memory_format=torch.contiguous_format)
    norm = (norm_weight.contiguous(), float(eps), residual, new_res)
    return _launch(x, weight, bias, config, prologue=2, norm=norm), new_res
