"""Block-scale FP8 GEMM through torch's ``F.scaled_mm`` (cuBLASLt block-wise scaling, Hopper).

``y = dequant(x_q) @ dequant(w).T`` with activations scaled per token and 128-column group
(``ScalingType.BlockWise1x128``) and weights per 128 x 128 block
(``ScalingType.BlockWise128x128``):

    F.scaled_mm(x_q, w.t(), x_s, BlockWise1x128, w_s.t(), BlockWise128x128, output_dtype=bf16)

* ``x_s [M, K / 128]`` must be column-major (strides ``(1, M)``; row-major is refused):
  ``fp8_quant.per_token_group_quant(x, 128, column_major=True)`` writes it so.
* ``w_s`` is the checkpoint's ``[N / 128, K / 128]``, passed as its transpose view
  (``[K / 128, N / 128]``, strides ``(1, K / 128)``), which torch's check wants with
  ``K / 128`` a multiple of 4.

* M any: cuBLASLt refuses (``CUBLAS_STATUS_NOT_SUPPORTED`` from its heuristic; seen on the
  H200 with torch 2.11 at M = 1, while M = 4, 16, 100, 1024 ran) unless the column-major
  ``x_s``'s leading dimension M is a multiple of 4 (16-byte-aligned fp32 columns). So
  :func:`pad_rows` pads M up to a multiple of ``ROW_MULTIPLE`` (zero values, scale 1.0) and the
  output is sliced back to M rows: two small copies, shapes fixed by M alone (CUDA-graph safe).

So the shapes it takes: K and N multiples of 128, K / 128 a multiple of 4, bf16 output. Where
``F.scaled_mm`` / ``ScalingType`` do not exist (torch before 2.10) or refuse, the Triton block
kernel (``fp8_gemm.py``) serves. The torch reference is ``fp8_gemm.w8a8_matmul_ref``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK = (128, 128)  # the only block the recipes describe
ROW_MULTIPLE = 4  # rows cuBLASLt's block-wise GEMM is given are a multiple of this (pad_rows)
_SCALING = getattr(F, "ScalingType", None)
_SCALED_MM = getattr(F, "scaled_mm", None)


def available() -> bool:
    """Whether this torch has ``F.scaled_mm`` with block-wise recipes."""
    return (
        _SCALED_MM is not None
        and _SCALING is not None
        and hasattr(_SCALING, "BlockWise1x128")
        and hasattr(_SCALING, "BlockWise128x128")
    )


def shape_problem(n: int, k: int, block, out_dtype: torch.dtype) -> str | None:
    """Why the cuBLASLt block-wise GEMM cannot take a ``[N, K]`` weight, or None (device and
    torch version aside)."""
    if tuple(block) != BLOCK:
        return f"weight_block_size={tuple(block)}: cuBLASLt block-wise takes only {BLOCK}"
    if n % 128 or k % 128 or (k // 128) % 4:
        return f"N={n}, K={k}: cuBLASLt block-wise needs N, K multiples of 128 and K/128 of 4"
    if out_dtype != torch.bfloat16:
        return f"output dtype {out_dtype}: cuBLASLt block-wise writes bfloat16"
    return None


def device_ok(device: torch.device) -> bool:
    """Block-wise scaling runs on Hopper (compute capability 9.x) in torch's CUDA build."""
    return device.type == "cuda" and _hopper(device.index)


@functools.cache
def _hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def pad_rows(
    x_q: torch.Tensor,  # [M, K] fp8
    x_s: torch.Tensor,  # [M, G] fp32, column-major (any strides at M = 1)
    multiple: int = ROW_MULTIPLE,
) -> tuple[torch.Tensor, torch.Tensor]:  # [Mp, K] fp8, [Mp, G] strides (1, Mp)
    """The operands padded to ``Mp = ceil(M / multiple) * multiple`` rows for cuBLASLt: padded
    rows hold 0.0 values and scale 1.0 (finite, so they multiply to exact zeros); the scales come
    back column-major. As given when M is already a multiple (and ``x_s`` column-major). No host
    sync and no shape but M's: safe under CUDA-graph capture."""
    m = x_q.shape[0]
    pad = -m % multiple
    if pad == 0 and x_s.stride(0) == 1:
        return x_q, x_s
    # F.pad has no float8 kernel; the byte 0x00 is +0.0 in float8_e4m3fn
    q = F.pad(x_q.view(torch.uint8), (0, 0, 0, pad)).view(x_q.dtype)  # [Mp, K]
    s = F.pad(x_s.t(), (0, pad), value=1.0).contiguous()  # [G, Mp]
    return q.contiguous(), s.t()


def block_scaled_mm(
    x_q: torch.Tensor,  # [M, K] fp8, row-major
    x_s: torch.Tensor,  # [M, K / 128] fp32, strides (1, M)
    weight: torch.Tensor,  # [N, K] fp8
    w_s: torch.Tensor,  # [N / 128, K / 128] fp32, contiguous
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] out_dtype
    """cuBLASLt block-wise FP8 GEMM (see the module docstring).

    Raises:
        ValueError: this torch has no block-wise ``F.scaled_mm``, shapes it does not take, or
            row-major activation scales.
    """
    if not available():
        raise ValueError(
            f"block_scaled_mm: torch {torch.__version__} has no block-wise F.scaled_mm"
        )
    n, k = weight.shape
    problem = shape_problem(n, k, BLOCK, out_dtype)
    if problem is not None:
        raise ValueError(f"block_scaled_mm: {problem}")
    m = x_q.shape[0]
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x_q.device)
    if x_s.shape != (m, k // 128) or (m > 1 and x_s.stride(0) != 1):
        raise ValueError(
            f"block_scaled_mm: x_s {tuple(x_s.shape)} strides {x_s.stride()} must be "
            f"[{m}, {k // 128}] column-major (per_token_group_quant(..., column_major=True))"
        )
    x_q, x_s = pad_rows(x_q, x_s)  # [Mp, K], [Mp, K / 128] strides (1, Mp)
    y = _SCALED_MM(x_q, weight.t(), x_s, _SCALING.BlockWise1x128, w_s.t(),
                   _SCALING.BlockWise128x128, output_dtype=out_dtype)  # fmt: skip
    y = y[:m]  # [M, N], contiguous (leading rows)
    return y if bias is None else y + bias
