"""Dynamic FP8 activation quantization (Triton kernels + torch reference).

Each row of ``x [M, K]`` is cut into groups of ``group`` columns (the last one may be shorter);
every group gets its own scale ``s = max(|x_group|, EPS) / 448`` and is stored as
``float8_e4m3fn(x / s)``. ``group = 128`` is transformers' fine-grained FP8 (per token, per
128-column group); ``group >= K`` is one scale per token (compressed-tensors' dynamic per-token
activations). The scales ``[M, ceil(K / group)]`` are float32 and multiply the values back.

``column_major=True`` lays the scales out as cuBLASLt's block-wise GEMM wants them: a ``[G, M]``
buffer seen as its transpose ``[M, G]`` with strides ``(1, M)``. The values are the same.

Two kernels, both CUDA-graph safe (shapes only, no data-dependent arguments):

* tiles (``group`` a power of 2 up to 1024, the fine-grained case; or one scale per token with
  K <= 16384, the row as one masked tile): one program reads ``GROUPS`` whole groups of one row
  once, keeps them in registers, and writes values and scales; at K = 14336, M = 8192 that is
  ~115k programs of 1024 elements each, one read and one write of ``x``, i.e. memory speed.
* loop (other groups, e.g. 48, or a row longer than 16384 per token): one program per (row,
  group), a loop of ``BLOCK`` columns for the amax and a second for the store, bounded
  registers.
"""

from __future__ import annotations

import torch

from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the reference is usable
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
EPS = 1e-10  # floor of a group's amax: an all-zero group gets a finite scale
TILE_ELEMENTS = 1024  # elements per program of the tile kernel (GROUPS = this // group)
ROW_ELEMENTS = 16384  # longest row quantized per token in one pass (registers)


def per_token_group_quant_ref(
    x: torch.Tensor,  # [M, K] float
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] fp8, [M, ceil(K / group)] fp32
    """Torch reference of :func:`per_token_group_quant` (fp32 math)."""
    m, k = x.shape
    g = -(-k // group)
    xf = x.float()
    pad = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    pad[:, :k] = xf
    amax = pad.view(m, g, group).abs().amax(dim=-1)  # [M, G]
    scale = amax.clamp(min=EPS) / FP8_MAX
    q = (xf / scale.repeat_interleave(group, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def dequantize_activation_ref(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``q * scale`` in fp32, the ``[M, ceil(K / group)]`` scales broadcast over their groups
    of ``group`` columns (the last group may be shorter, so ``K / G`` does not give it)."""
    k = q.shape[1]
    return q.float() * scale.float().repeat_interleave(min(group, k), dim=1)[:, :k]


def static_quant_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn(x / scale)`` with one per-tensor ``scale`` (static activations)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def empty_scales(m: int, num_groups: int, column_major: bool, device) -> torch.Tensor:
    """``[M, G]`` fp32, row-major or as cuBLASLt's block-wise GEMM wants it (strides (1, M))."""
    if column_major:
        return torch.empty(num_groups, m, dtype=torch.float32, device=device).t()
    return torch.empty(m, num_groups, dtype=torch.float32, device=device)


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _group_quant_tile_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        stride_sg,
        GROUP: tl.constexpr,  # a power of 2
        GROUPS: tl.constexpr,  # groups per program (a power of 2)
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
        mask = cols < K
        x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0  # [GROUPS]
        q = tl.clamp(x / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < K)

    @triton.jit
    def _group_quant_loop_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        stride_sg,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0).to(tl.int64)
        grp = tl.program_id(1)
        start = grp * GROUP
        end = tl.minimum(start + GROUP, K)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(start, end, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < end, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0), 1e-10) / 448.0
        tl.store(s_ptr + row * stride_sm + grp * stride_sg, scale)
        for c in range(start, end, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < end, other=0.0)
            q = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
            tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=cols < end)


def _problem(x: torch.Tensor, group: int) -> str | None:
    if x.dim() != 2 or x.stride(-1) != 1:
        return f"x must be [M, K] with a contiguous last dim, got {tuple(x.shape)}"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x must be fp16/bf16/fp32, got {x.dtype}"
    if group < 1:
        return f"group={group} must be >= 1"
    return None


def supports(x: torch.Tensor, group: int) -> bool:
    """Whether :func:`per_token_group_quant` takes these inputs (triton, CUDA or interpreter
    aside)."""
    return triton is not None and _problem(x, group) is None


def tile_group(group: int, k: int) -> int | None:
    """The tile kernel's GROUP for these inputs, or None (the loop kernel runs): ``group``
    itself when it is a power of 2 <= TILE_ELEMENTS below K; one per token (``group >= K``)
    with K <= ROW_ELEMENTS: the whole row as one masked power-of-2 tile."""
    if group >= k:
        return triton.next_power_of_2(k) if k <= ROW_ELEMENTS else None
    return group if group <= TILE_ELEMENTS and not group & (group - 1) else None


def per_token_group_quant(
    x: torch.Tensor,  # [M, K] float, last dim contiguous
    group: int,
    column_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] fp8, [M, ceil(K / group)] fp32
    """Quantize ``x`` to float8_e4m3fn with one scale per row and group of ``group`` columns
    (see the module docstring); ``column_major`` gives the scales strides ``(1, M)``.

    Raises:
        ValueError: ``x`` not a 2-D float tensor with a contiguous last dim, or ``group < 1``.
    """
    problem = _problem(x, group)
    if problem is not None:
        raise ValueError(f"per_token_group_quant: {problem}")
    m, k = x.shape
    group = min(group, k)
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = empty_scales(m, num_groups, column_major, x.device)
    if m == 0:
        return q, s
    args = (x, q, s, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1))
    tile = tile_group(group, k)
    if tile is not None:
        groups = max(1, min(TILE_ELEMENTS // tile, triton.next_power_of_2(num_groups)))
        grid = (m, triton.cdiv(num_groups, groups))
        warps = 4 if groups * tile <= 4096 else 8
        _group_quant_tile_kernel[grid](*args, GROUP=tile, GROUPS=groups, num_warps=warps,
                                       **pdl_kwargs(x))  # fmt: skip
        return q, s
    block = min(triton.next_power_of_2(group), 1024)
    _group_quant_loop_kernel[(m, num_groups)](
        *args, GROUP=group, BLOCK=block, num_warps=4 if block >= 512 else 1, **pdl_kwargs(x)
    )
    return q, s
